"""Runs: the run list and ledger, and the chart series of each run, read from run directories
while their jobs write them (docs/design.md). Reads are incremental so a poll costs only the new
bytes."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.viewmodels.events import Listeners
from app.viewmodels.jobs import Pace, duration_text, run_stage_line
from app.viewmodels.reference_trace import (
    LossOverlay,
    ReferenceTrace,
    loss_overlay,
    read_reference_trace,
    reference_trace_path,
)
from engine.errors import ForgebenchError
from engine.export.verdict import latest_run_export
from engine.fsutil import atomic_write_json, read_json
from engine.rundir import RunDir
from engine.runlock import pid_alive

NOTES_FILE = "notes.json"  # app-owned: question, notes, selected checkpoint (run.json is immutable)
TRAIN_FIELDS = ("loss", "grad_norm", "lr", "tokens_per_s", "examples_per_s", "mfu", "peak_rss_mb",
                "rank_tokens_per_s",
                "world_size",
                "reward_margin", "preference_accuracy", "chosen_logp", "rejected_logp")  # lm-dpo
# what lm-es adds to its rows: the centre's reward, the population's spread, the step size
ES_FIELDS = ("reward", "reward_mean", "reward_max", "reward_min", "update_norm", "sigma")
# what evaluation rows chart besides their loss: a classifier's accuracy, and its calibration
# error after and before calibration (lm-decision, tabular-classify); embed-retrieval's MRR@5
EVAL_FIELDS = ("loss", "accuracy", "ece", "ece_before", "mrr@5")


class JsonlTail:
    """Reads the complete lines appended to a JSONL file since the last call.

    A last line without its newline is an append in progress: it is left for the next call.
    A line that is not JSON is counted in `bad_lines` and skipped, never raised to the GUI.
    """

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.bad_lines = 0

    def read_new(self) -> list[dict]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:  # the file was replaced: read it again from the start
            self.offset = 0
        if size == self.offset:
            return []
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            chunk = handle.read(size - self.offset)
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        records = []
        for line in chunk[:end].split(b"\n"):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                self.bad_lines += 1
                continue
            if isinstance(record, dict):
                records.append(record)
        return records


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's debiased exponential moving average; weight 0 returns the values.

    Non-finite points are passed through and do not disturb the average.
    """
    if weight <= 0:
        return list(values)
    out, last, n = [], 0.0, 0
    for v in values:
        if v is None or not math.isfinite(v):
            out.append(v)
            continue
        n += 1
        last = last * weight + (1 - weight) * v
        out.append(last / (1 - weight ** n))
    return out


def find_clip_threshold(config: dict) -> float | None:
    """The gradient-clipping threshold in a resolved config, wherever its section puts it."""
    for key, value in config.items():
        if isinstance(value, dict):
            found = find_clip_threshold(value)
            if found is not None:
                return found
        elif key in ("max_grad_norm", "grad_clip", "clip_grad_norm", "clip") and \
                isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


@dataclass
class Series:
    steps: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, record: dict, names: tuple[str, ...]) -> None:
        self.steps.append(int(record.get("step", len(self.steps))))
        self.times.append(float(record.get("time", 0.0)))
        for name in names:
            value = record.get(name)
            if isinstance(value, bool):
                value = float(value)
            self.values.setdefault(name, []).append(
                float(value) if isinstance(value, (int, float)) else math.nan)


