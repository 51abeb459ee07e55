"""Hostile input through the command line, table-driven: every case exits non-zero with exactly
one `error:` line naming the file, line, field or flag, no traceback, and nothing already saved
touched. Then the run-state cases: damaged checkpoints, torn logs, dead jobs, stray pids,
and untrusted chat templates."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from lm_pretrain_support import REPO, make_corpus, tree_digest, write_config

from engine.cli import main
from engine.rundir import RunDir

HUGE = "x" * 10_000_000  # a 10 MB field: an error may quote only a short excerpt of it


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    """A corpus, a config and a completed 4-step run (checkpoints at 2 and 4)."""
    root = tmp_path_factory.mktemp("bad")
    corpus = make_corpus(root)
    config = write_config(root / "tiny.toml", corpus, steps=4, save_every=2)
    assert main(["run", str(config), "--out", str(root / "run"), "--threads", "1"]) == 0
    (root / "a-file").write_text("not a folder\n")
    return {"root": root, "corpus": corpus, "config": config, "run": root / "run",
            "file": root / "a-file"}


def run_cli(capsys, argv: list[str]) -> tuple[int, str]:
    """Exit code and stderr of one in-process `forgebench` call (argparse exits included)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def assert_one_clean_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.count("error:") == 1, err
    assert "Traceback" not in err, err
    assert len(err) < 2000, f"the error echoes too much ({len(err)} characters)"
    error_line = err[err.index("error:"):]
    for needle in needles:
        assert needle in error_line, (needle, err)


# -- configs: each case edits one line of the tiny config ----------------------------------
def edited_config(ctx, tmp: Path, old: str, new: str) -> Path:
    text = ctx["config"].read_text()
    assert old in text
    path = tmp / "edited.toml"
    path.write_text(text.replace(old, new, 1))
    return path


