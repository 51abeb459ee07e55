"""Several processes training one run on torch.distributed: the one home for the process group,
rank 0's ownership of the run, the sharded data order, the all-reduced token counts, DDP and
FSDP2.

Contract:
- A launched job is `torchrun` (`torch.distributed.run`) starting one process per rank; each
  reads its rank from the environment (`World.from_env`). Without torchrun the world is one
  process and every function here is the identity: nothing changes for a plain `forgebench run`.
- `init(world, device)` joins the process group: gloo on the CPU, NCCL on CUDA.
- Rank 0 owns the run directory. The launcher (`forgebench run --nproc N`) holds the run lock
  for the whole job, and every rank holds the run's rank lock (engine/runlock.py), so no other
  writer starts while a rank lives, even one whose launcher was killed; rank 0 writes status,
  metrics, events and checkpoints under it; every other rank sees the run through
  `FollowerRun`, whose writes are dropped. A rank other than 0 that
  fails writes `rank-<R>.json` into the launcher's reports folder (`RANK_REPORTS_ENV`); the
  launcher turns each into an `error` event with its rank.
- Data order: every rank draws the same global batch from the one cursor (so the cursor, and
  with it the checkpoint, does not depend on the world size) and trains its contiguous share
  (`shard`). A batch that does not split evenly is refused with the reason: the ranks step in
  lockstep, so each must run the same number of micro-batches.
- Token weighting stays exact: each rank divides its summed loss by the *global* token count
  (`all_reduce_sum` of the per-rank counts, before the division), and gradients are summed over
  the ranks, never averaged (the DDP communication hook below, FSDP2's divide factor 1). The
  result differs from one process only in the order of float additions: the all-reduce adds the
  ranks' partial gradients (and loss sums) in its own order, where one process sums all tokens
  in one pass. That is why a 2-rank run equals a 1-rank run to float rounding, not bit for bit.
- Checkpoints hold full tensors whatever the parallelism (`full_tensors` gathers FSDP2 shards
  on every rank; rank 0 writes), so a checkpoint resumes at any world size that splits the batch.
- `agree_stop(flag)`: one rank asked to stop (SIGTERM to any of them) means all stop after the
  same step, and the one checkpoint is written once, by rank 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from engine.errors import ForgebenchError
from engine.fsutil import atomic_write_json
from engine.rundir import RunDir
from engine.train.metrics import WindowLoss

RANK_REPORTS_ENV = "FORGEBENCH_RANK_REPORTS"
# A rank that waits longer than this for its peers gives up (gloo's default is 30 minutes).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @classmethod
    def from_env(cls) -> "World":
        """The rank torchrun gave this process (RANK, WORLD_SIZE, LOCAL_RANK), else one."""
        env = os.environ
        return cls(rank=int(env.get("RANK", 0)), size=int(env.get("WORLD_SIZE", 1)),
                   local_rank=int(env.get("LOCAL_RANK", 0)))

    def describe(self) -> dict:
        return {"rank": self.rank, "world_size": self.size, "local_rank": self.local_rank,
                "backend": dist.get_backend() if dist.is_initialized() else None}


SINGLE = World()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init(world: World, device: torch.device) -> None:
    """Join the process group (once per process; a no-op for one process)."""
    if not world.distributed or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), timeout=COLLECTIVE_TIMEOUT,
                            device_id=device if device.type == "cuda" else None)


def shutdown(finished: bool = False) -> None:
    """Leave the process group. After a job every rank finished, the ranks first meet at a
    barrier: a rank that tears its group down while a peer still has a collective in flight can
    abort in gloo's teardown ("terminate called without an active exception", seen once on a
    2-rank run). After a failure nobody waits: the peer may be gone."""
    if dist.is_initialized():
        if finished:
            with contextlib.suppress(Exception):
                dist.barrier()
        dist.destroy_process_group()


def shard(items: Sequence[T], world: World, what: str = "batch",
          where: str = "the batch size") -> list[T]:
    """This rank's contiguous share of a global batch (see the module docstring)."""
    if len(items) % world.size:
        raise ForgebenchError(
            f"a {what} of {len(items)} does not split evenly across {world.size} processes: "
            "the ranks train in lockstep, so each needs the same share", where=where,
            hint=f"use a multiple of {world.size}, or a process count that divides "
                 f"{len(items)}")
    share = len(items) // world.size
    return list(items[world.rank * share:(world.rank + 1) * share])


def all_reduce_sum(values: Sequence[float], world: World,
                   device: torch.device | None = None) -> list[float]:
    """Elementwise sum over the ranks, in float64 (token counts stay exact integers)."""
    if not world.distributed:
        return [float(v) for v in values]
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def reduce_window(window: WindowLoss, world: World,
                  device: torch.device | None = None) -> WindowLoss:
    """The window's loss over every rank: summed CE and token counts all-reduced (every rank
    then takes the same clip / skip decision and rank 0 logs the global loss)."""
    if not world.distributed:
        return window
    total = WindowLoss()
    total.add(*all_reduce_sum([float(window.sum), window.tokens], world, device))
    total.tokens = int(total.tokens)
    return total


