"""The offline fallback corpus trains into its own default run folder.

With data.path an unreachable URL that is not cached, the run trains on the Python standard
library's text. With trainer.run_dir left at its default, that run goes to runs/python_stdlib
(named in the warning line), never into runs/shakespeare_char, whose sample prompt "ROMEO:"
would then print Python code. A run_dir the user set is kept.
"""
from __future__ import annotations

import main as app
import sample
from config import DataConfig, TrainerConfig
from corpus.text import corpus_cache_path
from test_data import closed_port
from testing.local import CORPUS, TINY


def test_offline_fallback_trains_into_its_own_default_run_folder(tmp_path, monkeypatch, recwarn, capsys):
    monkeypatch.chdir(tmp_path)  # the default run folder is relative: runs/ lands here
    unreachable = f"http://127.0.0.1:{closed_port()}/tinyshakespeare.txt"
    args = TINY + ["parallel.strategy=none", "trainer.max_steps=2", "trainer.sample_tokens=0",
                   f"data.path={unreachable}", f"data.cache_dir={tmp_path / 'cache'}", "data.sha256="]
    assert TrainerConfig.run_dir == "runs/shakespeare_char"
    assert app.main(args) == 0
    warned = [str(w.message) for w in recwarn if "cannot download" in str(w.message)]
    assert len(warned) == 1 and "runs/python_stdlib" in warned[0], warned
    # it names the file that makes the corpus work offline, and the other way out
    cached = corpus_cache_path(DataConfig(path=unreachable, cache_dir=str(tmp_path / "cache")))
    assert f"put the file at {cached}" in warned[0] and "data.path=FILE" in warned[0], warned
    assert (tmp_path / "runs" / "python_stdlib" / "model.pt").is_file()
    assert not (tmp_path / "runs" / "shakespeare_char").exists()
    assert "python-stdlib-fallback" in capsys.readouterr().out
    # a run folder the user named is where the run goes, fallback or not
    assert app.main(args + ["trainer.run_dir=mine"]) == 0
    assert (tmp_path / "mine" / "model.pt").is_file()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["python_stdlib"]


def test_offline_the_quickstart_names_the_fallback_run_and_a_vocabulary_that_does_not_fit(tmp_path, monkeypatch,
                                                                                           capsys):
    """Offline, the quickstart's sample command names the folder the fallback run trained into;
    a fine-tune whose corpus fell back to text outside the init_from model's vocabulary says so,
    naming the model and the corpus it was trained on (not the sample prompt's wording)."""
    monkeypatch.chdir(tmp_path)
    unreachable = f"http://127.0.0.1:{closed_port()}/tinyshakespeare.txt"
    offline = [f"data.path={unreachable}", f"data.cache_dir={tmp_path / 'cache'}", "data.sha256="]
    base = TINY + ["parallel.strategy=none", "trainer.max_steps=2", "trainer.sample_tokens=0"]
    assert app.main(base + offline) == 0
    capsys.readouterr()
    assert sample.main(["--run-dir", "runs/shakespeare_char", "--prompt", "ROMEO:"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "python sample.py --run-dir runs/python_stdlib" in err, err
    # a Shakespeare model fine-tuned on the fallback text (which has '{'): the vocabularies differ
    assert app.main(base + ["trainer.run_dir=shakespeare"]) == 0
    capsys.readouterr()
    assert app.main(base + offline + ["model.init_from=shakespeare/model.pt", "trainer.run_dir=ft"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not fit the vocabulary of model.init_from shakespeare/model.pt" in err, err
    assert f"(trained on {CORPUS})" in err and "python-stdlib-fallback" in err, err