CONFIG_CASES = {
    "lr inf": ("lr = 3e-3", "lr = inf", "field 'optim.lr'"),
    "lr nan": ("lr = 3e-3", "lr = nan", "field 'optim.lr'"),
    "lr 1e300": ("lr = 3e-3", "lr = 1e300", "field 'optim.lr'"),
    "lr negative": ("lr = 3e-3", "lr = -1.0", "field 'optim.lr'"),
    "seed too big": ("seed = 3", "seed = 1099511627776", "field 'seed'"),
    "seed negative": ("seed = 3", "seed = -1", "field 'seed'"),
    "10 MB field": ("dim = 32", f'dim = "{HUGE}"', "field 'model.dim'"),
    "steps zero": ("steps = 4", "steps = 0", "field 'steps'"),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_bad_config_values(ctx, tmp_path, capsys, case):
    old, new, field = CONFIG_CASES[case]
    config = edited_config(ctx, tmp_path, old, new)
    code, err = run_cli(capsys, ["run", config, "--out", tmp_path / "out"])
    assert_one_clean_error(code, err, str(config), field)
    assert not (tmp_path / "out").exists()


# -- flags -----------------------------------------------------------------------------------
def _flag_cases(ctx) -> dict[str, tuple[list, str]]:
    run, config, gen = ctx["run"], ctx["config"], ["generate", ctx["run"], "--prompt", "Record"]
    return {
        "run --threads -1": (["run", config, "--threads", "-1"], "--threads"),
        "run --threads 0": (["run", config, "--threads", "0"], "--threads"),
        "run --steps 0": (["run", config, "--steps", "0"], "--steps"),
        "resume --threads -1": (["resume", run, "--threads", "-1"], "--threads"),
        "resume --from-step x": (["resume", run, "--from-step", "x"], "--from-step"),
        "generate --max-tokens -5": (gen + ["--max-tokens", "-5"], "--max-tokens"),
        "generate --temperature nan": (gen + ["--temperature", "nan"], "--temperature"),
        "generate --temperature inf": (gen + ["--temperature", "inf"], "--temperature"),
        "generate --top-p 0": (gen + ["--top-p", "0"], "--top-p"),
        "generate --top-p 1.5": (gen + ["--top-p", "1.5"], "--top-p"),
        "generate --seed -1": (gen + ["--seed", "-1"], "--seed"),
        "generate --repetition-penalty 0": (gen + ["--repetition-penalty", "0"],
                                            "--repetition-penalty"),
        "sample --cfg nan": (["sample", run, "--cfg", "nan"], "--cfg"),
        "sample --n 0": (["sample", run, "--n", "0"], "--n"),
        "data generate --n 0": (["data", "generate", "records", "--out",
                                 ctx["root"] / "never", "--n", "0"], "--n"),
        "stop --wait nan": (["stop", run, "--wait", "nan"], "--wait"),
        "demo --seconds 0": (["demo", "--seconds", "0"], "--seconds"),
        "10 MB flag value": (gen + ["--max-tokens", HUGE], "--max-tokens"),
    }


FLAG_CASE_NAMES = list(_flag_cases({"run": "", "config": "", "root": Path()}))


@pytest.mark.parametrize("case", FLAG_CASE_NAMES)
def test_bad_flags(ctx, capsys, case):
    argv, flag = _flag_cases(ctx)[case]
    before = tree_digest(ctx["root"])
    code, err = run_cli(capsys, argv)
    assert_one_clean_error(code, err, flag)
    assert tree_digest(ctx["root"]) == before


# -- --out is checked before any work -------------------------------------------------------
def _out_cases(ctx) -> dict[str, list]:
    run, f = ctx["run"], ctx["file"]
    return {
        "run --out FILE": ["run", ctx["config"], "--out", f],
        "run --out under a FILE": ["run", ctx["config"], "--out", f / "sub"],
        "export --out FILE": ["export", run, "--dtype", "f32", "--out", f],
        "sample --out FILE": ["sample", run, "--out", f],
        "data split --out FILE": ["data", "split", ctx["corpus"], "--out", f],
        "data generate --out FILE": ["data", "generate", "records", "--out", f],
        "convert --out DIR": ["convert", f, "--dtype", "keep", "--out", ctx["root"]],
    }


@pytest.mark.parametrize("case", list(_out_cases({"run": "", "config": "", "corpus": "",
                                                  "file": Path(), "root": ""})))
def test_unusable_out(ctx, capsys, case):
    before = tree_digest(ctx["root"])
    code, err = run_cli(capsys, _out_cases(ctx)[case])
    assert_one_clean_error(code, err, "--out")
    assert tree_digest(ctx["root"]) == before


@contextlib.contextmanager
def read_only_folder(path: Path):
    """A folder nothing may be written into: a read-only tmpfs as root (root ignores mode
    bits), else mode 0555."""
    path.mkdir()
    if os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs",
                                  str(path)], capture_output=True).returncode == 0
        if not mounted:
            pytest.skip("running as root without mount rights: no read-only folder to test")
        try:
            yield path
        finally:
            subprocess.run(["umount", str(path)], check=True)
    else:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)


@pytest.mark.parametrize("command", ["run", "export", "data generate"])
def test_read_only_out(ctx, tmp_path, capsys, command):
    with read_only_folder(tmp_path / "ro") as ro:
        argv = {"run": ["run", ctx["config"], "--out", ro / "new-run"],
                "export": ["export", ctx["run"], "--dtype", "f32", "--out", ro / "export"],
                "data generate": ["data", "generate", "records", "--out", ro / "d"]}[command]
        code, err = run_cli(capsys, argv)
        assert_one_clean_error(code, err, "--out", "not writable")
        assert list(ro.iterdir()) == []


# -- paths from dataset manifests and configs -----------------------------------------------
def corpus_copy(ctx, tmp: Path) -> Path:
    corpus = tmp / "corpus"
    shutil.copytree(ctx["corpus"], corpus)
    return corpus


