"""Job lifecycle: start, resume, execute; the run.json ingredients; a run's recipe.

A job runs in the foreground of a `forgebench` process (the app starts it through QProcess).
Its whole state lives in the run directory (docs/design.md §2). No torch at module top level:
`forgebench status` and `stop` stay instant.

A job is the run's one writer: `start_run` (through `RunDir.create`) or `prepare_resume` takes
the run lock (engine/runlock.py) and `job_session` keeps it until the job ends; resume picks its
checkpoint through engine/train/integrity.py (verified, with fallback).

A launched job (`forgebench run --nproc N`, engine/train/distributed.py) is one job of several
processes: the launcher holds the run lock, rank 0 is the writer under it (`job_session` with a
`World` whose rank is 0 takes no lock of its own) and every other rank gets a `FollowerRun`. The
device the job trains on (engine/train/devices.py) is resolved before the run folder is created
and recorded in run.json; resuming on another device type is a recorded override.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

from engine.config import (
    RECIPES,
    RESUMABLE_FIELDS,
    Schema,
    added_since,
    config_diff,
    recipe_module,
    validate_config,
)
from engine.errors import ForgebenchError
from engine.fsutil import disk_error, sha256_file
from engine.paths import require_writable_dir
from engine.rundir import Checkpoint, RunDir, require_relocated
from engine.train.precision import bf16_scheme, requested_precision, resolve_precision

ENGINE_DIR = Path(__file__).resolve().parent


# -- run.json ingredients -----------------------------------------------------------------
def code_files(relative_paths: list[str] | None = None) -> dict[str, str]:
    """SHA-256 of the engine source files a job runs: by default every engine module loaded
    in this process (call it after importing the recipe), else the given paths."""
    if relative_paths is None:
        paths = set()
        for module in list(sys.modules.values()):
            file = getattr(module, "__file__", None)
            if file and Path(file).suffix == ".py" and ENGINE_DIR in Path(file).resolve().parents:
                paths.add(Path(file).resolve().relative_to(ENGINE_DIR).as_posix())
        relative_paths = sorted(paths)
    return {rel: (sha256_file(ENGINE_DIR / rel) if (ENGINE_DIR / rel).is_file() else "missing")
            for rel in relative_paths}


def code_version(files: dict[str, str]) -> str:
    """One SHA-256 over (path, file hash) pairs: the run's code identity."""
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(f"{rel}\0{files[rel]}\n".encode())
    return digest.hexdigest()


def cpu_info() -> tuple[str, list[str]]:
    model, flags = platform.processor() or platform.machine(), []
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine()):
                model = value.strip()
            if key.strip() in ("flags", "Features") and not flags:
                flags = value.split()
    wanted = ("avx", "fma", "f16c", "amx", "sse4", "asimd", "sve", "neon", "bf16")
    return model, sorted(f for f in flags if f.startswith(wanted) or f in wanted)


def environment(threads: int, device: dict | None = None, world_size: int = 1) -> dict:
    """What run.json records about the machine; `device` is `devices.describe` of the device
    the job trains on, `world_size` the processes it trains with."""
    import torch

    model, flags = cpu_info()
    return {"python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "numpy": __import__("numpy").__version__, "threads": threads,
            "platform": platform.platform(), "cpu": model, "cpu_flags": flags,
            "device": device or {"type": "cpu", "index": None}, "world_size": world_size}


def job_device(config: Schema, module: Any, local_rank: int = 0, where: str = "field 'device'"):
    """The torch.device this recipe's job trains on (engine/train/devices.py)."""
    from engine.train import devices

    return devices.resolve(getattr(config, "device", "cpu"), local_rank, where,
                           cuda_ok=RECIPES[config.recipe].cuda)


def require_multi_process(config: Schema, processes: int) -> None:
    """Only recipes that shard their batch over ranks (`multi_process` in their registry row)
    run on several processes: any other would train N unsynchronised copies."""
    if processes > 1 and not RECIPES[config.recipe].multi_process:
        raise ForgebenchError(f"recipe '{config.recipe}' trains in one process only",
                              where="--nproc", hint="drop --nproc / --nnodes")