class RunSeries:
    """The chart data of one run: train and eval metrics, checkpoints and invocations."""

    def __init__(self, path: str | os.PathLike):
        self.run = RunDir(path)
        self.train = Series()
        self.evals: dict[str, Series] = {}
        self.checkpoint_steps: list[int] = []
        self.invocation_steps: list[int] = []
        self.errors: list[dict] = []
        self._metrics = JsonlTail(self.run.path / "metrics.jsonl")
        self._events = JsonlTail(self.run.path / "events.jsonl")
        self._invocations = JsonlTail(self.run.path / "invocations.jsonl")
        self._t0: float | None = None
        self.clip_threshold: float | None = None
        # the reference loss trace its config names ([compare] reference_trace), or why not
        self.reference: ReferenceTrace | None = None
        self.reference_error = ""
        self.threads: int | None = None
        try:
            manifest = self.run.manifest()
        except ForgebenchError:
            return
        config = manifest.get("config", {})
        self.clip_threshold = find_clip_threshold(config)
        threads = manifest.get("environment", {}).get("threads")
        self.threads = threads if isinstance(threads, int) else None
        trace_path = reference_trace_path(config)
        if trace_path is not None:
            try:
                self.reference = read_reference_trace(trace_path)
            except ForgebenchError as exc:
                self.reference_error = f"{exc.message}: {trace_path}"

    @property
    def name(self) -> str:
        return self.run.path.name

    @property
    def throughput(self) -> tuple[str, str]:
        """(metric, unit) of this run's speed: tokens/s for a language model, else the
        examples (images, sounds) per second the shared loop logs."""
        examples = self.train.values.get("examples_per_s", [])
        if any(math.isfinite(v) for v in examples) and not any(
                math.isfinite(v) for v in self.train.values.get("tokens_per_s", [])):
            return "examples_per_s", "samples/s"
        return "tokens_per_s", "tokens/s"

    def poll(self) -> bool:
        """Read what the job appended since the last poll; True when anything changed."""
        changed = False
        for record in self._metrics.read_new():
            changed = True
            if self._t0 is None:
                self._t0 = float(record.get("time", 0.0))
            split = record.get("split", "train")
            if split == "train":
                self.train.add(record, TRAIN_FIELDS + ES_FIELDS + ("clipped",))
            else:
                self.evals.setdefault(split, Series()).add(record, EVAL_FIELDS)
        for event in self._events.read_new():
            changed = True
            if event.get("kind") == "checkpoint_saved" and "step" in event:
                self.checkpoint_steps.append(int(event["step"]))
            elif event.get("kind") == "error":
                self.errors.append(event)
        for record in self._invocations.read_new():
            changed = True
            start = record.get("start_step", record.get("step_range", [None])[0]
                               if isinstance(record.get("step_range"), list) else None)
            self.invocation_steps.append(int(start or 0))
        return changed

    def xy(self, metric: str, split: str = "train", x: str = "step",
           smoothing: float = 0.0) -> tuple[list[float], list[float]]:
        """Points of one metric: x is the step or seconds since the run's first metric."""
        series = self.train if split == "train" else self.evals.get(split)
        if series is None or metric not in series.values:
            return [], []
        xs = series.steps if x == "step" else [t - (self._t0 or 0.0) for t in series.times]
        return list(xs), ema(series.values[metric], smoothing)

    def loss_overlay(self) -> LossOverlay | None:
        """The reference trace beside this run's raw train loss, when its config names one."""
        if self.reference is None:
            return None
        return loss_overlay(self.reference, self.train.steps,
                            self.train.values.get("loss", []), self.threads)

    def clipped_points(self, x: str = "step") -> tuple[list[float], list[float]]:
        """Grad-norm points of the steps where clipping (or a skip) happened."""
        xs, ys = self.xy("grad_norm", x=x)
        flags = self.train.values.get("clipped", [])
        return ([a for a, f in zip(xs, flags) if f == 1.0],
                [b for b, f in zip(ys, flags) if f == 1.0])

    def x_of_step(self, step: int, x: str = "step") -> float | None:
        """Where a step (a checkpoint or an invocation start) sits on a time axis."""
        if x == "step":
            return float(step)
        for s, t in zip(self.train.steps, self.train.times):
            if s >= step:
                return t - (self._t0 or 0.0)
        return None


def stable_order(shown: list, wanted: list) -> list:
    """The order a list refreshed under the user's pointer takes: the entries shown that are
    still wanted keep their places, new ones come after them (in `wanted`'s order). Nothing
    the user is about to click moves up or down because another entry appeared above it."""
    kept = set(wanted)
    present = [key for key in shown if key in kept]
    seen = set(present)
    return present + [key for key in wanted if key not in seen]


def throughput_text(series: Series, metric: str = "tokens_per_s", unit: str = "tokens/s",
                    last: int = 20) -> str:
    """The throughput line beside the charts: the mean of `metric` (RunSeries.throughput: tokens
    or samples per second) and model FLOPs utilisation (the metrics rows' `mfu`: FLOPs per
    second over this machine's measured matmul peak) of the last `last` logged steps."""
    def recent(name: str) -> list[float]:
        return [v for v in series.values.get(name, [])[-last:] if v == v]

    rates, mfu = recent(metric), recent("mfu")
    mean = sum(rates) / max(len(rates), 1)
    text = f"throughput {mean:.0f} {unit}" if mean >= 10 else f"throughput {mean:.3g} {unit}"
    if mfu:
        text += f", MFU {sum(mfu) / len(mfu):.0%}"
    return text + f" (last {last})"