def set_split_file(corpus: Path, split: str, name: str) -> None:
    manifest = json.loads((corpus / "dataset.json").read_text())
    manifest["splits"][split]["file"] = name
    (corpus / "dataset.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name,reason", [
    ("../../../../../etc/passwd", "must stay inside the dataset folder"),
    ("/etc/passwd", "absolute paths are refused"),
    ("sub\\..\\..\\x", "relative path with '/' separators"),
    ("", "non-empty relative path"),
])
def test_corpus_split_outside_the_dataset(ctx, tmp_path, capsys, name, reason):
    corpus = corpus_copy(ctx, tmp_path)
    set_split_file(corpus, "train", name)
    config = write_config(tmp_path / "c.toml", corpus)
    code, err = run_cli(capsys, ["run", config, "--out", tmp_path / "out"])
    assert_one_clean_error(code, err, str(corpus / "dataset.json"), "splits.train.file", reason)
    assert not (tmp_path / "out").exists()


def test_corpus_split_symlinked_outside(ctx, tmp_path, capsys):
    corpus = corpus_copy(ctx, tmp_path)
    (corpus / "train.txt").unlink()
    (corpus / "train.txt").symlink_to("/etc/passwd")
    config = write_config(tmp_path / "c.toml", corpus)
    code, err = run_cli(capsys, ["run", config, "--out", tmp_path / "out"])
    assert_one_clean_error(code, err, "splits.train.file", "leads outside the dataset folder")
    assert not (tmp_path / "out").exists()


def test_data_dir_symlink_loop(ctx, tmp_path, capsys):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    config = write_config(tmp_path / "c.toml", loop)
    code, err = run_cli(capsys, ["run", config, "--out", tmp_path / "out"])
    assert_one_clean_error(code, err, "data.dir", "symlink loop")


@pytest.mark.parametrize("kind,reason", [("folder", "got a directory"),
                                         ("loop", "symlink loop"), ("missing", "not found")])
@pytest.mark.parametrize("command", ["generate --model", "tokenize --model", "convert FILE",
                                     "export --base"])
def test_bad_model_file_paths(ctx, tmp_path, capsys, kind, reason, command):
    target = {"folder": tmp_path, "loop": tmp_path / "loop", "missing": tmp_path / "no.gguf"}
    if kind == "loop":
        target["loop"].symlink_to(target["loop"])
    model = target[kind]
    argv = {"generate --model": ["generate", "--model", model, "--prompt", "hi"],
            "tokenize --model": ["tokenize", "--model", model, "hi"],
            "convert FILE": ["convert", model, "--dtype", "keep", "--out", tmp_path / "o.gguf"],
            "export --base": ["export", ctx["run"], "--base", model, "--out",
                              tmp_path / "exp"]}[command]
    code, err = run_cli(capsys, argv)
    if command == "convert FILE" and kind == "folder":
        # convert reads a folder as a Hugging Face checkpoint: this one has no config.json
        assert_one_clean_error(code, err, str(model), "config.json")
    else:
        assert_one_clean_error(code, err, str(model), command.split()[-1], reason)
    assert not (tmp_path / "o.gguf").exists() and not (tmp_path / "exp").exists()


# -- run state: lock, dead jobs, stop ----------------------------------------------------------
def copy_run(ctx, tmp: Path) -> RunDir:
    shutil.copytree(ctx["run"], tmp / "run", symlinks=True)
    return RunDir(tmp / "run")


