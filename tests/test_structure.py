"""The shape of the tree: the application's modules (every .py outside tests/, benchmarks/ and
docs/) import each other without a cycle and only down the floors of LAYERS (type-only and
importlib imports included; config.py imports nothing of the project), the repository root holds few Python files, no
application file or function is too long to read in one sitting, strategy names are never taken
apart with split("-") (parallel.options.Engine names them), no comment or docstring cites an
issue number, which a reader of the repository cannot look up, and the hook points of
observe/hooks.py, where the tests put their faults, import nothing of the project."""
from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from dataclasses import dataclass

import pytest

from testing.local import REPO

NOT_APPLICATION = ("tests", "benchmarks", "docs")
MAX_ROOT_PY_FILES = 12
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\s*\d+", re.I)  # the word, then a number (maybe after "#")


def python_files() -> list[str]:
    """Every .py of the checkout (tracked, or new and not ignored), relative to the root."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return sorted(p for p in set(listed) if (REPO / p).is_file())


def application_files() -> list[str]:
    return [p for p in python_files() if p.split("/")[0] not in NOT_APPLICATION]


def module_name(path: str) -> str:
    parts = path[:-len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# ----------------------------------------------------------------------------- imports


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported project module
    line: int
    where: str  # "module level" or "in <function>"


def _dynamic_import(node: ast.AST) -> str | None:
    """The module of `importlib.import_module("x")` or `__import__("x")` with a constant name."""
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str):
        func = ast.unparse(node.func)
        if func in ("importlib.import_module", "import_module", "__import__"):
            return node.args[0].value
    return None


def _imports(tree: ast.Module):
    """(node, enclosing function or None) of every import: type-only ones (`if TYPE_CHECKING:`)
    included, and importlib's with a constant name (as an ast.Import of that name)."""
    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, function
            elif (name := _dynamic_import(child)) is not None:
                yield ast.Import(names=[ast.alias(name=name)], lineno=child.lineno), function
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            yield from visit(child, inner)
    yield from visit(tree, None)


def _with_packages(name: str, modules: set[str]) -> list[str]:
    """`name` and each project package above it: importing a.b.c runs a/__init__ and a/b/__init__."""
    parts = name.split(".")
    return [m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in modules]


def _targets(node, source: str, is_package: bool, modules: set[str]) -> list[str]:
    """The project modules an import statement runs. A package above `source` counts only where the
    statement names it (`import pkg`, or `from pkg import NAME` of a name that is no submodule): that
    importing pkg.sibling first runs pkg/__init__.py is the face of a package (its __init__ hands
    its modules' names on), no cycle."""
    ancestors = {".".join(source.split(".")[:i]) for i in range(1, source.count(".") + 1)}
    if isinstance(node, ast.Import):
        return [t for alias in node.names for t in _with_packages(alias.name, modules)
                if t not in ancestors or t == alias.name]
    base = node.module or ""
    if node.level:  # relative: from the importing module's package
        package = source.split(".") if is_package else source.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    names_base = any(f"{base}.{alias.name}" not in modules for alias in node.names)
    found = [t for t in (_with_packages(base, modules) if base else [])
             if t not in ancestors or (t == base and names_base)]
    for alias in node.names:  # `from pkg import module` imports a submodule
        sub = f"{base}.{alias.name}" if base else alias.name
        if sub in modules:
            found.append(sub)
    return found


def import_edges() -> list[Edge]:
    files = application_files()
    modules = {module_name(p) for p in files}
    edges = []
    for path in files:
        source = module_name(path)
        tree = ast.parse((REPO / path).read_text(encoding="utf-8"), path)
        for node, function in _imports(tree):
            for target in _targets(node, source, path.endswith("__init__.py"), modules):
                if target != source:
                    where = f"in {function}()" if function else "module level"
                    edges.append(Edge(source, target, node.lineno, where))
    return edges


def find_cycle(edges: list[Edge]) -> list[Edge] | None:
    """One import cycle as the edges that close it, or None (depth-first search)."""
    out: dict[str, list[Edge]] = {}
    for e in edges:
        out.setdefault(e.source, []).append(e)
    entered: dict[str, int] = {}  # module on the current path -> its index in `path`
    done: set[str] = set()
    path: list[Edge] = []

    def dfs(node: str) -> list[Edge] | None:
        entered[node] = len(path)
        for e in out.get(node, []):
            if e.target in entered:
                return path[entered[e.target]:] + [e]
            if e.target not in done:
                path.append(e)
                found = dfs(e.target)
                if found:
                    return found
                path.pop()
        del entered[node]
        done.add(node)
        return None

    for node in sorted(out):
        if node not in done:
            found = dfs(node)
            if found:
                return found
    return None


