"""Every code block of README.md that a CPU machine can run, run as pasted in a clean checkout,
offline: the corpus cache seeded by the README's own offline command, step counts shortened as
tests/readme_blocks.md says (which lists every block: run, or why not). tests/test_quickstart.py
runs the quickstart alone; this test runs the whole page in order, so each command finds what the
README's earlier ones left (the default run's snapshots for export.py --step, the fine-tune's model.pt).
The checkout is a git repository: after the last command `git status` is clean (.gitignore holds
what the README writes)."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import clean_checkout
from testing.local import CORPUS, REPO, child_env, multiprocess_lock

BLOCKS_LIST = Path(__file__).with_name("readme_blocks.md")
SCALE = 250  # README step counts / SCALE (tests/readme_blocks.md)
DEFAULT_STEPS = 2000  # trainer.max_steps's default, what a training command without it runs
SHORT = ["trainer.save_every=2", "trainer.eval_batches=2"]


def readme_units(text: str) -> list[tuple[str, str]]:
    """(kind, code) of README.md in order: each command of a bash block (continuations joined,
    comments dropped), each python block whole, each block without a language by its first line."""
    units = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if lang == "bash":
            for line in body.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                if line and not line.startswith("#"):
                    units.append(("bash", " ".join(line.split())))
        elif lang == "python":
            units.append(("python", body))
        else:
            units.append(("text", body))
    return units


def unit_key(kind: str, code: str) -> str:
    """How tests/readme_blocks.md names a unit: a command as written, a block by its first line."""
    first = " ".join(code.splitlines()[0].split())
    return code if kind == "bash" else f"({kind} block) {first}"


def listed() -> dict[str, str]:
    """tests/readme_blocks.md's table: code -> its verdict ('run...' or 'no: why')."""
    rows = re.findall(r"^\| [^|]+ \| `(.+)` \| (.+) \|$", BLOCKS_LIST.read_text(encoding="utf-8"), re.M)
    return {" ".join(code.split()): verdict for code, verdict in rows}


def scaled(command: str) -> str:
    """The command with its step counts divided by SCALE and, for a training run, SHORT appended."""
    argv = shlex.split(command)
    if argv[0] not in ("python", "torchrun"):  # a shell line (`mkdir -p ... && cp ...`): as written
        return command
    if "main.py" not in argv or "--plan" in argv:
        argv = [re.sub(r"model_step_(\d+)\.pt", lambda m: f"model_step_{int(m[1]) // SCALE:07d}.pt", a) for a in argv]
        return shlex.join([str(int(a) // SCALE) if i and argv[i - 1] == "--step" else a for i, a in enumerate(argv)])
    steps = [a for a in argv if a.startswith("trainer.max_steps=")]
    argv = [f"trainer.max_steps={max(1, int(a.split('=')[1]) // SCALE)}" if a in steps else a for a in argv]
    return shlex.join(argv + ([] if steps else [f"trainer.max_steps={DEFAULT_STEPS // SCALE}"]) + SHORT)


def test_the_block_list_names_every_readme_block_once():
    units = [unit_key(kind, code) for kind, code in readme_units((REPO / "README.md").read_text(encoding="utf-8"))]
    table = listed()
    assert sorted(set(units) - set(table)) == [], f"README code missing from {BLOCKS_LIST.name}"
    assert sorted(set(table) - set(units)) == [], f"{BLOCKS_LIST.name} lists code the README does not have"
    assert all(v.startswith("run") or v.startswith("no: ") for v in table.values()), table


@pytest.mark.launch
def test_every_readme_block_a_cpu_can_run_runs_as_pasted_offline(tmp_path):
    work = clean_checkout(tmp_path / "clone")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "clone"]):
        subprocess.run([*git, *args], cwd=work, check=True, capture_output=True)
    text = CORPUS.read_text(encoding="utf-8")
    shutil.copy(CORPUS, work / "input.txt")  # what the user downloaded (the offline block)
    (work / "data" / "books").mkdir(parents=True)  # prepare.py's inputs: the user's text files
    (work / "data" / "books" / "a.txt").write_text(text[:300_000], encoding="utf-8")
    (work / "data" / "books" / "b.txt").write_text(text[300_000:600_000], encoding="utf-8")
    (work / "extra.txt").write_text(text[600_000:], encoding="utf-8")
    home = tmp_path / "home"
    home.mkdir()
    bin_dir = str(Path(sys.executable).parent)  # `python` and `torchrun` of this environment
    env = child_env(HOME=str(home), PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    env.pop("PYTHONPATH")  # the checkout's own code, as a user's shell has it
    table = listed()
    units = [(kind, code) for kind, code in readme_units((REPO / "README.md").read_text(encoding="utf-8"))
             if table[unit_key(kind, code)].startswith("run")]
    units.sort(key=lambda u: not table[unit_key(*u)].startswith("run, first"))  # the offline seed first
    assert 15 <= len(units) <= 25, len(units)  # a few minutes in all
    for kind, code in units:
        if kind == "python":
            (work / "readme_snippet.py").write_text(code, encoding="utf-8")
            argv, shown = [sys.executable, "readme_snippet.py"], code
        else:
            shown = scaled(code)
            argv = ["bash", "-c", shown]
        with multiprocess_lock():
            r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{shown}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        assert "cannot download" not in r.stderr and "Traceback" not in r.stderr, f"{shown}\n{r.stderr[-2000:]}"
        if "--prompt \"ROMEO:\"" in code or kind == "python":
            assert r.stdout.startswith("ROMEO:"), f"{shown}\n{r.stdout[:300]}"
        if "--plan" in code:
            assert "zero-3=fsdp" in r.stdout, r.stdout[:2000]
    for brought in ("readme_snippet.py", "extra.txt"):  # the test's own and the user's file, not outputs
        (work / brought).unlink()
    assert (work / "runs" / "shakespeare_char" / "model_step_0000006.pt").is_file()
    assert (work / "hf" / "shakespeare_char" / "config.json").is_file()
    for run in ("shakespeare_char", "ddp2", "bpe", "cpu_speedrun", "shakespeare_ft", "books"):
        assert (work / "runs" / run / "model.pt").is_file(), run
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=work,
                            capture_output=True, text=True, check=True).stdout
    assert status == "", f"the README's outputs that .gitignore misses:\n{status}"
