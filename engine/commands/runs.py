"""`forgebench run|resume|status|stop|eval|sample`: the handlers over engine.jobs.

No torch at module top level: `forgebench status` and `stop` stay instant.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

from engine.commands.launch import (
    check_world,
    launch,
    note_world_change,
    wants_launch,
    world_size,
)
from engine.config import load_config, validate_config
from engine.errors import ForgebenchError
from engine.jobs import (
    default_threads,
    execute,
    prepare_resume,
    recipe_for_run,
    recipe_hook,
    require_multi_process,
    start_run,
)
from engine.rundir import (
    RunDir,
    awaits_relocation,
    describe,
    format_status,
    home_workspace,
    relocate,
)
from engine.runlock import signal_holder
from engine.train.integrity import choose_resume_checkpoint


def _print_outcome(run: RunDir, status: dict) -> None:
    summary = describe(run)
    print(f"{status['state']}: step {status.get('step')}/{status.get('target_steps')}"
          f"  run: {run.path}")
    if summary["last_loss"] is not None:
        print(f"last train loss: {summary['last_loss']:.4f}")
    if summary["last_eval"] and summary["last_eval"].get("loss") is not None:
        ev = summary["last_eval"]   # (reports without a loss, e.g. tool-call scores, print none)
        extra = f"  bits/byte: {ev['bpb']:.4f}" if "bpb" in ev else ""
        print(f"last {ev.get('split')} loss: {ev.get('loss'):.4f}{extra}")
    latest = run.latest_checkpoint()
    if latest:
        print(f"checkpoint: {latest.path}")


def _train(args, run: RunDir, config, checkpoint, *, threads: int, argv: list[str],
           overrides: dict | None = None) -> dict:
    """Train in this process, or launch the ranks under torchrun (`--nproc`); the final status."""
    if wants_launch(args):
        return launch(args, run, threads=threads, checkpoint=checkpoint, overrides=overrides)
    return execute(run, config, checkpoint, threads=threads, argv=argv,
                   stop_after_step=getattr(args, "stop_after_step", None))


def cmd_run(args) -> int:
    config = load_config(args.config)
    changes = {k: v for k, v in {"steps": args.steps, "device": args.device}.items()
               if v is not None}
    if changes:
        config = validate_config(dict(config.model_dump(mode="json"), **changes), args.config)
    out = args.out or Path("runs") / f"{config.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    threads = args.threads or default_threads()
    argv = ["forgebench"] + sys.argv[1:]
    check_world(config, args)   # before any folder or process exists
    if wants_launch(args) and args.node_rank != 0:   # rank 0's node creates the run
        status = launch(args, RunDir(out), threads=threads)
        print(f"node {args.node_rank}: {status['state']}")
        return 0
    run = start_run(config, out, argv, threads=threads, world_size=world_size(args))
    try:
        status = _train(args, run, config, None, threads=threads, argv=argv)
    finally:
        run.release_lock()
    _print_outcome(run, status)
    return 0


def cmd_resume(args) -> int:
    overrides = {"steps": args.steps, "log_every": args.log_every,
                 "save_every": args.save_every, "eval_every": args.eval_every,
                 "keep_last": args.keep_last, "device": args.device}
    run, config = prepare_resume(args.run_dir, overrides,
                                 allow_code_change=getattr(args, "allow_code_change", False),
                                 allow_device_change=args.allow_device_change)
    try:  # prepare_resume took the run lock
        checkpoint = choose_resume_checkpoint(run, getattr(args, "from_step", None))
        if checkpoint and checkpoint.step >= config.steps:
            raise ForgebenchError(
                f"the run is already at step {checkpoint.step} of {config.steps}",
                path=run.path, hint="pass --steps N with a larger N to train on")
        recorded = run.manifest()["environment"]["threads"]
        threads = args.threads or recorded
        if threads != recorded:
            run.log_event("warning", message=f"resumed with {threads} threads instead of "
                          f"{recorded}: results will not be bitwise identical to an "
                          "uninterrupted run")
        argv = ["forgebench"] + sys.argv[1:]
        require_multi_process(config, world_size(args))
        check_world(config, args)
        note_world_change(run, world_size(args))
        status = _train(args, run, config, checkpoint, threads=threads, argv=argv,
                        overrides={k: v for k, v in overrides.items() if v is not None})
    finally:
        run.release_lock()
    _print_outcome(run, status)
    return 0


def cmd_status(args) -> int:
    print(format_status(describe(RunDir(args.run_dir).require())))
    return 0


def cmd_relocate(args) -> int:
    run = RunDir(args.run_dir).require()
    workspace = Path(args.workspace) if args.workspace else home_workspace(run.path)
    if workspace is None:
        raise ForgebenchError("the run is not in a workspace's runs/ folder, so which workspace "
                              "it lives in is not known", path=run.path,
                              hint="name it: forgebench relocate RUN WORKSPACE")
    if not workspace.is_dir():
        raise ForgebenchError("no such workspace folder", path=workspace,
                              hint="name the folder that holds the run's datasets/")
    if not awaits_relocation(run):
        print(f"nothing to relocate: {run.path} records its own folders already")
        return 0
    changed = relocate(run.path, workspace)
    print(f"relocated into {workspace.resolve()}: {len(changed)} files rewritten")
    return 0


def cmd_stop(args) -> int:
    run = RunDir(args.run_dir).require()
    holder = signal_holder(run.path, signal.SIGTERM)  # refuses, saying why, if unsure
    if holder is None:
        print(f"not running (state: {run.live_status().get('state')})")
        return 1
    print(f"stop requested (pid {holder.get('pid')})")
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline and run.is_active():
        time.sleep(0.2)
    state = run.live_status().get("state")
    print(f"state: {state}")
    return 0 if args.wait <= 0 or state not in ("running", "stopping") else 1


def cmd_eval(args) -> int:
    from engine.jobs import run_config
    from engine.train.precision import pinned_auto, run_precision

    run = RunDir(args.run_dir).require()
    module = recipe_for_run(run)
    # a recipe's autocast("auto") computes as the run trained (run.json), not resolved afresh
    with pinned_auto(run_precision(run, run_config(run))):
        result = module.evaluate(run, run.checkpoint(args.checkpoint), args.split)
    print(json.dumps(result, indent=2, default=str))
    return 0


def cmd_sample(args) -> int:
    run = RunDir(args.run_dir).require()
    sample = recipe_hook(run, "sample", "has no sampler",
                         "use 'forgebench generate' for language models")
    for path in sample(run, run.checkpoint(args.checkpoint), args):
        print(path)
    return 0