@pytest.mark.launch
def test_no_import_cycle_among_the_application_modules():
    edges = import_edges()
    assert any(e.source == "main" and e.target == "config" for e in edges), "the scan finds no imports"
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(
        [cycle[0].source] + [f"{e.target} ({e.source}.py:{e.line}, {e.where})" for e in cycle])


# ----------------------------------------------------------------------------- layers

# The house from the top floor down: a module may import its own package and the floors below,
# never a floor above or another package of its own floor. Commands at the top; the test support
# and the tools run the app from outside; the launcher builds the parts and runs one launch; the
# planner is arithmetic on the config; checks.py holds a config against the rest; the Trainer runs
# the loop over the parts it is given; the guards watch it; below them the engines, each using only
# those under it; config.py at the bottom imports nothing of the project.
LAYERS = (
    ("commands", ("main", "sample", "export", "prepare", "plot", "scripts")),
    ("test support", ("testing",)),
    ("tools", ("tools",)),
    ("launcher", ("launch",)),
    ("planner", ("planner",)),
    ("checks", ("checks",)),
    ("trainer", ("trainer",)),
    ("guards", ("guards",)),
    ("weights", ("weights",)),
    ("snapshots", ("snapshots",)),
    ("corpus", ("corpus",)),
    ("batches", ("char_dataset",)),
    ("observe", ("observe",)),
    ("parallel", ("parallel",)),
    ("model", ("model",)),
    ("storage", ("storage",)),
    ("config", ("config",)),
)
HOOKS = "observe.hooks"  # the hook points where the tests' faults (testing/faults.py) are put


def floor_of(module: str) -> tuple[int, str] | None:
    """(height, name) of the module's floor: the top floor is the highest; None if on none."""
    top = module.split(".")[0]
    for i, (name, roots) in enumerate(LAYERS):
        if top in roots:
            return len(LAYERS) - i, name
    return None


def layer_violations(edges: list[Edge]) -> list[str]:
    """Imports that look up or sideways (to another package of the same floor), a module on no
    floor, and the hook module importing any other project module."""
    found = []
    for e in edges:
        source, target = floor_of(e.source), floor_of(e.target)
        where = f"(line {e.line}, {e.where})"
        if source is None or target is None:
            found.append(f"{e.source if source is None else e.target} is on no floor of LAYERS {where}")
        elif e.source.split(".")[0] != e.target.split(".")[0] and target[0] >= source[0]:
            way = "up" if target[0] > source[0] else "sideways"
            found.append(f"{e.source} ({source[1]}) imports {e.target} ({target[1]}): {way} {where}")
        elif e.source == HOOKS and e.target != "observe":
            found.append(f"{HOOKS} imports {e.target} {where}: the hook points import nothing of the project")
    return sorted(set(found))


@pytest.mark.launch
def test_imports_only_look_down_the_floors_type_only_and_importlib_included():
    edges = import_edges()
    assert any(e.source == "trainer" and e.target == HOOKS for e in edges), "the scan finds no hook point import"
    problems = layer_violations(edges)
    assert not problems, "imports against the floors:\n" + "\n".join(problems)


@pytest.mark.launch
def test_config_imports_nothing_of_the_project():
    assert [e for e in import_edges() if e.source == "config"] == []


# ----------------------------------------------------------------------------- sizes


@pytest.mark.launch
def test_the_repository_root_holds_at_most_12_python_files():
    root = [p for p in python_files() if "/" not in p]
    assert len(root) <= MAX_ROOT_PY_FILES, f"{len(root)} Python files at the root: {root}"