def rank_throughput(tokens_per_s: float, world: World) -> dict:
    """The metrics row's per-rank figures when several ranks train (they step in lockstep, so
    each trains an equal share of the step's tokens in the step's time); none for one."""
    if not world.distributed:
        return {}
    return {"world_size": world.size, "rank_tokens_per_s": tokens_per_s / world.size}


def agree_stop(stop: bool, world: World, device: torch.device | None = None) -> bool:
    """True on every rank when any rank was asked to stop."""
    if not world.distributed:
        return stop
    flag = torch.tensor([1 if stop else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


# -- data parallel: DDP (adapters, small models) and FSDP2 (full fine-tuning) ---------------
def _sum_hook(_state, bucket):
    """Sum a bucket of gradients over the ranks (DDP's default hook would divide by the world
    size; our losses are already divided by the global token count). No annotations: DDP
    checks them, and postponed (string) annotations fail its check."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
        lambda fut: fut.value()[0])


def data_parallel(module: nn.Module, world: World, device: torch.device) -> nn.Module:
    """`module` under DistributedDataParallel with summed gradients, or itself for one rank.

    Every rank built the same module from the same seed, so the initial broadcast is skipped;
    buffers are never broadcast (none of ours changes in training)."""
    if not world.distributed:
        return module
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda"
                                  else None, forward_sync_buffers=False, init_sync=False)
    ddp.register_comm_hook(None, _sum_hook)
    return ddp


def fully_sharded(root: nn.Module, blocks: Sequence[nn.Module], world: World,
                  device: torch.device) -> nn.Module:
    """FSDP2: each block's parameters (and the root's rest) sharded over the ranks, gathered
    for its forward and backward; gradients reduce-scattered as sums (divide factor 1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world.size,))
    for module in (*blocks, root):
        fully_shard(module, mesh=mesh)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)   # plain SUM: gloo has no PREMUL_SUM
    return root


def accumulating(module: nn.Module, last: bool):
    """No gradient all-reduce for this micro-batch unless it is the window's `last` one
    (DDP's `no_sync`); a no-op for a plain or FSDP2 module."""
    no_sync = getattr(module, "no_sync", None)
    return contextlib.nullcontext() if last or no_sync is None else no_sync()


def full_tensors(tensors: dict[str, Any]) -> dict[str, Any]:
    """FSDP2 shards (DTensors) gathered into full tensors; anything else unchanged. Every rank
    must call it, in the same order (it is a collective)."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in tensors.items()}


def full_optimizer_state(state_dict: dict) -> dict:
    """An optimizer state_dict with every sharded tensor gathered (a collective)."""
    return {"state": {index: full_tensors(values)
                      for index, values in state_dict["state"].items()},
            "param_groups": state_dict["param_groups"]}


def shard_optimizer_state(state_dict: dict, optimizer: torch.optim.Optimizer) -> dict:
    """A full-tensor optimizer state laid out like `optimizer`'s (sharded) parameters, ready for
    `load_state_dict` (the inverse of `full_optimizer_state`)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, values in state_dict["state"].items():
        param = params[int(index)]
        state[index] = {
            name: distribute_tensor(v.to(param.device), param.device_mesh, param.placements)
            if isinstance(param, DTensor) and isinstance(v, torch.Tensor)
            and v.shape == param.shape else v
            for name, v in values.items()}
    return {"state": state, "param_groups": state_dict["param_groups"]}


# -- the run as the ranks see it -------------------------------------------------------------
class FollowerRun(RunDir):
    """A rank other than 0: it reads the run like anyone, and every write is dropped (rank 0
    owns status, metrics, events, evals and checkpoints)."""

    writer = False

    def set_status(self, state: str, **fields: Any) -> dict:
        return self.status()

    def log_metric(self, record: dict) -> None:
        pass

    def log_event(self, kind: str, **fields: Any) -> None:
        pass

    def log_invocation(self, record: dict) -> None:
        pass

    def write_eval(self, name: str, result: dict) -> Path:
        return self.evals_dir / f"{name}.json"

    def apply_retention(self, keep_last: int, protect: tuple[str, ...] = ()) -> list[str]:
        return []

    def sweep_staging(self) -> list[str]:
        return []


def is_writer(run: RunDir) -> bool:
    return getattr(run, "writer", True)


def report_failure(world: World, exc: BaseException, *, stage: str, step: int) -> None:
    """A failing rank other than 0 leaves its error for the launcher (see the docstring)."""
    folder = os.environ.get(RANK_REPORTS_ENV)
    if not folder:
        return
    message = exc.render() if isinstance(exc, ForgebenchError) else f"{type(exc).__name__}: {exc}"
    with contextlib.suppress(OSError):
        atomic_write_json(Path(folder) / f"rank-{world.rank}.json", {
            "rank": world.rank, "stage": stage, "step": step, "message": message[:2000],
            "traceback": traceback.format_exc(), "pid": os.getpid()})


def read_failure_reports(folder: str | os.PathLike) -> list[dict]:
    """The rank reports a launched job left, by rank."""
    reports = []
    for path in sorted(Path(folder).glob("rank-*.json")):
        with contextlib.suppress(OSError, ValueError):
            reports.append(json.loads(path.read_text("utf-8")))
    return sorted(reports, key=lambda r: r.get("rank", 0))
