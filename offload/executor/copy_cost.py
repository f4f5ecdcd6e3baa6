"""The executor's host time per storage it copies (``Platform.copy_host_s``), measured.

On a GPU the host issues the step's kernels, and a step whose host falls behind its device
waits for it (docs/model.md, "The host").  A chain's stage times carry the host's time to
issue the model's ops, their saved-tensor hooks included; what the executor adds for each
storage it moves is not in them: the storage taken in hand, its host slot, the copy issued
with its events and stream switch, the wait before the release; then a buffer, the copy
back, the wait before the backward reads it.  On an H200 that was 75-146 us a storage
before the copies of a unit were issued as one batch (experiments/results/executor-cuda/
h200/third).  This runs those very steps of the runtime (``_Step``'s ``_offload``,
``_release``, ``_prefetch`` and ``_wait``) on units of small storages, timing the host
alone (the device runs the copies behind it), and returns the time per storage and
direction.  The profiler writes it in the chain's platform on CUDA; the simulator and the
MILP charge it for every storage a copy moves.
"""
from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch

from offload.core.places import bytes_of

from .arena import HostArena
from .backends import CpuEagerBackend, CudaBackend, make_backend
from .runtime import _Step, _Stored


def copy_host_seconds(device: torch.device, units: int = 8, storages: int = 16, nbytes: int = 64 * 2**10,
                      repeats: int = 5, backend: CpuEagerBackend | CudaBackend | None = None) -> float:
    """The host's seconds per storage and direction that the runtime spends moving ``units``
    units of ``storages`` storages of ``nbytes`` each out and back (the median of ``repeats``
    rounds after one warm-up; on the CPU its eager backend, whose copies run as they are
    issued).

    Args:
        device: where the storages live (``cuda``: the executor's streams and pinned arena).
        units: units per round, each one batch of copies each way, as the runtime issues them.
        storages: storages per unit (a transformer block saves about 10, a ResNet block 15-20).
        nbytes: each storage's size: small, so that the copies take the device less time than
            the host takes to issue them, and the host's time is all that is timed.
        repeats: timed rounds.
        backend: the copy backend (default: the device's, as ``Offloaded`` picks it).

    Returns:
        Seconds of host time per storage copied one way.
    """
    backend = backend or make_backend(None, device)
    arena = HostArena(units * storages * nbytes, backend.pin)
    tensors = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(units * storages)]

    def round_() -> float:
        arena.start_step()
        step = SimpleNamespace(runtime=SimpleNamespace(arena=arena, d2h_bytes=0, h2d_bytes=0), backend=backend,
                               stored=[], evicted={})
        sids = [list(range(u * storages, (u + 1) * storages)) for u in range(units)]
        start = time.perf_counter()
        for u, ids in enumerate(sids):  # the forward: each unit taken in hand as it is saved, then copied out
            step.stored += [_Stored(u, bytes_of(tensors[sid]), nbytes) for sid in ids]
            _Step._offload(step, ids)
        for ids in sids:  # released, then fetched back and waited for by the backward
            _Step._release(step, ids)
        for ids in reversed(sids):
            _Step._prefetch(step, ids)
            _Step._wait(step, ids)
        host = time.perf_counter() - start
        backend.synchronize()
        return host / (2 * units * storages)

    round_()
    return statistics.median(round_() for _ in range(repeats))
