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

import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Any

import torch

from offload.errors import ModelError


def most_ranks(device: str | None) -> tuple[int, str]:
    """How many ranks this machine can run of a job on ``device`` (``None``: CUDA when available),
    and what bounds it: a GPU per rank, or a CPU core per rank."""
    if (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"):
        return torch.cuda.device_count(), "GPUs (a rank per GPU)"
    return os.cpu_count() or 1, "CPU cores (a rank per core)"


STOP_GRACE_S = 10.0  # after a SIGTERM passed on, how long the ranks get before a SIGKILL
PR_SET_PDEATHSIG = 1


def launch(argv: list[str], nproc: int) -> int:
    """Run ``offload ARGV`` (less its ``--nproc``: the ranks know from their environment) on
    ``nproc`` ranks; the exit code of the first rank that failed (0 if none: ``run_job``).

    The job runs in a session of its own: a SIGTERM or SIGINT to this process (Ctrl-C) is
    passed to all of it (``torch.distributed.run`` then stops its ranks), escalated to SIGKILL
    after ``STOP_GRACE_S``; and the job gets a SIGTERM if this process dies."""
    rest = [a for a in argv if not a.startswith("--nproc=")]
    if "--nproc" in rest:  # torch.distributed.run would take it for its own --nproc-per-node
        del rest[rest.index("--nproc"):rest.index("--nproc") + 2]
    cmd = [sys.executable, "-c", "import sys; from offload.executor.distributed import run_job; sys.exit(run_job(sys.argv[1:]))",
           "--standalone", f"--nproc_per_node={nproc}", "--module", "offload", *rest]
    job = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_end_with_parent)
    stopped: list[tuple[int, float]] = []  # the signal received, and when

    def stop(signum: int, _frame: Any) -> None:
        if not stopped:
            stopped.append((signum, time.monotonic()))
            _signal_job(job, signal.SIGTERM)
    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while job.poll() is None:
            if stopped and time.monotonic() - stopped[0][1] > STOP_GRACE_S:
                _signal_job(job, signal.SIGKILL)
            time.sleep(0.1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopped:
        print(f"offload train: {signal.Signals(stopped[0][0]).name}: the job and its ranks were stopped", file=sys.stderr)
        return 128 + stopped[0][0]
    return job.returncode


def run_job(argv: list[str]) -> int:
    """``torch.distributed.run ARGV``, its exit code the first failed rank's: a rank says what
    went wrong itself (one clear message), and the launcher's own traceback and summary of the
    failure, printed after it, said nothing more (a rank over its budget exits 6, the job 1)."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its "failed (exitcode: 6)" line
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        codes = [failure.exitcode for _, failure in sorted(exc.failures.items())]
        return next((code for code in codes if code > 0), 1)
    return 0


def _signal_job(job: subprocess.Popen, signum: int) -> None:
    """``signum`` to every process of the job's session (the launcher and its ranks)."""
    try:
        os.killpg(job.pid, signum)
    except ProcessLookupError:  # all gone already
        pass


def _end_with_parent() -> None:
    """In the job's first process: a SIGTERM when the process that started it dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: Ctrl-C and SIGTERM are still passed on
        pass


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


def check_trainable(module: torch.nn.Module) -> None:
    """Refuse a model DDP cannot wrap: one without a weight that requires a gradient."""
    if not any(p.requires_grad for p in module.parameters()):
        raise ModelError("the model has no weight that requires a gradient: data-parallel ranks would have nothing "
                         "to all-reduce", "train it on one rank (no --nproc)")


def wrap(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` under ``DistributedDataParallel`` (the gradients all-reduced in its hooks),
    its gradients views into DDP's buckets, as the chain counts them: once."""
    from torch.nn.parallel import DistributedDataParallel
    check_trainable(module)
    return DistributedDataParallel(module, gradient_as_bucket_view=True)  # no second copy of the gradients


def warm_up_steps(ranks: int) -> int:
    """Steps not measured before ``offload train``'s measured ones: one, and under DDP (more
    than one rank) two, as DDP lays its gradient buckets out anew in its second step's
    forward (``buckets_rebuilt``)."""
    return 2 if ranks > 1 else 1


def buckets_rebuilt(module: torch.nn.Module) -> int:
    """How many ``DistributedDataParallel`` in ``module`` have rebuilt their gradient buckets.
    DDP lays them out again, in the order its first backward made the gradients, in its
    second step's forward, allocating them anew while the old ones live: that step's first op
    holds the gradients' bytes twice (timm's RepVGG-A0 on two ranks: 28 MiB over its first
    op's prediction, 29.91 MiB measured against 8.89 MiB), so a measured step comes after it."""
    from torch.nn.parallel import DistributedDataParallel
    return sum(bool(getattr(m, "_has_rebuilt_buckets", False)) for m in module.modules()
               if isinstance(m, DistributedDataParallel))


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
