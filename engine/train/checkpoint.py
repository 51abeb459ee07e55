"""Checkpoints that a crash can never half-write and that resume bit for bit.

A checkpoint directory holds:

    model.safetensors        the model (or adapter) tensors
    optimizer.safetensors    every tensor of the optimizer state, keyed "<param index>.<name>"
    optimizer.json           the optimizer's non-tensor state and param groups
    <extra files>            e.g. tokenizer.json
    trainer_state.json       step, data cursor, RNG states, each file's size and SHA-256 ...
                             written LAST (the commit sentinel)

It is staged in a hidden directory and renamed into place (`RunDir.staging_checkpoint`).

Under torch.distributed every rank calls `save_checkpoint` (FSDP2 shards are gathered into full
tensors, a collective) and only rank 0 writes: a checkpoint is the same files whatever the world
size, so it resumes on any (engine/train/distributed.py).
"""

from __future__ import annotations

import base64
import json
import os
import random
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from engine.errors import ForgebenchError
from engine.fsutil import (
    atomic_write_bytes,
    atomic_write_json,
    disk_errno,
    read_json,
    require_free_space,
)
from engine.rundir import SENTINEL, Checkpoint, RunDir, checkpoint_name
from engine.train.data_order import DataCursor
from engine.train.distributed import full_optimizer_state, full_tensors, is_writer
from engine.train.integrity import file_records