def recorded_device_type(manifest: dict) -> str:
    """The device type a run trained on (runs before devices existed recorded "cpu")."""
    device = manifest.get("environment", {}).get("device", "cpu")
    return device if isinstance(device, str) else device.get("type", "cpu")


def default_threads() -> int:
    import torch

    return torch.get_num_threads()


def base_model_of(config: Schema, module: Any) -> dict | None:
    """The base model a recipe starts from (path + SHA-256), if any.

    A recipe whose registry row has the "base" capability names it with
    `base_model(config) -> Path | None`.
    """
    hook = module.base_model if "base" in RECIPES[config.recipe].capabilities else None
    path = hook(config) if hook else None
    if path is None:
        return None
    path = Path(path)
    if not path.is_file():
        raise ForgebenchError("base model file not found", path=path,
                              hint="check the model path in the config")
    return {"path": str(path), "sha256": sha256_file(path)}


def start_run(config: Schema, out_dir: str | os.PathLike, argv: list[str], *,
              threads: int | None = None, world_size: int = 1) -> RunDir:
    """Create a fresh run directory with its immutable run.json. Refuses a non-empty folder.

    The device is resolved and the data and base model are hashed before the folder is
    created, so bad input (device = "cuda" without a GPU included) leaves nothing behind.
    """
    from engine.train import devices

    run = RunDir(out_dir)
    if run.path.exists() and (not run.path.is_dir() or any(run.path.iterdir())):
        run.create({})  # raises the standard "not empty" error, touching nothing
    require_writable_dir(run.path, "--out")
    module = recipe_module(config.recipe)
    device = job_device(config, module)
    require_multi_process(config, world_size)
    data = module.data_manifest(config)
    base = base_model_of(config, module)
    threads = threads or default_threads()
    files = code_files()
    requested = requested_precision(config)
    manifest = {
        "recipe": config.recipe,
        "config": config.model_dump(mode="json"),
        "data": data,
        "base_model": base,
        "code_version": code_version(files),
        "code_files": files,
        "environment": environment(threads, devices.describe(device), world_size),
        # "auto" resolved once, here: every invocation of the run computes in this precision
        "precision": (resolve_precision(requested, bf16_scheme(config)).as_dict()
                      if requested else None),
        "argv": list(argv),
        "created": time.time(),
    }
    try:
        run.create(manifest)  # takes the run lock; the job session releases it
    except BaseException:
        run.release_lock()
        raise
    return run


def prepare_resume(run_dir: str | os.PathLike, overrides: dict,
                   allow_code_change: bool = False,
                   allow_device_change: bool = False) -> tuple[RunDir, Schema]:
    """Re-validate a run for resuming; only the step target and cadence may change, and the
    device (`overrides["device"]`) within its type, or across types with
    `allow_device_change` (recorded as a warning).

    Takes the run's lock first (a second writer is refused with the holder's identity); the
    caller releases it when the job ends (`job_session`) or on error."""
    run = RunDir(run_dir).require()
    require_relocated(run)
    run.acquire_lock("resume")
    try:
        run.require_unedited_manifest()
        config = _validate_resume(run, overrides, allow_code_change)
        _check_device_move(run, config, allow_device_change)
        return run, config
    except BaseException:
        run.release_lock()
        raise