def test_a_queued_run_whose_job_died_reads_failed_and_resumes(ctx, tmp_path, capsys):
    run = copy_run(ctx, tmp_path)
    run.set_status("queued", step=0, pid=None)  # as a job killed before training leaves it
    assert run.live_status()["state"] == "failed"
    assert main(["status", str(run.path)]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "failed"
    code, err = run_cli(capsys, ["resume", run.path, "--steps", "5"])
    assert code == 0, err
    assert run.status()["state"] == "completed" and run.status()["step"] == 5


def test_stop_never_signals_a_pid_from_status_alone(ctx, tmp_path, capsys):
    """status.json names a live unrelated process (a reused pid) and no job holds the lock."""
    run = copy_run(ctx, tmp_path)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run.set_status("running", pid=bystander.pid, step=2)
        code = main(["stop", str(run.path)])
        assert code == 1 and "not running (state: failed)" in capsys.readouterr().out
        assert bystander.poll() is None  # untouched
    finally:
        bystander.kill()
        bystander.wait()


def test_stop_refuses_a_lock_holder_whose_pid_was_reused(ctx, tmp_path, capsys):
    """The lock file names a pid whose process start time differs: nothing is signalled."""
    run = copy_run(ctx, tmp_path)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    time.sleep(0.1)  # start times count in clock ticks (10 ms): let the two differ
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import json, os, sys, time; from engine.runlock import RunLock\n"
         "lock = RunLock(sys.argv[1]).acquire('job')\n"
         "info = json.loads(open(lock.path).read()); info.update(pid=int(sys.argv[2]))\n"
         "os.pwrite(lock._fd, json.dumps(info).encode().ljust(4096), 0)\n"
         "print('held', flush=True); time.sleep(60)", str(run.path), str(bystander.pid)],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code, err = run_cli(capsys, ["stop", run.path])
        assert_one_clean_error(code, err, "cannot identify the job", "nothing was signalled")
        assert bystander.poll() is None and holder.poll() is None
    finally:
        for proc in (bystander, holder):
            proc.kill()
            proc.wait()


# -- checkpoints: verification and fallback ---------------------------------------------------
@pytest.mark.parametrize("damage", ["truncate optimizer", "delete optimizer",
                                    "empty trainer_state", "flip a model byte"])
def test_resume_falls_back_to_the_newest_intact_checkpoint(ctx, tmp_path, capsys, damage):
    run = copy_run(ctx, tmp_path)
    latest = run.path / "checkpoints" / "step-000004"
    target = {"truncate optimizer": "optimizer.safetensors",
              "delete optimizer": "optimizer.safetensors",
              "empty trainer_state": "trainer_state.json",
              "flip a model byte": "model.safetensors"}[damage]
    path = latest / target
    data = path.read_bytes()
    if damage == "truncate optimizer":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "delete optimizer":
        path.unlink()
    elif damage == "empty trainer_state":
        path.write_bytes(b"")
    else:
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    code, err = run_cli(capsys, ["resume", run.path, "--steps", "5"])
    assert code == 0, err
    assert "step-000004 is damaged" in err and "Traceback" not in err
    resumed = run.invocations()[-1]
    assert resumed["resumed_from"] == "step-000002" and resumed["start_step"] == 2
    warnings = [e for e in run.events() if e["kind"] == "warning" and "damaged" in e["message"]]
    assert warnings and warnings[-1]["checkpoint"] == "step-000004"
    assert run.status()["state"] == "completed" and run.status()["step"] == 5


def test_resume_from_step_and_refusals(ctx, tmp_path, capsys):
    run = copy_run(ctx, tmp_path)
    code, err = run_cli(capsys, ["resume", run.path, "--steps", "5", "--from-step", "3"])
    assert_one_clean_error(code, err, "--from-step", "no committed checkpoint at step 3",
                           "committed steps: 2, 4")
    (run.path / "checkpoints" / "step-000002" / "model.safetensors").write_bytes(b"\0" * 10)
    code, err = run_cli(capsys, ["resume", run.path, "--steps", "5", "--from-step", "2"])
    assert_one_clean_error(code, err, "step-000002 is damaged", "--from-step")
    code, err = run_cli(capsys, ["resume", run.path, "--steps", "5", "--from-step", "4"])
    assert code == 0, err
    assert run.invocations()[-1]["resumed_from"] == "step-000004"