MODEL_FILE = "model.safetensors"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_JSON = "optimizer.json"


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _split_optimizer_state(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Separate the tensors (for safetensors) from the JSON-able rest of an optimizer state."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, per_param in state_dict["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    return tensors, {"scalars": scalars, "param_groups": state_dict["param_groups"]}


def _join_optimizer_state(tensors: dict[str, torch.Tensor], rest: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        index, _, name = key.partition(".")
        state.setdefault(int(index), {})[name] = value
    for index, values in rest["scalars"].items():
        state.setdefault(int(index), {}).update(values)
    return {"state": state, "param_groups": rest["param_groups"]}


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' `save_file`, with a full disk reported as the OSError it is (safetensors
    wraps it in its own error type, without the file's name)."""
    try:
        save_file(tensors, str(path))
    except Exception as exc:
        code = disk_errno(exc)
        if code is None:
            raise
        raise OSError(code, os.strerror(code), str(path)) from None


def checkpoint_due(config: Any, step: int, stop_requested: bool, eval_due: bool = False) -> bool:
    """Whether a training loop saves after `step`: at the last step, when asked to stop (so a
    stopped run resumes where it stopped), every `config.save_every` steps, and with an eval."""
    return bool(eval_due or step == config.steps or stop_requested
                or (config.save_every and step % config.save_every == 0))


def save_checkpoint(run: RunDir, step: int, *, model_tensors: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer | None = None, trainer_state: dict,
                    extra_files: dict[str, bytes] | None = None, keep_last: int,
                    protect: tuple[str, ...] = ()) -> Checkpoint:
    """Write `checkpoints/step-NNNNNN` atomically, then apply keep-last-K retention.

    `trainer_state` must be JSON-serialisable; include `rng_state()` and the data cursor in it.
    `protect` names checkpoints retention must keep (e.g. the best one).
    """
    model_tensors = {k: v.detach().cpu().contiguous()
                     for k, v in full_tensors(model_tensors).items()}
    opt_tensors, opt_rest = ({}, None)
    if optimizer is not None:
        opt_tensors, opt_rest = _split_optimizer_state(
            full_optimizer_state(optimizer.state_dict()))
    checkpoint = Checkpoint(run.checkpoints_dir / checkpoint_name(step), step)
    if not is_writer(run):   # a rank other than 0: it took part in the gathering, rank 0 writes
        return checkpoint
    extra_files = extra_files or {}
    needed = (_tensor_bytes(model_tensors.values()) + _tensor_bytes(opt_tensors.values())
              + sum(len(b) for b in extra_files.values()) + 1_000_000)
    run.checkpoints_dir.mkdir(parents=True, exist_ok=True)
    require_free_space(run.checkpoints_dir, needed,
                       hint="free some space or lower keep_last; then forgebench resume RUN_DIR")

    with run.staging_checkpoint(step) as tmp:
        _save_tensors(model_tensors, tmp / MODEL_FILE)
        if optimizer is not None:
            _save_tensors(opt_tensors, tmp / OPTIMIZER_TENSORS)
            atomic_write_json(tmp / OPTIMIZER_JSON, opt_rest)
        for name, data in extra_files.items():
            atomic_write_bytes(tmp / name, data)
        # Sizes and hashes let a resume tell an intact checkpoint from a damaged one.
        files = file_records(tmp, sorted(p.name for p in tmp.iterdir() if p.is_file()))
        atomic_write_json(tmp / SENTINEL, dict(trainer_state, step=step, files=files))
    removed = run.apply_retention(keep_last, protect)
    run.log_event("checkpoint_saved", step=step, checkpoint=checkpoint.name,
                  path=str(checkpoint.path.relative_to(run.path)), bytes=needed - 1_000_000,
                  removed=removed)
    return checkpoint


def load_checkpoint(checkpoint: Checkpoint) -> tuple[dict[str, torch.Tensor], dict | None, dict]:
    """(model tensors, optimizer state_dict or None, trainer_state) of a committed checkpoint."""
    path = checkpoint.path
    if not (path / SENTINEL).is_file():
        raise ForgebenchError("not a committed checkpoint (trainer_state.json is missing)",
                              path=path, hint="use 'latest' or another step")
    try:
        model = load_file(str(path / MODEL_FILE))
    except FileNotFoundError:
        raise ForgebenchError("checkpoint has no model.safetensors", path=path) from None
    except Exception as exc:  # safetensors raises its own error types for truncated files
        raise ForgebenchError(f"unreadable weights ({exc})", path=path / MODEL_FILE) from None
    optimizer = None
    if (path / OPTIMIZER_JSON).is_file():
        optimizer = _join_optimizer_state(load_file(str(path / OPTIMIZER_TENSORS)),
                                          read_json(path / OPTIMIZER_JSON))
    return model, optimizer, read_json(path / SENTINEL)


# -- RNG state as JSON ----------------------------------------------------------------------
def rng_state() -> dict:
    """Every RNG a recipe may draw from, as JSON: torch (CPU), numpy's global, python's."""
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
        "numpy": {"kind": np_state[0], "keys": np_state[1].tolist(), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": {"version": py_version, "internal": list(py_internal), "gauss": py_gauss},
    }


def set_rng_state(state: dict) -> None:
    torch_bytes = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(torch_bytes), dtype=torch.uint8))
    np_state = state["numpy"]
    np.random.set_state((np_state["kind"], np.array(np_state["keys"], dtype=np.uint32),
                         np_state["pos"], np_state["has_gauss"], np_state["cached_gaussian"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))


# -- where a training loop stands ------------------------------------------------------------
def loop_state(cursor: DataCursor, skipped_total: int, elapsed_s: float) -> dict:
    """The trainer_state entries every training loop resumes from (`save_checkpoint` adds the
    step): the data cursor, every RNG, the skipped-step count and the training time so far."""
    return {"cursor": cursor.state(), "rng": rng_state(), "skipped_total": skipped_total,
            "elapsed_s": elapsed_s}


def resume_loop(state: dict) -> tuple[DataCursor, int, int, float]:
    """Restore the RNGs of a checkpoint's trainer_state (written with `loop_state`) and return
    where its loop stood: (data cursor, step, skipped steps, training seconds)."""
    set_rng_state(state["rng"])
    return (DataCursor.from_state(state["cursor"]), state["step"], state["skipped_total"],
            state["elapsed_s"])


def generator_state(generator: torch.Generator) -> str:
    """A torch.Generator's state as JSON text (for recipe-owned generators)."""
    return base64.b64encode(generator.get_state().numpy().tobytes()).decode("ascii")


def set_generator_state(generator: torch.Generator, state: str) -> None:
    generator.set_state(torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8))


def dumps(obj: Any) -> bytes:
    """JSON bytes for `extra_files`."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")
