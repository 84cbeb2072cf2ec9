"""The shape of the tree: the application's modules (every .py outside tests/, benchmarks/ and
docs/) import each other without a cycle, the repository root holds few Python files, no
application file or function is too long to read in one sitting, strategy names are never taken
apart with split("-") (parallel.options.Engine names them), no comment or docstring cites an
issue number, which a reader of the repository cannot look up, and the lower layers reach the
test faults only through the hook points of observe/hooks.py, which imports nothing of the project."""
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


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module):
    """(node, enclosing function or None) of every import, skipping `if TYPE_CHECKING:` bodies."""
    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for orelse in child.orelse:
                    yield from visit_one(orelse, function)
                continue
            yield from visit_one(child, function)

    def visit_one(child, function):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, function
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

FAULTS = "testing.faults"  # the test faults, installed into the hook points by launch/app.py
HOOKS = "observe.hooks"  # the hook points the lower layers call
BELOW_FAULTS = ("parallel", "snapshots", "storage", "corpus", "observe", "model", "char_dataset", "trainer")
BELOW_LAUNCH = ("snapshots",)  # imports nothing under launch/ at all


def _under(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in roots)


def layer_violations(edges: list[Edge]) -> list[str]:
    """A lower layer (BELOW_FAULTS) importing testing.faults, snapshots/ importing anything under
    launch/, and the hook module or its package importing any other project module."""
    own = {HOOKS, HOOKS.rpartition(".")[0]}
    found: dict[tuple[str, int], Edge] = {}
    for e in edges:
        wrong = ((_under(e.source, BELOW_FAULTS) and e.target == FAULTS)
                 or (_under(e.source, BELOW_LAUNCH) and _under(e.target, ("launch",)))
                 or (e.source in own and e.target not in own))
        seen = found.get((e.source, e.line))
        if wrong and (seen is None or len(e.target) > len(seen.target)):  # testing.faults, not launch
            found[(e.source, e.line)] = e
    return [f"{e.source} imports {e.target} (line {e.line}, {e.where})" for e in found.values()]


@pytest.mark.launch
def test_lower_layers_reach_the_faults_only_through_the_hook_points():
    edges = import_edges()
    assert any(e.source == "trainer" and e.target == HOOKS for e in edges), "the scan finds no hook point import"
    problems = layer_violations(edges)
    assert not problems, "imports against the layers:\n" + "\n".join(problems)


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
        ("typing", None), ("y", None), ("z", "f")]
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
    layered = [Edge("snapshots.store", "launch", 5, level), Edge("snapshots.store", "testing.faults", 5, level),
               Edge("trainer", "testing.faults", 9, level), Edge("trainer", "launch.schedule", 10, level),
               Edge("observe.hooks", "parallel.env", 3, "in f()"), Edge("observe", "observe.hooks", 1, level),
               Edge("launch.app", "testing.faults", 1, level)]
    assert [p.split()[0] for p in layer_violations(layered)] == ["snapshots.store", "trainer", "observe.hooks"]
    cite = "issue" + " 12"  # spelled apart: a grep for issue citations finds none in this file
    text = f'"""Doc ({cite})."""\nx = 1  # see {cite.title()}\ny = "{cite} in a string is no comment"  # pytorch#135712\n'
    assert [line for line, _ in issue_citations(text)] == [1, 2]