def _validate_resume(run: RunDir, overrides: dict, allow_code_change: bool) -> Schema:
    manifest = run.manifest()
    stored = manifest["config"]
    resumable = RESUMABLE_FIELDS + ("device",)   # the device: see _check_device_move
    illegal = sorted(k for k, v in overrides.items() if v is not None and k not in resumable)
    if illegal:
        raise ForgebenchError("resume may only change " + ", ".join(RESUMABLE_FIELDS),
                              path=run.manifest_path, where="field " + ", ".join(illegal))
    wanted = dict(stored, **{k: v for k, v in overrides.items() if v is not None})
    config = validate_config(wanted, run.manifest_path)
    changed = [name for name in config_diff(stored, config.model_dump(mode="json"))
               if name.split(".")[0] not in resumable and not added_since(stored, name)]
    if changed:
        raise ForgebenchError("the recipe's schema no longer reads this run's config the same way",
                              path=run.manifest_path, where="field " + ", ".join(changed),
                              hint="resume with the engine version that started the run")
    module = recipe_module(config.recipe)
    from engine.data.dataset import data_change

    data = module.data_manifest(config)
    change = data_change(manifest["data"], data)
    if change:
        raise ForgebenchError(
            "the training data changed since the run started: " + change,
            path=run.manifest_path,
            where="field 'data'",
            hint="restore the original data files, or start a new run on the new data")
    base = base_model_of(config, module)
    if (base or {}).get("sha256") != (manifest.get("base_model") or {}).get("sha256"):
        raise ForgebenchError("the base model file changed since the run started",
                              path=(base or manifest.get("base_model") or {}).get("path"),
                              hint="restore the original base model, or start a new run")
    recorded = manifest.get("code_files", {})
    changed = sorted(rel for rel, digest in code_files(sorted(recorded)).items()
                     if digest != recorded[rel])
    if changed:
        if not allow_code_change:
            raise ForgebenchError(
                "the engine code changed since the run started; resume would not be exact: "
                + ", ".join(f"engine/{rel}" for rel in changed),
                path=run.manifest_path, where="field 'code_files'",
                hint="resume with the original code, or pass --allow-code-change to accept it")
        run.log_event("warning", message="resumed with changed engine code",
                      changed_files=changed)
    return config


def _check_device_move(run: RunDir, config: Schema, allow: bool) -> None:
    """Same device type: exact resume. CPU <-> GPU: refused, or with `allow` a warning event
    (the arithmetic differs, so the steps after it are not those of an uninterrupted run)."""
    before = recorded_device_type(run.manifest())
    now = job_device(config, recipe_module(config.recipe), where="--device").type
    if now == before:
        return
    if not allow:
        raise ForgebenchError(
            f"this run trained on {before}; resuming on {now} would not be exact",
            path=run.manifest_path, where="field 'environment.device'",
            hint=f"pass --device {before}, or --allow-device-change to accept it (recorded)")
    run.log_event("warning", message=f"resumed on {now} instead of {before}: the arithmetic "
                  "differs, so later steps are not bitwise those of an uninterrupted run",
                  override="device", before=before, after=now)


# -- the running job ----------------------------------------------------------------------
class Job:
    """What a recipe's `train(job)` sees: the run, its config, where to resume from, and the
    stop flag it must check after every optimizer step."""

    def __init__(self, run: RunDir, config: Schema, resume_from: Checkpoint | None, *,
                 invocation: int, threads: int, stop_after_step: int | None = None,
                 progress: bool = True, world: Any = None):
        from engine.train.distributed import SINGLE

        self.run = run
        self.world = world or SINGLE       # this process's rank (engine/train/distributed.py)
        self.device: Any = None            # the torch.device, set by `execute`
        self.config = config
        self.resume_from = resume_from
        self.invocation = invocation
        self.threads = threads
        # `stop_requested` is what the loop acts on. With several ranks a signal only marks
        # `stop_asked`; the ranks turn it into `stop_requested` together in `step_done`, so a
        # SIGTERM landing between that agreement and the loop's own check cannot make one rank
        # checkpoint and leave while its peers start the next step (and wait on it forever).
        self.stop_requested = False
        self.stop_reason: str | None = None
        self.stop_asked: str | None = None
        self.stage = "loading"
        self.stage_detail: str | None = None
        self.step = resume_from.step if resume_from else 0
        self.stop_after_step = stop_after_step
        self.show_progress = progress
        self._last_status = 0.0

    def request_stop(self, reason: str) -> None:
        if self.stop_asked is None:
            self.stop_asked = reason
        if not self.world.distributed:
            self._stop_now(reason)

    def _stop_now(self, reason: str) -> None:
        if not self.stop_requested:
            self.stop_requested, self.stop_reason = True, reason

    def announce(self, stage: str, detail: str) -> None:
        """Enter a long stage before the first step (loading a base, encoding samples):
        status.json says so at once and events.jsonl keeps a `stage` event, so the app can show
        "loading base 250 MB" instead of a silent "0 / 30"."""
        self.stage, self.stage_detail = stage, detail
        self.run.set_status("stopping" if self.stop_asked else "running", step=self.step,
                            stage=stage, stage_detail=detail)
        self.run.log_event("stage", stage=stage, detail=detail, step=self.step,
                           invocation=self.invocation)

    def step_done(self, step: int, **status_fields: Any) -> None:
        """Record a finished optimizer step: status.json (throttled) and the test-only
        stop-after-step knob (a real SIGTERM to ourselves)."""
        self.step = step
        if self.stop_after_step is not None and step >= self.stop_after_step:
            self.stop_after_step = None
            os.kill(os.getpid(), signal.SIGTERM)
        if self.world.distributed:    # a stop asked of any rank stops all after this step
            from engine.train.distributed import agree_stop

            asked = self.stop_asked
            if agree_stop(asked is not None, self.world, self.device):
                self._stop_now(asked or "another rank was asked to stop")
        now = time.monotonic()
        if self.stop_requested or now - self._last_status >= 0.5:
            self._last_status = now
            state = "stopping" if self.stop_requested else "running"
            self.stage_detail = None        # stepping: the app shows step and ETA instead
            self.run.set_status(state, step=step, stage=self.stage, stage_detail=None,
                                **status_fields)

    def progress(self, total: int, initial: int = 0, desc: str = "train"):
        """A tqdm bar on stderr (disabled when not wanted)."""
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit="step", file=sys.stderr,
                    disable=not self.show_progress or not self.world.is_main,
                    dynamic_ncols=True, leave=False)