@pytest.mark.launch
def test_no_application_file_is_over_400_lines():
    long = {p: n for p in application_files()
            if (n := len((REPO / p).read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES}
    assert not long, f"over {MAX_FILE_LINES} lines: " + ", ".join(f"{p} ({n})" for p, n in sorted(long.items()))


def functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, first line, lines) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{node.name}", node.lineno, node.end_lineno - node.lineno + 1
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


@pytest.mark.launch
def test_no_application_function_is_over_60_lines():
    long = []
    for path in application_files():
        tree = ast.parse((REPO / path).read_text(encoding="utf-8"), path)
        long += [f"{path}:{line} {name} ({n} lines)" for name, line, n in functions(tree) if n > MAX_FUNCTION_LINES]
    assert not long, f"{len(long)} functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


# ----------------------------------------------------------------------------- strategy names, issue numbers


def dash_splits(tree: ast.AST) -> list[tuple[int, str]]:
    """`x.split("-")` (or rsplit/partition/rpartition) where x names a strategy."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("split", "rsplit", "partition", "rpartition")
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "-"
                and "strategy" in ast.unparse(node.func.value).lower()):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def issue_citations(text: str) -> list[tuple[int, str]]:
    """Comments and docstrings that cite an issue number."""
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
             if tok.type == tokenize.COMMENT and ISSUE_NUMBER.search(tok.string)]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and ISSUE_NUMBER.search(doc):
                found.append((node.body[0].lineno, ISSUE_NUMBER.search(doc).group(0)))
    return sorted(found)


@pytest.mark.launch
def test_no_dash_split_of_strategy_names_and_no_issue_numbers_in_application_code():
    problems = []
    for path in application_files():
        text = (REPO / path).read_text(encoding="utf-8")
        problems += [f"{path}:{line} splits a strategy name: {code}" for line, code in dash_splits(ast.parse(text))]
        problems += [f"{path}:{line} cites an issue number: {what.strip()}" for line, what in issue_citations(text)]
    assert not problems, "\n".join(problems)


def test_the_checks_see_what_they_look_for():
    """The scanners above on small samples: a cycle, a TYPE_CHECKING import, an import against the
    layers, a long function, a dash split of a strategy name and an issue citation are found; their
    harmless look-alikes not."""
    a_b = [Edge("a", "b", 1, "module level"), Edge("b", "c", 1, "in f()"), Edge("c", "a", 2, "module level")]
    assert [e.source for e in find_cycle(a_b)] == ["a", "b", "c"]
    assert find_cycle(a_b[:2]) is None
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\nelse:\n    import y\n"
                     "def f():\n    import z\n")
    assert [(getattr(n, "module", None) or n.names[0].name, f) for n, f in _imports(tree)] == [
        ("typing", None), ("x", None), ("y", None), ("z", "f")]
    assert _targets(ast.parse("from parallel import env").body[0], "main", False, {"parallel", "parallel.env"}) \
        == ["parallel", "parallel.env"]
    package = {"p", "p.a", "p.b"}  # p/__init__.py hands on p.a's names; p.b imports p.a, or a name of p
    assert _targets(ast.parse("from p.a import f").body[0], "p.b", False, package) == ["p.a"]
    assert _targets(ast.parse("from p import f").body[0], "p.b", False, package) == ["p"]
    assert _targets(ast.parse("from p import a").body[0], "p.b", False, package) == ["p.a"]
    assert [n for n, _, lines in functions(ast.parse("class A:\n    def m(self):\n" + "        x = 1\n" * 60))
            if lines > MAX_FUNCTION_LINES] == ["A.m"]
    code = 'a = strategy.split("-")[1]\nb = cfg.parallel.strategy.partition("-")\nc = date.split("-")\n'
    assert [line for line, _ in dash_splits(ast.parse(code))] == [1, 2]
    level = "module level"
    layered = [Edge("snapshots.store", "testing.faults", 5, level), Edge("trainer", "launch.schedule", 10, level),
               Edge("corpus.text", "snapshots.format", 2, level), Edge("observe.hooks", "parallel.env", 3, "in f()"),
               Edge("observe", "observe.hooks", 1, level), Edge("launch.app", "launch.build", 1, level),
               Edge("tools.dry_run", "launch.build", 1, level), Edge("corpus.text", "char_dataset", 1, level),
               Edge("trainer", "nowhere", 1, level)]
    assert [p.split()[0] for p in layer_violations(layered)] == [
        "corpus.text", "nowhere", "observe.hooks", "snapshots.store", "trainer"]
    tree = ast.parse("import importlib\ndef f():\n    importlib.import_module('launch.app')\n    __import__('x')\n")
    assert [(n.names[0].name, f) for n, f in _imports(tree)] == [("importlib", None), ("launch.app", "f"), ("x", "f")]
    cite = "issue" + " 12"  # spelled apart: a grep for issue citations finds none in this file
    text = f'"""Doc ({cite})."""\nx = 1  # see {cite.title()}\ny = "{cite} in a string is no comment"  # pytorch#135712\n'
    assert [line for line, _ in issue_citations(text)] == [1, 2]
