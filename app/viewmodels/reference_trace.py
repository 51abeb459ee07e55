"""A reference loss trace beside a run's loss: the file a config names in `[compare]
reference_trace` (tests/data/nanochat/make_reference_trace.py writes them: the pinned nanochat
trained on the same config, tokens, order, seed and schedule), and its overlay on the run's train
loss: the steps both have, and the largest |Δ loss| over them.

Δ is taken on the raw losses of the steps both logged (a step a resumed run logged twice counts
with its last value); the chart's smoothing never enters it. The parity ladder's loss-trace
tolerance (1e-4 per step) is what the readout measures against. A reference trace holds the
thread count and kind of CPU it ran on because training amplifies a summation order's
rounding (measured: nanochat on 2 threads against itself on 1, 3.1e-2 by step 38 of the tiny
sample), so a readout beyond the tolerance says when the run's threads differ.

No Qt, no torch: the Runs pane's chart draws what `loss_overlay` returns."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ForgebenchError

LADDER_TOLERANCE = 1e-4     # tests/test_nanochat_parity.py: the loss trace, per step
LADDER_TOLERANCE_TEXT = "1e-4"
TRACE_KIND = "reference-loss-trace"


@dataclass(frozen=True)
class ReferenceTrace:
    label: str
    steps: list[int]
    loss: list[float]
    threads: int | None = None
    cpu: str | None = None


def reference_trace_path(config: dict) -> Path | None:
    """Where a run's resolved config (run.json's `config`) says its reference trace is:
    relative to the config's folder (`base_dir`); None when it names none."""
    compare = config.get("compare")
    value = compare.get("reference_trace") if isinstance(compare, dict) else None
    if not value:
        return None
    path = Path(str(value)).expanduser()
    base = config.get("base_dir")
    return path if path.is_absolute() or not base else Path(str(base)) / path


def read_reference_trace(path: Path) -> ReferenceTrace:
    """The trace in `path`; a missing, unreadable or malformed file is a ForgebenchError."""
    hint = "make one with tests/data/nanochat/make_reference_trace.py, or clear " \
           "[compare] reference_trace"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ForgebenchError("reference trace not found", path=path,
                              where="field 'compare.reference_trace'", hint=hint) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ForgebenchError(f"not a readable JSON trace ({exc})", path=path,
                              hint=hint) from None
    if not isinstance(data, dict) or data.get("kind") != TRACE_KIND:
        raise ForgebenchError(f"not a reference loss trace (kind is not {TRACE_KIND!r})",
                              path=path, where="field 'kind'", hint=hint)
    steps, loss = data.get("steps"), data.get("loss")
    if not isinstance(steps, list) or not isinstance(loss, list) or len(steps) != len(loss) \
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps) \
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in loss):
        raise ForgebenchError("steps and loss must be lists of numbers of one length",
                              path=path, where="fields 'steps', 'loss'", hint=hint)
    reference = data.get("reference") if isinstance(data.get("reference"), dict) else {}
    threads = reference.get("threads")
    return ReferenceTrace(label=str(data.get("label") or Path(path).stem), steps=steps,
                          loss=[float(v) for v in loss],
                          threads=threads if isinstance(threads, int) else None,
                          cpu=reference.get("cpu"))


@dataclass(frozen=True)
class LossOverlay:
    label: str
    steps: list[int]                 # the reference's curve
    loss: list[float]
    shared_steps: int                # steps with a finite loss in both
    max_abs_delta: float | None      # over the shared steps (None: none shared)
    at_step: int | None              # where it is largest (the first such step)
    caveat: str = ""                 # why a run may differ from the trace (threads)

    def readout(self) -> str:
        """One line for the chart's summary: the largest |Δ loss| and the ladder's bar."""
        if self.max_abs_delta is None:
            return "no shared steps yet"
        within = self.max_abs_delta <= LADDER_TOLERANCE
        if self.max_abs_delta == 0:
            text = f"|Δ loss| 0 at all {self.shared_steps} shared steps"
        else:
            text = (f"max |Δ loss| {self.max_abs_delta:.2g} at step {self.at_step} "
                    f"({self.shared_steps} shared steps)")
        text += f": {'within' if within else 'beyond'} the ladder's {LADDER_TOLERANCE_TEXT}"
        return text if within or not self.caveat else f"{text}; {self.caveat}"


def loss_overlay(trace: ReferenceTrace, run_steps: list[int], run_loss: list[float],
                 run_threads: int | None = None) -> LossOverlay:
    """The trace beside a run's train loss (its metrics rows' steps and losses, raw)."""
    ours: dict[int, float] = {}
    for step, value in zip(run_steps, run_loss):
        ours[int(step)] = value                   # a re-logged step: the last value counts
    best: tuple[float, int] | None = None
    shared = 0
    for step, ref in zip(trace.steps, trace.loss):
        value = ours.get(step)
        if value is None or not math.isfinite(value) or not math.isfinite(ref):
            continue
        shared += 1
        delta = abs(value - ref)
        if best is None or delta > best[0]:
            best = (delta, step)
    caveat = ""
    if trace.threads is not None and run_threads is not None and run_threads != trace.threads:
        caveat = (f"reference on {trace.threads} thread{'s' * (trace.threads != 1)}, this run "
                  f"on {run_threads} (another summation order's rounding, which training "
                  "amplifies)")
    return LossOverlay(trace.label, list(trace.steps), list(trace.loss), shared,
                       best[0] if best else None, best[1] if best else None, caveat)