def test_resume_refuses_when_no_intact_checkpoint_is_left(ctx, tmp_path, capsys):
    run = copy_run(ctx, tmp_path)
    shutil.rmtree(run.path / "checkpoints")
    before = tree_digest(run.path)
    code, err = run_cli(capsys, ["resume", run.path, "--steps", "8"])
    assert_one_clean_error(code, err, "cannot resume", "restarting from step 0")
    assert tree_digest(run.path) == before
    run2 = copy_run(ctx, tmp_path / "b")
    for ckpt in run2.checkpoints():
        (ckpt.path / "optimizer.safetensors").write_bytes(b"")
    code, err = run_cli(capsys, ["resume", run2.path, "--steps", "8"])
    assert_one_clean_error(code, err, "every checkpoint is damaged")


def test_orphaned_checkpoint_folders_are_swept_at_the_next_start(ctx, tmp_path, capsys):
    run = copy_run(ctx, tmp_path)
    orphan = run.path / "checkpoints" / "step-000003"  # a kill during keep-last cleanup
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"half")
    (run.path / "checkpoints" / ".tmp-step-000005-999999").mkdir()
    assert main(["resume", str(run.path), "--steps", "5"]) == 0
    names = sorted(p.name for p in (run.path / "checkpoints").iterdir())
    assert names == ["step-000004", "step-000005"]
    swept = [e for e in run.events() if e["kind"] == "checkpoints_swept"]
    assert swept and sorted(swept[-1]["folders"]) == [".tmp-step-000005-999999", "step-000003"]