@contextlib.contextmanager
def job_session(run: RunDir, config: Schema, resume_from: Checkpoint | None, *,
                argv: list[str] | None = None, threads: int = 1,
                stop_after_step: int | None = None, progress: bool = True,
                world: Any = None) -> Iterator[Job]:
    """Mark the run running, log the invocation, turn SIGTERM into a graceful stop, and record
    how the job ended: completed, stopped, or failed (with stage and traceback).

    The job holds the run lock throughout (taken here if the caller has not; a launched job's
    launcher holds it for all ranks) and, as the one writer, first repairs what a killed
    predecessor left: torn log tails, orphaned checkpoint folders. A rank other than 0 writes
    nothing (`_follower_session`)."""
    from engine.train.distributed import SINGLE, FollowerRun

    world = world or SINGLE
    if not world.is_main:
        with _follower_session(FollowerRun(run.path), config, resume_from, threads=threads,
                               progress=progress, world=world) as job:
            yield job
        return
    if not world.distributed:
        run.acquire_lock("job")
    try:
        with _locked_session(run, config, resume_from, argv=argv, threads=threads,
                             stop_after_step=stop_after_step, progress=progress,
                             world=world) as job:
            yield job
    finally:
        run.release_lock()


def _graceful_stop(job: Job) -> dict:
    """SIGTERM/SIGINT ask the job to stop after its step (a second SIGINT interrupts);
    returns the previous handlers."""
    def on_signal(signum, _frame):
        if job.stop_asked is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        job.request_stop(signal.Signals(signum).name)

    return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}


@contextlib.contextmanager
def _follower_session(run: RunDir, config: Schema, resume_from: Checkpoint | None, *,
                      threads: int, progress: bool, world: Any) -> Iterator[Job]:
    """A rank other than 0: the same job, stopping on the same signals; a failure is left for
    the launcher to record with this rank (rank 0 owns events.jsonl)."""
    from engine.train.distributed import report_failure

    job = Job(run, config, resume_from, invocation=0, threads=threads, progress=progress,
              world=world)
    previous = _graceful_stop(job)
    try:
        yield job
    except BaseException as exc:
        report_failure(world, exc, stage=job.stage, step=job.step)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _repair_after_crash(run: RunDir) -> None:
    from engine.jsonl import repair_torn_tail

    for name in ("invocations.jsonl", "events.jsonl", "metrics.jsonl"):
        removed = repair_torn_tail(run.path / name)
        if removed:
            run.log_event("log_repaired", file=name, bytes_removed=removed,
                          message=f"removed a torn last line ({removed} bytes) left by a "
                                  "killed job")
    swept = run.sweep_staging()
    if swept:
        run.log_event("checkpoints_swept", folders=swept,
                      message="removed unfinished checkpoint folders left by a killed job")