def read_notes(run_dir: Path) -> dict:
    try:
        notes = read_json(run_dir / NOTES_FILE)
    except ForgebenchError:
        return {}
    return notes if isinstance(notes, dict) else {}


def write_notes(run_dir: Path, **fields) -> dict:
    notes = read_notes(run_dir)
    notes.update(fields)
    atomic_write_json(run_dir / NOTES_FILE, notes)
    return notes


def chosen_checkpoint(path: Path) -> str | None:
    """The checkpoint a run is best shown by: the one chosen in its notes, else the one the
    run marked best (the ledger's Checkpoint column and the Samples pane's first)."""
    notes = read_notes(path)
    chosen = notes.get("selected_checkpoint") or RunDir(path).live_status().get("best_checkpoint")
    return str(chosen) if chosen else None


def _data_version(manifest: dict) -> str:
    """A short, honest data identity: dataset folder names and the first hash characters."""
    data = manifest.get("data") or {}
    files = data.get("files") if isinstance(data, dict) else None
    names = []
    if isinstance(data, dict):
        for key in ("dataset", "datasets", "name", "root"):
            if isinstance(data.get(key), str):
                names.append(Path(data[key]).name)
                break
    digest = ""
    if isinstance(files, dict) and files:
        joined = "".join(f"{k}:{v}" for k, v in sorted(files.items()))
        digest = hashlib.sha256(joined.encode()).hexdigest()[:10]
    return " ".join(names + ([f"#{digest}"] if digest else [])) or "—"


def device_text(manifest: dict) -> str:
    """What a run trains on, from run.json: "cpu", a GPU's name, with "× N" processes."""
    environment = manifest.get("environment") or {}
    device = environment.get("device", "cpu")
    name = device if isinstance(device, str) else (device.get("name") or device.get("type"))
    processes = environment.get("world_size") or 1
    return f"{name} × {processes}" if processes > 1 else str(name or "—")


@dataclass
class LedgerRow:
    name: str
    path: Path
    recipe: str
    state: str
    step: int | None
    target_steps: int | None
    question: str
    data_version: str
    best_metric: str
    selected_checkpoint: str
    notes: str
    error: str | None
    stage: str | None
    created: float | None
    updated: float | None = None     # status.json's last write: the end of a finished run
    stage_line: str = ""             # "loading base 250 MB", "step 3/30, ETA 4 min", the state
    device: str = ""                 # "cpu", "NVIDIA L4 × 2": the device and process count
    holder: dict | None = None       # who holds the run's lock (engine.runlock), when anyone
    example: dict | None = None      # a shipped example run's example.json (RunDir.example)
    export: str = ""                 # the latest export's verdict (engine.export.verdict)
    export_colour: str = ""

    @property
    def active(self) -> bool:
        return self.state in ("queued", "running", "stopping")

    def elsewhere(self, own_pids: set[int]) -> bool:
        """A job this window did not start holds the run (another window, a terminal, an
        eval or sample job, another host): the app may follow it, not drive it."""
        if self.holder is None:
            return False
        return self.holder.get("pid") not in own_pids or \
            self.holder.get("host", socket.gethostname()) != socket.gethostname()

    def holder_text(self) -> str:
        """Who holds the run, for a tooltip: what, which process, where, since when."""
        h = self.holder or {}
        since = h.get("since")
        when = time.strftime(" since %H:%M", time.localtime(since)) \
            if isinstance(since, (int, float)) else ""
        return (f"held by a {h.get('purpose', 'job')} job (pid {h.get('pid', '?')} on "
                f"{h.get('host', 'this machine')}){when}: {h.get('command', '')}").strip(": ")

    def started_text(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(self.created)) \
            if self.created else "—"

    def duration_text(self, now: float | None = None) -> str:
        """Wall time from creation to the last status (to now while it runs)."""
        if not self.created:
            return "—"
        end = (time.time() if now is None else now) if self.active else self.updated
        return duration_text(end - self.created) if end else "—"


class BestEval:
    """The lowest finite val loss of a run and its step, followed incrementally."""

    def __init__(self, path: Path):
        self._tail = JsonlTail(Path(path) / "metrics.jsonl")
        self.best: tuple[float, int | None] | None = None

    def update(self) -> tuple[float, int | None] | None:
        for record in self._tail.read_new():
            loss = record.get("loss")
            if record.get("split") == "val" and isinstance(loss, (int, float)) and \
                    math.isfinite(loss) and (self.best is None or loss < self.best[0]):
                self.best = (float(loss), record.get("step"))
        return self.best


