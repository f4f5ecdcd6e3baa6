"""What the executor's own steps cost beyond the profiled ops, timed in training steps of the model.

A chain's stage times are profiled with the saved-tensor hooks the executor runs on every
tensor it keeps (the unit tracker, the weight casts' handling).  Two costs of a schedule
are the executor's own, and are timed here on its own code, call by call, in training steps
of the profiled model under schedules that keep everything, move the floor's units and
re-run every block, one step of each per round, the order rotated round by round (a slow
moment of the machine falls on all three alike):

* **per saved tensor it handles** (``handled_seconds``): a tensor of a unit the executor
  moves, encodes or rebuilds costs more than a kept one: at pack a handle and the storage
  taken in hand with its version checks, at unpack those checks again and a view of the
  bytes held.  On the development CPU that was 17.2 us to pack and 5.4 us to unpack an
  offloaded unit's tensor, 11.7 and 6.1 us a re-run one's, against 5.7 and 1.1 us kept
  (``experiments.bench_overhead --hooks``).  Half the extra, each way, is the platform's
  ``handle_host_s`` on CUDA (the host's clock: on a GPU whose host issues a re-run's kernels
  slower than the device runs them, that time is the step's) and ``handle_device_s`` on a
  CPU, whose host runs the ops (they take that much longer); the simulator and the MILP
  charge it for every saved tensor (``Stage.saves``) of a unit handled.
* **each stage's rebuild** (``rebuild_seconds``): the executor's re-run of a stage before its
  backward, timed whole in the steps that re-run every block.  On a CPU, whose host is the
  device, this is the chain's ``rerun_s``: the profiler's timed replay runs a stage's
  program again at once, its weights and input still in the caches, where a step's rebuild
  follows the backward of the later stages and matches each save to the forward's; on the
  development CPU the rebuild took 1.2-1.3x the replay (a 4-layer GPT of width 64, a 4-layer
  transformers Qwen3), and the model under-predicted per-block checkpointing by as much.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Iterator

from offload.models.spec import ModelSpec
from offload.step.actions import Recompute
from offload.step.chain import Chain
from offload.step.memory import floor_offloads
from offload.step.schedule import Schedule, make_schedule

from .api import Offloaded
from .runtime import _Handle, _Step

KINDS = ("pack kept", "pack handled", "unpack kept", "unpack handled")
KEPT, MOVED, RERUN = "nothing moved", "floor offloaded", "every block re-run"  # the plans timed


@dataclass
class StepCosts:
    """The executor's own work, timed in steps under each of ``schedules``' plans (by name)."""

    calls: dict[str, dict[str, list[float]]]  # plan -> the hooks' calls, by ``KINDS``
    forwards: dict[str, dict[int, list[float]]]  # plan -> stage k < L -> its forward's seconds, per step
    backwards: dict[str, dict[int, list[float]]]  # plan -> stage -> its backward's own seconds (its rebuild not in them)
    rebuilds: dict[int, list[float]] = field(default_factory=dict)  # stage -> its rebuilds, re-run alone and whole

    def handled_seconds(self) -> float:
        """Per handled saved tensor, each way, beyond a kept one: half of what a handled tensor's
        pack and unpack take over a kept one's (medians of the calls; kept ones timed with
        nothing moved, handled ones with the floor's units moved and every block re-run).  0
        where no unit can be handled."""
        kept = self.calls[KEPT]
        handled = {k: [t for name, c in self.calls.items() if name != KEPT for t in c[k]] for k in KINDS}
        if not (handled["pack handled"] and handled["unpack handled"] and kept["pack kept"] and kept["unpack kept"]):
            return 0.0
        extra = (statistics.median(handled["pack handled"]) - statistics.median(kept["pack kept"])
                 + statistics.median(handled["unpack handled"]) - statistics.median(kept["unpack kept"]))
        return max(0.0, extra / 2)

    def pace(self, chain: Chain) -> float:
        """The chain's stage times over the same ops' in these steps with nothing moved (medians):
        what turns a time measured here into one at the profile's pace."""
        here = sum(statistics.median(t) for plan in (self.forwards, self.backwards) for t in plan[KEPT].values())
        there = sum(float(chain.f[k]) for k in self.forwards[KEPT]) + sum(float(chain.b[k]) for k in self.backwards[KEPT])
        return there / here if here > 0 else 1.0

    def recorded(self, chain: Chain) -> dict[int, tuple[float, float, float]]:
        """Per stage re-run alone in these steps, its ``recorded_fwd_s``, ``rerun_s`` and
        ``recorded_bwd_s`` where the host runs the ops (a CPU), at the profile's pace: its
        forward and backward, each its plain one's time in the chain plus what it took here
        over the plain one with nothing moved (medians, the same rounds), less its saved
        tensors' handling (charged apart, ``handled_seconds``); its rebuild's median."""
        pace, handled = self.pace(chain), self.handled_seconds()
        out = {}
        for k, rebuilds in self.rebuilds.items():
            more = [pace * (statistics.median(plan[RERUN][k]) - statistics.median(plan[KEPT][k]))
                    - pace * handled * float(chain.hh[k]) for plan in (self.forwards, self.backwards)]
            out[k] = (float(chain.f[k]) + max(0.0, more[0]), pace * statistics.median(rebuilds),
                      float(chain.b[k]) + max(0.0, more[1]))
        return out


