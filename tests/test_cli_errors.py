"""Bad input: one clear message naming the file and field, a non-zero exit, and an existing run
directory left exactly as it was."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from lm_pretrain_support import forgebench, make_corpus, tree_digest, write_config

from engine.cli import main
from engine.errors import ForgebenchError


@pytest.fixture(scope="module")
def existing(tmp_path_factory):
    """A corpus, a config and a completed 2-step run that the error cases must not disturb."""
    root = tmp_path_factory.mktemp("cli")
    corpus = make_corpus(root)
    config = write_config(root / "tiny.toml", corpus, steps=2)
    assert main(["run", str(config), "--out", str(root / "run"), "--threads", "1"]) == 0
    return root, corpus, config, root / "run"


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    message = err[err.index("error: "):] if "error: " in err else err
    return code, message


def one_message(message: str) -> None:
    assert message.count("error: ") == 1 and "Traceback" not in message


def test_malformed_toml(tmp_path, capsys, existing):
    bad = tmp_path / "bad.toml"
    bad.write_text('recipe = "lm-pretrain"\nsteps = \n')
    code, message = run_cli(capsys, "run", str(bad), "--out", str(tmp_path / "out"))
    assert code == 2 and str(bad) in message and "malformed TOML" in message
    assert "line 2" in message
    one_message(message)
    assert not (tmp_path / "out").exists()


def test_unknown_key(tmp_path, capsys, existing):
    _, corpus, _, _ = existing
    config = write_config(tmp_path / "c.toml", corpus).read_text().replace("dim = 32",
                                                                          "dimm = 32")
    (tmp_path / "c.toml").write_text(config)
    code, message = run_cli(capsys, "run", str(tmp_path / "c.toml"), "--out", str(tmp_path / "o"))
    assert code == 2 and str(tmp_path / "c.toml") in message
    assert "field 'model.dimm': unknown key" in message
    one_message(message)
    assert not (tmp_path / "o").exists()


def test_wrong_type(tmp_path, capsys, existing):
    _, corpus, _, _ = existing
    text = write_config(tmp_path / "c.toml", corpus).read_text().replace("batch_size = 4",
                                                                        'batch_size = "four"')
    (tmp_path / "c.toml").write_text(text)
    code, message = run_cli(capsys, "run", str(tmp_path / "c.toml"), "--out", str(tmp_path / "o"))
    assert code == 2 and "field 'train.batch_size'" in message and "'four'" in message
    one_message(message)


def test_missing_data_file(tmp_path, capsys, existing):
    corpus = make_corpus(tmp_path)
    (corpus / "val.txt").unlink()
    config = write_config(tmp_path / "c.toml", corpus)
    code, message = run_cli(capsys, "run", str(config), "--out", str(tmp_path / "o"))
    assert code == 2 and str(corpus / "val.txt") in message and "field 'data.dir'" in message
    assert "missing" in message
    one_message(message)
    assert not (tmp_path / "o").exists()


def test_empty_corpus(tmp_path, capsys, existing):
    corpus = make_corpus(tmp_path)
    (corpus / "train.txt").write_text("")
    config = write_config(tmp_path / "c.toml", corpus)
    code, message = run_cli(capsys, "run", str(config), "--out", str(tmp_path / "o"))
    assert code == 2 and str(corpus / "train.txt") in message and "empty" in message
    one_message(message)
    assert not (tmp_path / "o").exists()


def test_non_empty_output_directory(capsys, existing):
    _, _, config, run = existing
    before = tree_digest(run)
    code, message = run_cli(capsys, "run", str(config), "--out", str(run))
    assert code == 2 and str(run) in message and "not empty" in message
    one_message(message)
    assert tree_digest(run) == before


def test_resume_after_data_changed(capsys, existing):
    _, corpus, _, run = existing
    before = tree_digest(run)
    train = corpus / "train.txt"
    original = train.read_bytes()
    try:
        train.write_bytes(original.replace(b"red", b"pink", 1))
        code, message = run_cli(capsys, "resume", str(run), "--steps", "4")
    finally:
        train.write_bytes(original)
    assert code == 2 and "train.txt has a different SHA-256" in message
    assert str(run / "run.json") in message and "field 'data'" in message
    one_message(message)
    assert tree_digest(run) == before


def test_resume_of_a_running_run(capsys, existing):
    """A job holding the run lock (another process) makes resume refuse, naming it."""
    from lm_pretrain_support import REPO

    from engine.rundir import RunDir

    _, _, _, path = existing
    run = RunDir(path)
    saved_status = (path / "status.json").read_bytes()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from engine.runlock import RunLock; "
         "RunLock(sys.argv[1]).acquire('job'); print('held', flush=True); time.sleep(60)",
         str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        run.set_status("running", pid=holder.pid)
        before = tree_digest(path)
        code, message = run_cli(capsys, "resume", str(path), "--steps", "4")
        assert code == 2 and f"another forgebench job is writing this run: pid {holder.pid}" \
            in message
        assert str(path) in message
        one_message(message)
        assert tree_digest(path) == before
        assert run.live_status()["state"] == "running"
        assert main(["status", str(path)]) == 0  # status reads while the lock is held
        held_by = json.loads(capsys.readouterr().out)["held_by"]
        assert held_by["pid"] == holder.pid and held_by["purpose"] == "job"
    finally:
        holder.kill()
        holder.wait()
    assert run.live_status()["state"] == "failed"  # the holder died: no writer, no lock
    (path / "status.json").write_bytes(saved_status)


def test_resume_refuses_other_config_changes(existing):
    from engine.jobs import prepare_resume

    _, _, _, run = existing
    with pytest.raises(ForgebenchError, match="resume may only change") as info:
        prepare_resume(run, {"seed": 7})
    assert info.value.where == "field seed"


def test_resume_after_code_change_is_refused(existing, monkeypatch):
    import engine.jobs as jobs
    from engine.rundir import RunDir

    _, _, _, run = existing
    files = RunDir(run).manifest()["code_files"]
    assert "recipes/lm_pretrain.py" in files and "models/llama.py" in files
    real = jobs.code_files
    monkeypatch.setattr(jobs, "code_files", lambda paths=None: dict(
        real(paths), **{"models/llama.py": "0" * 64}))
    with pytest.raises(ForgebenchError, match="engine/models/llama.py"):
        jobs.prepare_resume(run, {"steps": 4})


def test_real_process_exit_code(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("recipe = [\n")
    result = forgebench("run", str(bad), check=False)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {bad}: malformed TOML")
    assert "Traceback" not in result.stderr