class StepPace:
    """A run's `Pace`, followed incrementally in metrics.jsonl (the charts' source): the last
    train step of the latest invocation, and its steady step time from the wall times of that
    invocation's first and last logged steps (a resume is measured afresh)."""

    def __init__(self, path: Path):
        self._tail = JsonlTail(Path(path) / "metrics.jsonl")
        self._invocation: object = None
        self._first: tuple[int, float] | None = None
        self._last: tuple[int, float] | None = None

    def update(self) -> Pace:
        for record in self._tail.read_new():
            step, at = record.get("step"), record.get("time")
            if record.get("split", "train") != "train" or not isinstance(step, int) or \
                    not isinstance(at, (int, float)):
                continue
            invocation = record.get("invocation")
            if self._last is None or invocation != self._invocation or step <= self._last[0]:
                self._invocation, self._first = invocation, (step, float(at))
            self._last = (step, float(at))
        if self._last is None:
            return Pace()
        (first, t0), (last, t1) = self._first, self._last
        return Pace(last, (t1 - t0) / (last - first) if last > first else None)


def _best_metric(status: dict, best: tuple[float, int | None] | None) -> str:
    if isinstance(status.get("best_metric"), (int, float)):
        name = status.get("best_metric_name", "val loss")
        return f"{name} {status['best_metric']:.4g}"
    return f"val loss {best[0]:.4g} @ {best[1]}" if best else "—"


def ledger_row(path: Path, best: BestEval | None = None,
               pace: StepPace | None = None) -> LedgerRow:
    """One ledger line for a run directory; a damaged run still gets a (failed) line. While
    it trains, its step and ETA are those of its metrics (`StepPace`), as the charts show.

    Pass the run's `BestEval` and `StepPace` when polling so only new metric lines are read.
    """
    run = RunDir(path)
    try:
        manifest = run.manifest()
    except ForgebenchError as exc:
        manifest = {"error": exc.render()}
    status = run.live_status()
    notes = read_notes(path)
    error = status.get("error") or manifest.get("error")
    stage = status.get("stage")
    if status.get("state") == "failed" and not error:
        errors = [e for e in run.events() if e.get("kind") == "error"]
        if errors:
            error, stage = errors[-1].get("message"), errors[-1].get("stage", stage)
    selected = chosen_checkpoint(path)
    if not selected:
        latest = run.latest_checkpoint()
        selected = f"{latest.name} (latest)" if latest else "—"
    active = status.get("state") in ("running", "stopping")
    measured = (pace or StepPace(path)).update() if active else None
    step = status.get("step")
    if measured is not None and measured.step is not None:
        step = measured.step
    exported = latest_run_export(path)
    return LedgerRow(
        name=path.name, path=path, recipe=str(manifest.get("recipe", "?")),
        state=str(status.get("state", "unknown")), step=step,
        target_steps=status.get("target_steps") or (manifest.get("config") or {}).get("steps"),
        question=str(notes.get("question", "")), data_version=_data_version(manifest),
        best_metric=_best_metric(status, (best or BestEval(path)).update()),
        selected_checkpoint=str(selected),
        notes=str(notes.get("notes", "")), error=error, stage=stage,
        created=manifest.get("created") if isinstance(manifest.get("created"), (int, float))
        else None,
        updated=status.get("updated") if isinstance(status.get("updated"), (int, float))
        else None,
        stage_line=run_stage_line(status, measured),
        device=device_text(manifest), holder=run.lock_holder(), example=run.example,
        export=exported.line if exported else "",
        export_colour=exported.colour if exported else "")


# the files whose change means a run's ledger line must be read again
_LEDGER_FILES = ("status.json", "metrics.jsonl", "events.jsonl", "notes.json")


def _stamp(path: Path) -> tuple:
    out = []
    for name in _LEDGER_FILES:
        try:
            st = (path / name).stat()
            out.append((st.st_mtime_ns, st.st_size))
        except FileNotFoundError:
            out.append(None)
    return tuple(out)