def test_export_scratch_of_a_dead_export_is_swept(ctx, tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "export"
    for kind in ("partial", "scratch"):
        (tmp_path / f".export.{kind}-{dead.pid}").mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    alive = tmp_path / f".export.partial-{other.pid}"  # an export still running elsewhere
    alive.mkdir()
    try:
        code, err = run_cli(capsys, ["export", ctx["run"], "--dtype", "f32", "--no-report",
                                     "--out", out])
    finally:
        other.kill()
        other.wait()
    assert code == 0, err
    assert f".export.partial-{dead.pid}" in err
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert leftovers == [alive.name]  # a live process's staging folder is never touched


# -- logs: torn and damaged lines -------------------------------------------------------------
def test_a_torn_metrics_line_is_skipped_by_readers_and_repaired_by_the_writer(ctx, tmp_path,
                                                                             capsys):
    run = copy_run(ctx, tmp_path)
    metrics = run.path / "metrics.jsonl"
    lines_before = len(run.metrics())
    with open(metrics, "a") as handle:
        handle.write('{"step": 5, "split": "train", "lo')  # a killed append
    assert main(["status", str(run.path)]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "completed"
    assert len(run.metrics()) == lines_before
    code, err = run_cli(capsys, ["resume", run.path, "--steps", "5"])
    assert code == 0, err
    assert metrics.read_text().count("\n") == len(run.metrics())  # every line parses
    repaired = [e for e in run.events() if e["kind"] == "log_repaired"]
    assert repaired and repaired[0]["file"] == "metrics.jsonl" and repaired[0]["bytes_removed"]


def test_a_damaged_middle_line_warns_instead_of_failing(ctx, tmp_path, capsys):
    run = copy_run(ctx, tmp_path)
    metrics = run.path / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:2]) + '{"step": 3, "lo{"step": 9}\n' + "".join(lines[2:]))
    assert main(["status", str(run.path)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["state"] == "completed"
    assert f"{metrics}: line 3: damaged log line skipped" in captured.err
    assert len(run.metrics()) == len(lines)


# -- untrusted chat templates ----------------------------------------------------------------
# a million steps take about 0.2 s on an idle core; on a loaded machine the 1 s deadline may
# stop the same loop first: either is the budget refusing it
STEPS_OR_TIME = "more than 1000000 steps|ran longer than 1 s"
HOSTILE_TEMPLATES = {
    "nested range": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                     "{% endfor %}", "range items"),
    "range(10**9)": ("{{ range(10**9) | length }}", "range items"),
    "string multiplication": ("{{ 'a' * 10**9 }}", "builds a value of 1000000000 items"),
    "repeated doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                          "{% set ns.s = ns.s * 2 %}{% endfor %}{{ ns.s }}", "builds a value"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    "format width": ("{{ '%999999999d' % 1 }}", "width of a million"),
    "str.format width": ("{{ '{:>999999999}'.format(1) }}", "width of a million"),
    "center": ("{{ 'x' | center(999999999) }}", "builds a value"),
    "output size": ("{% set s = 'x' * 1000000 %}{% for i in range(100) %}{{ s }}{% endfor %}",
                    "output passed"),
    "str.ljust": ("{{ 'x'.ljust(999999999) }}", "builds a value"),
    "str.replace": ("{% set s = 'a' * 1000000 %}{{ s.replace('a', s) }}", "builds a value"),
    "replace filter": ("{% set s = 'a' * 1000000 %}{{ s | replace('a', s) }}",
                       "builds a value"),
    "indent filter": ("{{ 'a\nb' | indent(999999999) }}", "builds a value"),
    "expandtabs": ("{{ ('\t' * 1000).expandtabs(999999) }}", "builds a value"),
    "nested loops over a string": ("{% set s = 'x' * 100000 %}{% for c in s %}{% for d in s %}"
                                   "{% endfor %}{% endfor %}", STEPS_OR_TIME),
    "recursive loop": ("{% set s = 'x' * 1000 %}{% for a in s recursive %}"
                       "{% if loop.depth < 4 %}{{ loop(s) }}{% endif %}{% endfor %}",
                       STEPS_OR_TIME),
    "slow steps": ("{% set s = 'x' * 3000000 %}{% for i in range(100000) %}{{ s.count('y') }}"
                   "{% endfor %}", "ran longer than 1 s"),
}


@pytest.mark.parametrize("case", HOSTILE_TEMPLATES)
def test_hostile_chat_template_is_refused_with_file_and_reason(case, monkeypatch):
    from engine.errors import ForgebenchError
    from engine.llm.chat import ChatTemplate, RenderBudget

    monkeypatch.setattr(RenderBudget, "SECONDS", 1.0)
    source, reason = HOSTILE_TEMPLATES[case]
    template = ChatTemplate(source, origin="tokenizer.chat_template", path="model.gguf")
    with pytest.raises(ForgebenchError) as info:
        template([{"role": "user", "content": "hi"}])
    message = info.value.render()
    assert re.match(r"model\.gguf: tokenizer\.chat_template( line \d+)?: ", message), message
    assert "render budget" in message and re.search(reason, message), message


@pytest.mark.parametrize("case", ["nested loops over a string", "recursive loop", "slow steps"])
def test_hostile_template_is_refused_off_the_main_thread(case, monkeypatch):
    """serve-local and the HTTP server render on worker threads, where no signal can interrupt
    a render: the budget's own steps and deadline stop it there too."""
    from engine.errors import ForgebenchError
    from engine.llm.chat import ChatTemplate, RenderBudget

    monkeypatch.setattr(RenderBudget, "SECONDS", 1.0)
    source, reason = HOSTILE_TEMPLATES[case]
    template = ChatTemplate(source, origin="tokenizer.chat_template", path="model.gguf")
    outcome: list = []

    def render() -> None:
        try:
            template([{"role": "user", "content": "hi"}])
            outcome.append("rendered")
        except ForgebenchError as exc:
            outcome.append(exc.render())

    worker = threading.Thread(target=render, daemon=True)
    worker.start()
    worker.join(timeout=120)          # a hang guard, not a speed check
    assert not worker.is_alive(), "the render hung on a worker thread"
    assert "render budget" in outcome[0] and re.search(reason, outcome[0]), outcome[0]


def test_one_template_renders_on_several_threads_with_a_budget_each(monkeypatch):
    """A compiled template shared by concurrent requests: each render counts its own steps
    (six renders of a quarter budget each would exhaust one shared budget)."""
    from engine.llm.chat import ChatTemplate, RenderBudget

    monkeypatch.setattr(RenderBudget, "SECONDS", 600.0)   # steps are under test, not time
    template = ChatTemplate("{% for c in messages[0]['content'] %}{{ c }}{% endfor %}")
    text = "y" * (RenderBudget.STEPS // 4)        # one render uses a quarter of the budget
    results: list = []
    workers = [threading.Thread(target=lambda: results.append(
        template([{"role": "user", "content": text}]))) for _ in range(6)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert results == [text] * 6


def test_a_failing_template_names_its_line():
    from engine.errors import ForgebenchError
    from engine.llm.chat import ChatTemplate

    template = ChatTemplate("{{ bos_token }}\n{{ messages[0]['content'] + 1 }}",
                            origin="tokenizer.chat_template", path="m.gguf")
    with pytest.raises(ForgebenchError) as info:
        template([{"role": "user", "content": "hi"}])
    assert info.value.where == "tokenizer.chat_template line 2"
    with pytest.raises(ForgebenchError) as info:
        ChatTemplate("ok\n{% for %}", origin="tokenizer.chat_template")
    assert info.value.where == "tokenizer.chat_template line 2"


def test_lipsum_is_not_available_to_templates():
    from engine.errors import ForgebenchError
    from engine.llm.chat import ChatTemplate

    with pytest.raises(ForgebenchError, match="'lipsum' is undefined"):
        ChatTemplate("{{ lipsum(n=100000000) }}", path="m.gguf")([])


def test_generate_chat_with_a_hostile_template_exits_cleanly(tmp_path, capsys):
    from fixtures_gguf import write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "m.gguf", "llama", "Q8_0", metadata={
        "tokenizer.chat_template": HOSTILE_TEMPLATES["nested range"][0]})
    code, err = run_cli(capsys, ["generate", "--model", model, "--prompt", "hi", "--chat",
                                 "--max-tokens", "1", "--numerics", "f32"])
    assert_one_clean_error(code, err, str(model), "tokenizer.chat_template", "range items")


def test_budget_leaves_real_templates_alone():
    from engine.llm.chat import BUILTIN_TEMPLATES, ChatTemplate

    messages = [{"role": "user", "content": "hi " * 1000}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "again"}]
    for name, source in BUILTIN_TEMPLATES.items():
        text = ChatTemplate(source, bos_token="<s>")(messages)
        assert "again" in text and len(text) > 3000, name


def test_disk_space_message_gives_real_sizes(tmp_path, monkeypatch):
    from engine.errors import ForgebenchError
    from engine.fsutil import require_free_space

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda _: usage._replace(free=20_000))  # 20 KB left
    with pytest.raises(ForgebenchError) as info:
        require_free_space(tmp_path, 50_000, margin=1.0, hint="write to another --out")
    message = info.value.render()
    assert "needs about 50.0 KB, 20.0 KB are free" in message
    assert "hint: write to another --out" in message


def test_an_append_after_a_torn_tail_starts_a_new_line(tmp_path, capsys):
    """A writer that does not repair (e.g. `eval` on a killed run) never merges with the tail."""
    from engine.jsonl import append_line, read_log, repair_torn_tail

    log = tmp_path / "events.jsonl"
    append_line(log, {"n": 1})
    with open(log, "ab") as handle:
        handle.write(b'{"n": 2, "to')
    append_line(log, {"n": 3})
    assert read_log(log) == [{"n": 1}, {"n": 3}]
    assert "line 2: damaged log line skipped" in capsys.readouterr().err
    with open(log, "ab") as handle:
        handle.write(b'{"n": 4')
    assert repair_torn_tail(log) == len(b'{"n": 4')
    assert log.read_bytes().endswith(b'{"n": 3}\n')


def test_the_app_facing_stop_answers_false_when_unsure(ctx, tmp_path):
    """RunDir.request_stop (used by the app) never raises and never signals a stranger."""
    run = copy_run(ctx, tmp_path)
    assert run.request_stop() is False  # nobody holds the run
    (run.path / "job.lock").write_text('{"pid": 1, "host": "elsewhere"}')  # a stale file
    assert run.request_stop() is False and run.lock_holder() is None
