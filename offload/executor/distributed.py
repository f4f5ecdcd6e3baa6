"""``offload train --nproc N``: the same training on N data-parallel ranks of this machine.

The command starts itself again under ``torch.distributed.run`` (one process per rank,
gloo on the CPU, NCCL on GPUs, each rank on its own GPU).  Every rank rebuilds the chain's
model, wraps it in ``DistributedDataParallel`` and stages that (``Offloaded(DDP(model))``,
the order ``tests/test_stacks.py`` checks bit for bit), and trains on its own batch: the
example batch with floats shifted and integers rolled by the rank, so that the gradient
all-reduce matters.  One chain and one schedule serve every rank; each rank's host arena
is counted against the machine's memory times the ranks (``arena``).  Rank 0 prints and
writes the report.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import torch


def launch(argv: list[str], nproc: int) -> int:
    """Run ``offload ARGV`` (less its ``--nproc``: the ranks know from their environment) on
    ``nproc`` ranks; the exit code of the job (non-zero if any rank failed)."""
    rest = [a for a in argv if not a.startswith("--nproc=")]
    if "--nproc" in rest:  # torch.distributed.run would take it for its own --nproc-per-node
        del rest[rest.index("--nproc"):rest.index("--nproc") + 2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--module", "offload", *rest]
    return subprocess.run(cmd, check=False).returncode


def rank() -> int:
    """This process's rank (0 when not launched by ``torch.distributed.run``)."""
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def ranks_on_this_machine() -> int:
    """Processes of the job on this machine, each with its own host arena."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def start(device: torch.device) -> torch.device:
    """Join the job's process group; the device of this rank (its own GPU)."""
    import torch.distributed as dist
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def wrap(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` under ``DistributedDataParallel`` (the gradients all-reduced in its hooks),
    its gradients views into DDP's buckets, as the chain counts them: once."""
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(module, gradient_as_bucket_view=True)  # no second copy of the gradients


def own_batch(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """This rank's batch: floats shifted and integers rolled by the rank (rank 0: unchanged)."""
    r = rank()

    def shift(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or r == 0:
            return v
        return v + r if v.is_floating_point() else torch.roll(v, r)
    return tuple(shift(a) for a in args), {k: shift(v) for k, v in kwargs.items()}


def finish(code: int) -> None:
    """Leave the job: wait for every rank, then exit at once (freeing DDP's reducer and the gloo
    group sometimes never ends, after all is done and written)."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)