class Ledger:
    """The Runs pane's ledger: one `LedgerRow` per run, newest first, plus the launches that
    have no run folder yet (`extra`: (name, state)). `refresh` re-reads only the runs whose
    files changed (a poll costs a few stat calls) and the runs still training, and announces
    what changed, so the view neither diffs rows nor re-checks states itself:

    - `resetting()` then `reset()`: the list of runs (or of launches) changed;
    - `row_changed(index)`: one run's line changed in place;
    - `settled(row)`: a run was read afresh and no job trains it (completed, stopped, failed):
      a run seen training has ended, or a launch's folder appeared already ended.
    """

    def __init__(self) -> None:
        self.rows: list[LedgerRow] = []
        self.extra: list[tuple[str, str]] = []
        self.own_pids: set[int] = set()     # the jobs this window started (runs, resumes)
        self._stamps: dict[Path, tuple] = {}
        self._best: dict[Path, BestEval] = {}
        self._pace: dict[Path, StepPace] = {}
        self.resetting, self.reset = Listeners(), Listeners()
        self.row_changed, self.settled = Listeners(), Listeners()

    def paths(self) -> list[Path]:
        return [r.path for r in self.rows]

    def row(self, path: Path) -> LedgerRow | None:
        """The ledger line of one run (the sample workspace's example runs share the list)."""
        return next((r for r in self.rows if r.path == path), None)

    def active_paths(self) -> list[Path]:
        return [r.path for r in self.rows if r.active]

    def forget(self, path: Path) -> None:
        """Read this run afresh at the next refresh (its notes were just written)."""
        self._stamps.pop(path, None)

    def refresh(self, paths: list[Path], extra: list[tuple[str, str]],
                hold_order: bool = False) -> None:
        """Newest first; `hold_order` (the pointer is over the ledger) keeps the rows shown in
        their places and puts new ones after them, until the pointer leaves."""
        old = {r.path: r for r in self.rows}
        rows, fresh = [], []
        for path in paths:
            stamp = _stamp(path)
            row = old.get(path)
            if row is None or self._stamps.get(path) != stamp or row.active:
                row = ledger_row(path, self._best.setdefault(path, BestEval(path)),
                                 self._pace.setdefault(path, StepPace(path)))
                self._stamps[path] = stamp
                fresh.append(row)
            rows.append(row)
        rows.sort(key=lambda r: r.created or 0, reverse=True)
        if hold_order:
            where = {r.path: r for r in rows}
            rows = [where[p] for p in stable_order(self.paths(), [r.path for r in rows])]
        if [r.path for r in rows] != self.paths() or extra != self.extra:
            self.resetting.emit()
            self.rows, self.extra = rows, list(extra)
            self.reset.emit()
        else:
            for i, (a, b) in enumerate(zip(self.rows, rows)):
                if a != b:
                    self.rows[i] = b
                    self.row_changed.emit(i)
        for row in fresh:
            if not row.active:
                self.settled.emit(row)


def launch_state(out: Path, pid: int) -> str:
    """Where a run this window launched stands before the ledger shows it: "listed" (its run
    folder exists), "starting" (its process lives) or "gone" (it exited without one)."""
    if RunDir(out).exists():
        return "listed"
    return "starting" if pid_alive(pid) else "gone"


def request_stop(path: Path) -> bool:
    """Ask a run's job to checkpoint and stop; False when no job is running it."""
    return RunDir(path).request_stop()


def is_running(path: Path) -> bool:
    """A job holds the run (it trains, resumes, samples or evaluates)."""
    return RunDir(path).is_active()

def delete_run(path: Path) -> None:
    """Delete a run's folder: the user's own or a shipped example. Refuses a run a job holds
    (training, resuming, sampling): stop it first."""
    run = RunDir(path)
    holder = run.lock_holder()
    if holder is not None or run.is_active():
        raise ForgebenchError("a job is using this run", path=path,
                              hint="stop it (or wait for its job to end), then delete it")
    shutil.rmtree(path)


def run_label(path: Path, recipe: str | None) -> str:
    """A run as run pickers name it: its folder and recipe, and "example" for a shipped
    example run, so nobody takes it for their own."""
    kind = f"{recipe}, example" if RunDir(path).example is not None else recipe
    return f"{path.name} ({kind})"


def example_text(example: dict) -> str:
    """What the ledger's tooltip says about a shipped example run."""
    made = f" Made from {example['config']} by 'make examples'." if example.get("config") else ""
    return (f"An example run shipped with the sample workspace: {example.get('shows', '')}."
            f"{made} Delete it whenever you like.").replace(": .", ".")


