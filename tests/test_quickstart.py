"""The README's quickstart, run as written: every command of its first bash block after the venv and
pip lines (CI installs the requirements itself), with `trainer.max_steps=3` appended to each
training command so it takes seconds. The default corpus URL is served from a pre-seeded cache
(the shared Tiny Shakespeare, whose sha256 the config checks), since CI is offline."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from config import DataConfig
from corpus.text import corpus_cache_path
from harness import clean_checkout
from testing.local import CORPUS, REPO, TORCHRUN, child_env, multiprocess_lock

pytestmark = pytest.mark.launch

SHORT = ["trainer.max_steps=3", "trainer.eval_batches=2"]


def quickstart_commands() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Quickstart\n.*?```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no '## Quickstart' section with a bash block"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_quickstart_commands_work_in_order(tmp_path):
    commands = quickstart_commands()
    assert len(commands) <= 15 and commands[0].startswith("python3 -m venv") and \
        commands[1].startswith("pip install"), commands
    work = clean_checkout(tmp_path / "clone")  # a copy of the tracked files: runs/ and compare.png land there
    home = tmp_path / "home"
    cached = corpus_cache_path(DataConfig(cache_dir=str(home / ".cache" / "mingpt-parallel")))
    cached.parent.mkdir(parents=True)
    shutil.copy(CORPUS, cached)
    env = child_env(HOME=str(home))
    for command in commands[2:]:
        argv = shlex.split(command)
        if argv[0] == "torchrun":
            argv = [*TORCHRUN, *argv[1:], *SHORT]
        elif argv[0] == "python":
            argv = [sys.executable, *argv[1:], *(SHORT if argv[1] == "main.py" else [])]
        else:
            raise AssertionError(f"unexpected quickstart command: {command}")
        with multiprocess_lock():
            r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{command}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        assert "warning: cannot download" not in r.stderr, r.stderr  # trained on Shakespeare
        if argv[1] == "sample.py":
            assert r.stdout.startswith("ROMEO:"), r.stdout[:200]
    for run in ("shakespeare_char", "ddp2"):
        assert (work / "runs" / run / "model.pt").is_file() and (work / "runs" / run / "sample.txt").is_file()
    meta = json.loads((work / "runs" / "ddp2" / "snapshots" / "step_0000003" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["strategy"] == "ddp"  # the torchrun line ran 2 ranks
    assert (work / "compare.png").stat().st_size > 10_000
    assert not os.path.exists(REPO / "compare.png")
