"""The executor's host time per saved tensor it handles (``Platform.handle_host_s``), measured.

A chain's stage times are profiled with the saved-tensor hooks the executor runs on every
tensor it keeps (the unit tracker, the weight casts' handling).  A tensor of a unit the
executor moves, encodes or rebuilds costs the host more: at pack a handle and the storage
taken in hand with its version checks, at unpack those checks again and a view of the bytes
held.  On the development CPU that was 17.2 us to pack and 5.4 us to unpack an offloaded
unit's tensor, 11.7 and 6.1 us a re-run one's, against 5.7 and 1.1 us kept
(``experiments.bench_overhead --hooks``).  On a GPU whose host issues a re-run's kernels
slower than the device runs them, that time is the step's.  This times the runtime's own
hooks, call by call, in training steps of the profiled model under schedules that keep
everything, move the floor's units and re-run every block, and returns the extra time per
handled tensor, each way; the profiler writes it in the chain's platform on CUDA, and the
simulator and the MILP charge it for every saved tensor (``Stage.saves``) of a unit handled.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Iterator

from offload.models.spec import ModelSpec
from offload.step.actions import Recompute
from offload.step.chain import Chain
from offload.step.memory import floor_offloads
from offload.step.schedule import Schedule, make_schedule

from .api import Offloaded
from .runtime import _Handle, _Step

KINDS = ("pack kept", "pack handled", "unpack kept", "unpack handled")


@contextlib.contextmanager
def timing_hooks(calls: dict[str, list[float]]) -> Iterator[None]:
    """In this block, every call of the runtime's pack and unpack hooks is timed into ``calls``
    under one of ``KINDS`` (handled: the pack returned the runtime's handle)."""
    pack, unpack = _Step.pack, _Step.unpack

    def timed_pack(self, t):
        t0 = time.perf_counter()
        out = pack(self, t)
        calls["pack handled" if isinstance(out, _Handle) else "pack kept"].append(time.perf_counter() - t0)
        return out

    def timed_unpack(packed):
        t0 = time.perf_counter()
        out = unpack(packed)
        calls["unpack handled" if isinstance(packed, _Handle) else "unpack kept"].append(time.perf_counter() - t0)
        return out
    _Step.pack, _Step.unpack = timed_pack, staticmethod(timed_unpack)
    try:
        yield
    finally:
        _Step.pack, _Step.unpack = pack, staticmethod(unpack)


def schedules(chain: Chain) -> dict[str, Schedule]:
    """What the hooks are timed under: everything kept, the floor's units moved, every block re-run."""
    return {"nothing moved": make_schedule(chain, []), "floor offloaded": make_schedule(chain, floor_offloads(chain)),
            "every block re-run": make_schedule(chain, [], [Recompute(i, i) for i in sorted(chain.recomputable)])}


def hook_calls(spec: ModelSpec, chain: Chain, schedule: Schedule, steps: int) -> dict[str, list[float]]:
    """The hooks' calls in ``steps`` training steps of ``spec`` under ``schedule``, timed
    (``KINDS``), after one untimed step; no optimizer step, the gradients dropped."""
    run = Offloaded(spec.module, chain, schedule)
    calls: dict[str, list[float]] = {k: [] for k in KINDS}
    params = list(spec.module.parameters())
    for step in range(steps + 1):
        args, kwargs = spec.batch()
        with timing_hooks(calls) if step else contextlib.nullcontext():
            with spec.autocasting():
                loss = spec.loss(run(*args, **kwargs))
            loss.backward()
        del loss
        spec.zero_grads(params)
    return calls


def handle_host_seconds(spec: ModelSpec, chain: Chain, steps: int = 2) -> float:
    """The host's seconds per handled saved tensor, each way, beyond a kept one's: half of what
    a handled tensor's pack and unpack take over a kept one's (medians of the calls; kept ones
    timed with nothing moved, handled ones with the floor's units moved and every block
    re-run).  0 where no unit can be handled.

    Args:
        spec: the profiled model on its device, its batch and loss.
        chain: its chain (the schedules' units and stages).
        steps: timed steps under each schedule.
    """
    return extra_per_tensor({name: hook_calls(spec, chain, schedule, steps)
                             for name, schedule in schedules(chain).items()})


def extra_per_tensor(calls: dict[str, dict[str, list[float]]]) -> float:
    """``handle_host_seconds`` from the hooks' calls timed under each of ``schedules``' plans (by
    name): kept tensors' with nothing moved, handled ones' under the other plans."""
    kept = calls["nothing moved"]
    handled = {k: [t for name, c in calls.items() if name != "nothing moved" for t in c[k]] for k in KINDS}
    if not (handled["pack handled"] and handled["unpack handled"] and kept["pack kept"] and kept["unpack kept"]):
        return 0.0
    extra = (statistics.median(handled["pack handled"]) - statistics.median(kept["pack kept"])
             + statistics.median(handled["unpack handled"]) - statistics.median(kept["unpack kept"]))
    return max(0.0, extra / 2)