def failure_report(path: Path) -> str:
    """The error and traceback of a failed run, as the job recorded them."""
    run = RunDir(path)
    status = run.live_status()
    parts = []
    for event in run.events():
        if event.get("kind") == "error":
            stage = event.get("stage")
            parts.append(f"failed{' during ' + stage if stage else ''}: "
                         f"{event.get('message', '')}\n\n{event.get('traceback', '')}".rstrip())
    if not parts and status.get("state") == "failed":
        parts.append(str(status.get("error", "the job failed without recording an error")))
    return "\n\n".join(parts)


# A stop by signal (engine/jobs.py records the signal's name) in the user's words.
STOP_SIGNALS = {"SIGTERM": "asked to stop (Stop, or the process was terminated)",
                "SIGINT": "interrupted (Ctrl+C)"}


def run_notices(path: Path) -> str:
    """What the run warned about and why it stopped early, as the job recorded them: each
    `warning` event (lm-dpo's too-few-pairs guardrail, a damaged checkpoint skipped by
    resume), each `dpo_collapse` event (the guard's rule and what it did), and a stopped
    run's `stop_reason` from its status. Empty when there is nothing to say."""
    run = RunDir(path)
    lines: list[str] = []
    for event in run.events():
        kind = event.get("kind")
        if kind == "warning":
            line = f"warning: {event.get('message', '')}"
        elif kind == "dpo_collapse":
            did = "run stopped" if event.get("action") == "stop" else "warned only"
            line = (f"DPO collapse at step {event.get('step')}: {event.get('message', '')} "
                    f"({did})")
        else:
            continue
        if line not in lines:       # a resumed run logs its guardrail warning again
            lines.append(line)
    status = run.live_status()
    reason = status.get("stop_reason")
    if status.get("state") == "stopped" and reason:
        lines.append(f"stopped at step {status.get('step')}: {STOP_SIGNALS.get(reason, reason)}")
    return "\n".join(lines)


@dataclass
class ExtensionPlan:
    """What resuming a run to a larger step target does to its learning rate, when that is not
    the schedule it trained on continued: the curve it saw, the curve it would follow, and
    what changes, in words (shown before the resume starts)."""

    run: str
    done: int                       # the step it resumes from
    old_total: int
    new_total: int
    seen: tuple[list[int], list[float]]         # the logged lr (the schedule where none is)
    planned: tuple[list[int], list[float]]      # the lr from `done` to the new target
    text: str


def extension_plan(run_dir: Path, new_total: int) -> ExtensionPlan | None:
    """None when resuming `run_dir` to `new_total` steps follows the schedule it trained on (a
    constant rate, or no larger target); else the new schedule, from the same function the
    engine steps with (engine.train.schedule)."""
    from engine.train.schedule import section_lr

    run = RunDir(run_dir)
    try:
        config = run.manifest().get("config") or {}
    except ForgebenchError:
        return None
    optim = config.get("optim")
    status = run.live_status()
    old_total = int(status.get("target_steps") or config.get("steps") or 0)
    done = int(status.get("step") or 0)
    if not isinstance(optim, dict) or not isinstance(optim.get("lr"), (int, float)) or \
            not old_total or new_total <= old_total:
        return None
    ahead = range(done, new_total)
    planned = [section_lr(optim, s, new_total) for s in ahead]
    continued = [section_lr(optim, s, old_total) for s in ahead]
    if all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(planned, continued)):
        return None
    steps, logged = [], []
    for record in JsonlTail(run.path / "metrics.jsonl").read_new():
        if record.get("split", "train") == "train" and isinstance(record.get("lr"), (int, float)):
            steps.append(int(record.get("step", 0)))
            logged.append(float(record["lr"]))
    if not steps:
        steps = list(range(done))
        logged = [section_lr(optim, s, old_total) for s in steps]
    last = logged[-1] if logged else section_lr(optim, max(done - 1, 0), old_total)
    peak = max(range(len(planned)), key=planned.__getitem__)
    text = (f"Resuming {run.path.name} to step {new_total} does not continue its learning-rate "
            f"schedule: that was set for {old_total} steps and was at {last:.3g} when it "
            f"stopped. The {optim.get('schedule', 'constant')} schedule is laid out again over "
            f"{new_total} steps: the rate starts at {planned[0]:.3g}, "
            + (f"rises to {planned[peak]:.3g} at step {done + peak}, " if peak else "")
            + f"and ends at {planned[-1]:.3g}. The dashed curve is the new one.")
    return ExtensionPlan(run.path.name, done, old_total, new_total, (steps, logged),
                         (list(ahead), planned), text)