@contextlib.contextmanager
def timing(costs: StepCosts, plan: str) -> Iterator[None]:
    """In this block, one step under ``plan`` is timed into ``costs``: each call of the runtime's
    pack and unpack hooks (``KINDS``), each rebuild of a run of one stage re-run whole, and the
    span of each stage's forward (from one boundary to the next: what the runtime does there
    for the next stage, its recording, is that stage's) and backward (after the events before
    it: a rebuild is timed apart); the last backward ends as the block does."""
    calls, rebuilds, forwards, backwards = costs.calls[plan], costs.rebuilds, costs.forwards[plan], costs.backwards[plan]
    pack, unpack, rebuild = _Step.pack, _Step.unpack, _Step._rebuild
    start, output, backward = _Step.forward_start, _Step.stage_output, _Step.backward_boundary
    began = [0.0]  # when the current stage's forward began
    ends: dict[int, float] = {}  # stage -> when its backward's own ops began

    def timed_pack(step, t):
        t0 = time.perf_counter()
        out = pack(step, t)
        calls["pack handled" if isinstance(out, _Handle) else "pack kept"].append(time.perf_counter() - t0)
        return out

    def timed_unpack(packed):
        t0 = time.perf_counter()
        out = unpack(packed)
        calls["unpack handled" if isinstance(packed, _Handle) else "unpack kept"].append(time.perf_counter() - t0)
        return out

    def timed_rebuild(step, run: Recompute) -> None:
        t0 = time.perf_counter()
        rebuild(step, run)
        if run.first == run.last and not run.option:
            rebuilds.setdefault(run.first, []).append(time.perf_counter() - t0)

    def timed_start(step) -> None:
        began[0] = time.perf_counter()
        start(step)

    def timed_output(step, k: int, x, opening: bool) -> None:
        t = time.perf_counter()
        forwards.setdefault(k, []).append(t - began[0])
        began[0] = t
        output(step, k, x, opening)

    def timed_backward(step, k: int) -> None:
        t = time.perf_counter()
        if k + 1 in ends:  # stage k + 1's backward has ended
            backwards.setdefault(k + 1, []).append(t - ends.pop(k + 1))
        backward(step, k)
        ends[k] = time.perf_counter()
    _Step.pack, _Step.unpack, _Step._rebuild = timed_pack, staticmethod(timed_unpack), timed_rebuild
    _Step.forward_start, _Step.stage_output, _Step.backward_boundary = timed_start, timed_output, timed_backward
    try:
        yield
        if 1 in ends:
            backwards.setdefault(1, []).append(time.perf_counter() - ends.pop(1))
    finally:
        _Step.pack, _Step.unpack, _Step._rebuild = pack, staticmethod(unpack), rebuild
        _Step.forward_start, _Step.stage_output, _Step.backward_boundary = start, output, backward


def schedules(chain: Chain) -> dict[str, Schedule]:
    """What the executor is timed under: everything kept, the floor's units moved, every block re-run."""
    return {KEPT: make_schedule(chain, []), MOVED: make_schedule(chain, floor_offloads(chain)),
            RERUN: make_schedule(chain, [], [Recompute(i, i) for i in sorted(chain.recomputable)])}


def step_costs(spec: ModelSpec, chain: Chain, steps: int = 2) -> StepCosts:
    """The executor's own work in ``steps`` training steps of ``spec`` under each of
    ``schedules(chain)``, one step of each per round, the order rotated each round, after an
    untimed round; no optimizer step, the gradients dropped.

    Args:
        spec: the profiled model on its device, its batch and loss.
        chain: its chain (the schedules' units and stages).
        steps: timed steps under each schedule.
    """
    runs = {name: Offloaded(spec.module, chain, schedule) for name, schedule in schedules(chain).items()}
    out = StepCosts({name: {k: [] for k in KINDS} for name in runs}, {name: {} for name in runs},
                    {name: {} for name in runs})
    params = list(spec.module.parameters())
    names = list(runs)
    for r in range(steps + 1):
        for name in names[r % len(names):] + names[:r % len(names)]:
            args, kwargs = spec.batch()
            with timing(out, name) if r else contextlib.nullcontext():
                with spec.autocasting():
                    loss = spec.loss(runs[name](*args, **kwargs))
                loss.backward()
            del loss
            spec.zero_grads(params)
    return out