@contextlib.contextmanager
def _locked_session(run: RunDir, config: Schema, resume_from: Checkpoint | None, *,
                    argv: list[str] | None, threads: int, stop_after_step: int | None,
                    progress: bool, world: Any) -> Iterator[Job]:
    _repair_after_crash(run)
    invocation = len(run.invocations()) + 1
    job = Job(run, config, resume_from, invocation=invocation, threads=threads,
              stop_after_step=stop_after_step, progress=progress, world=world)
    optim = getattr(config, "optim", None)
    run.log_invocation({
        "id": invocation, "argv": list(argv or sys.argv), "pid": os.getpid(),
        "kind": "resume" if resume_from else "start",
        "resumed_from": resume_from.name if resume_from else None,
        "start_step": job.step, "target_steps": config.steps, "threads": threads,
        "lr": getattr(optim, "lr", None), "stop_after_step": stop_after_step,
        "world_size": world.size, "device": getattr(config, "device", "cpu"),
    })
    run.set_status("running", pid=os.getpid(), step=job.step, target_steps=config.steps,
                   invocation=invocation, stage=job.stage, error=None)

    previous = _graceful_stop(job)
    try:
        yield job
    except BaseException as exc:
        disk = disk_error(exc, fallback=run.path)   # a full or read-only disk: where, free
        message = (exc.render() if isinstance(exc, ForgebenchError)
                   else disk.render() if disk is not None
                   else f"{type(exc).__name__}: {exc}")
        # On a full disk these writes may fail too; the released lock then tells readers the
        # job is gone (status shows failed) and the error reaches stderr all the same.
        with contextlib.suppress(OSError, ForgebenchError):
            run.log_event("error", stage=job.stage, step=job.step, message=message[:2000],
                          traceback=traceback.format_exc(), invocation=invocation,
                          rank=world.rank)
        with contextlib.suppress(OSError, ForgebenchError):
            run.set_status("failed", step=job.step, stage=job.stage, stage_detail=None,
                           error=message[:2000], pid=None)
        if disk is not None and not isinstance(exc, ForgebenchError):
            raise disk from None
        raise
    else:
        done = job.step >= config.steps
        state = "completed" if done or not job.stop_requested else "stopped"
        run.set_status(state, step=job.step, stage="done", stage_detail=None, pid=None,
                       stop_reason=None if done else job.stop_reason)
        run.log_event("invocation_end", invocation=invocation, state=state, step=job.step,
                      reason=job.stop_reason)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def execute(run: RunDir, config: Schema, resume_from: Checkpoint | None, *, threads: int,
            argv: list[str] | None = None, stop_after_step: int | None = None,
            progress: bool = True, world: Any = None) -> dict:
    """Run the recipe's `train(job)` in this process (one rank of `world`, by default the only
    one); return the final status."""
    with job_session(run, config, resume_from, argv=argv, threads=threads,
                     stop_after_step=stop_after_step, progress=progress, world=world) as job:
        import torch  # inside the session: a failure here is recorded, never left `queued`

        from engine.train import distributed

        torch.set_num_threads(threads)
        module = recipe_module(config.recipe)
        job.device = job_device(config, module, job.world.local_rank)
        distributed.init(job.world, job.device)
        module.train(job)
    return run.status()


def run_config(run: RunDir) -> Schema:
    """The resolved config a run was started with, validated again."""
    require_relocated(run)
    return validate_config(run.manifest()["config"], run.manifest_path)


def recipe_for_run(run: RunDir) -> Any:
    """The recipe module of an existing run, with torch set to the thread count it ran with."""
    import torch

    torch.set_num_threads(run.manifest().get("environment", {}).get("threads") or 1)
    return recipe_module(run.manifest()["recipe"])


def recipe_hook(run: RunDir, name: str, lacks: str, hint: str) -> Any:
    """The function `name` of a run's recipe (`generate`, `sample`, `decide`, ...); a recipe
    without it is refused as "recipe 'R' {lacks}" with `hint`."""
    module = recipe_for_run(run)
    if not hasattr(module, name):
        raise ForgebenchError(f"recipe '{run.manifest()['recipe']}' {lacks}", path=run.path,
                              hint=hint)
    return getattr(module, name)
