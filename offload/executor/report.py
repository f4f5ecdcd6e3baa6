"""A training run's report: what was measured, next to what the simulator predicted.

One record for both front doors: ``Offloaded.measured`` (the user's own loop) fills it from
the steps run in its block, ``offload train`` (``train.train``) from its metered and timed
steps, with the gradient check and the baselines.  ``Report.json()`` is its JSON form
(``offload train --report``): the attribute names are the keys, and ``format`` says which
version of them (``REPORT_FORMAT``).

Every peak is given in both scopes of a budget: ``activation_peak_bytes`` (what the model of
a step counts: the most bytes live during any forward or backward op, over what was live
when the step began) and ``total_peak_bytes`` (plus the chain's ``base_bytes``: weights,
gradients, optimizer state and the batch, there whether or not anything is offloaded).
Bytes moved are per step: what the runtime copied over the steps it ran.
"""
from __future__ import annotations

import statistics
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

from offload.io.text import copies_off, format_bytes
from offload.step.budget import Budget
from offload.step.chain import Chain
from offload.step.encoding import lossy_stages
from offload.step.schedule import Schedule

REPORT_FORMAT = "offload-report/1"
BASELINES = {"no_offload": "no offloading", "save_on_cpu": "save_on_cpu",
             "selective_checkpoint": "SAC (matmuls)"}  # the keys of ``compare``: what each is called (14 wide)


def total(activation_bytes: int | None, chain: Chain) -> int | None:
    """A peak of the activations as a total one: plus the chain's ``base_bytes``."""
    return None if activation_bytes is None else activation_bytes + chain.base_bytes


@dataclass
class Measured:
    """The steps as they ran (``None``: not measured, or no step completed)."""

    step_s: float | None = None  # median of the timed steps (Offloaded.measured: the block's time per step)
    step_times_s: list[float] = field(default_factory=list)  # each timed step (on a GPU the first is a warm-up, left out)
    warmup_s: float | None = None  # GPU: step 1 (kernel selection, allocator growth)
    metered_step_s: list[float] = field(default_factory=list)  # CPU: the metered steps, slowed by exact accounting
    activation_peak_bytes: int | None = None
    total_peak_bytes: int | None = None
    reserved_peak_bytes: int | None = None  # GPU: the most the allocator held, its slack included
    d2h_bytes_per_step: int = 0
    h2d_bytes_per_step: int = 0
    encoded_bytes_per_step: int = 0  # blobs the encoders made
    op_peak_bytes: dict[str, int] | None = None  # step 1, per op, activation bytes (--op-memory)
    leaked_by_step: list[int] = field(default_factory=list)  # bytes still live after each step, over its start
    base_growth_bytes: int = 0  # GPU: held by no tensor, made between steps (the optimizer's state rounded up): base
    host_arena_bytes: int = 0
    host_arena_grown_bytes: int = 0  # of it, taken beyond the plan: a saved storage larger than the chain's
    host_allocations: list[int] = field(default_factory=list)  # arena buffers so far, after each step
    cpu_wait_share: float | None = None  # our steps' threads waited for a CPU this share of their run (contention)

    def set_peak(self, activation_bytes: int | None, chain: Chain, base_growth: int = 0) -> None:
        """The activation peak, and the total one with the chain's ``base_bytes`` and what the
        base grew by between steps (``base_growth_bytes``)."""
        self.activation_peak_bytes, self.base_growth_bytes = activation_bytes, base_growth
        grown = total(activation_bytes, chain)
        self.total_peak_bytes = None if grown is None else grown + base_growth

    def set_times(self, times: list[float]) -> None:
        self.step_times_s = list(times)
        self.step_s = statistics.median(times) if times else None


@dataclass
class Predicted:
    """The simulator's replay of the schedule."""

    step_s: float
    stall_s: float  # the device waiting for copies
    activation_peak_bytes: int
    total_peak_bytes: int
    d2h_bytes_per_step: int
    h2d_bytes_per_step: int
    copy_overlap: float | None  # the share of copy time hidden under compute (None: no copies)
    op_bytes: dict[str, int] | None = None  # per op, activation bytes (--op-memory)
    host_wait_s: float = 0.0  # the device waiting for the host to issue its work (a chain profiled on CUDA)
    # the step without offloading as the chain has it: timed plainly by the profile beside its
    # timed steps (``source.plain_step_s``, ``no_offload_profiled``), else the chain's ideal makespan
    no_offload_step_s: float | None = None
    no_offload_profiled: bool = False
    # how far the profile's plain steps spread about that median, (max - min) / median: how far
    # a pace read against it may be the machine's moods rather than this run's speed
    no_offload_spread: float | None = None
    # what the encoded units' blobs may differ from the profiled ones by, all of them together
    # (``Encoder.spare_bytes``: ``sparse`` follows the data; 0 for every encoder a GPU runs)
    blob_slack_bytes: int = 0


@dataclass
class Baseline:
    """The same steps trained another way (``offload train --compare``)."""

    step_s: float | None  # median
    step_times_s: list[float]
    activation_peak_bytes: int | None
    total_peak_bytes: int | None
    error: str | None = None
    our_step_ratio: float | None = None  # our step time over this one's


@dataclass
class Report:
    chain: str
    chain_sha256: str
    method: str
    backend: str
    device: str
    budget: Budget | None
    base_bytes: int  # the chain's: what total_peak_bytes adds to the activations
    predicted: Predicted
    measured: Measured = field(default_factory=Measured)
    model: str | None = None
    ranks: int = 1
    steps: int = 0  # asked for
    steps_done: int = 0
    encoded_units: dict[str, str] = field(default_factory=dict)  # stage -> encoding
    lossy: bool = False
    grads_match: bool | None = None  # bit for bit against the reference (None: not checked)
    grad_reference: str | None = None  # what the gradients were checked against, in words
    grad_mismatches: list[int] | None = None  # per step, the gradients that differ
    grad_rel_diff: list[float] | None = None  # per step, ||ours - reference|| / ||reference||
    grad_noise_floor: list[float | None] | None = None  # per step they differ: how far the reference is from itself
    grads_within_noise: bool | None = None  # bit for bit, or within the noise floor at every step
    grads_reseeded: bool | None = None  # the noise is the model's: it seeds its generators anew from the OS
    deterministic: bool | None = None  # deterministic kernels were asked for (CUDA, with the gradient check)
    compare: dict[str, Baseline] | None = None  # BASELINES
    compare_our_step_times_s: list[float] | None = None  # ours in the rounds --compare interleaved (empty: not)
    pace: float | None = None  # --compare's no-offload step over the chain's (set_compare)
    trace: dict[str, Any] | None = None  # path, copy_overlap, device_time (offload.executor.traces)
    error: str | None = None  # the step that failed its budget or ran out of memory
    over_prediction: str | None = None  # the measured activation peak above the predicted one: by how much, and why

    @classmethod
    def start(cls, chain: Chain, schedule: Schedule, backend: str, device: Any, op_memory: bool = False) -> "Report":
        """A report of ``schedule`` on ``chain``, its prediction made, nothing measured yet."""
        from offload.core.encoders import ENCODERS  # torch: not loaded by the command line's start (offload show)
        sim = schedule.simulate(chain)
        plain = chain.source.get("plain_step_s")
        predicted = Predicted(step_s=sim.makespan_s, stall_s=sim.stall_s, host_wait_s=sim.host_wait_s,
                              activation_peak_bytes=sim.peak_bytes,
                              total_peak_bytes=total(sim.peak_bytes, chain), d2h_bytes_per_step=sim.d2h_bytes,
                              h2d_bytes_per_step=sim.h2d_bytes, copy_overlap=sim.copy_overlap,
                              op_bytes={o.name: o.mem_bytes for o in sim.ops} if op_memory else None,
                              no_offload_step_s=plain["median"] if plain else chain.ideal_makespan_s,
                              no_offload_profiled=bool(plain),
                              no_offload_spread=(plain["max"] - plain["min"]) / plain["median"]
                              if plain and plain["median"] > 0 else None,
                              blob_slack_bytes=sum(ENCODERS[t.encoder].spare_bytes(t.encoded_bytes)
                                                   for i, name in schedule.encode.items()
                                                   for t in chain.stage(i).encoding(name).tensors))
        return cls(chain=chain.name, chain_sha256=chain.sha256, method=schedule.method, backend=backend,
                   device=str(device), budget=schedule.budget, base_bytes=chain.base_bytes, predicted=predicted,
                   model=chain.recipe.model if chain.recipe else None,
                   encoded_units={str(i): name for i, name in sorted(schedule.encode.items())},
                   lossy=bool(lossy_stages(chain, schedule.encode)))

    def set_compare(self, baselines: dict[str, Baseline], our_step_times_s: list[float]) -> None:
        """``offload train --compare``'s baselines, our step times in its interleaved rounds, and
        this run's ``pace``: the no-offload step as measured over the chain's
        (``Predicted.no_offload_step_s``: the same step as the profile timed it).
        The profile and this run may see the machine at other speeds (a loaded CPU, another
        clock); the pace says by how much, and our step predicted at this pace
        (``pace_predicted_s``) sets the schedule's own error apart from the machine's."""
        self.compare, self.compare_our_step_times_s = baselines, our_step_times_s
        plain = baselines.get("no_offload")
        if plain is not None and plain.step_s and self.predicted.no_offload_step_s:
            self.pace = plain.step_s / self.predicted.no_offload_step_s

    @property
    def pace_predicted_s(self) -> float | None:
        """Our step as predicted, at this run's ``pace``."""
        return None if self.pace is None else self.pace * self.predicted.step_s

    @property
    def compared_step_s(self) -> float | None:
        """Our step as measured beside the baselines: the median of the interleaved rounds, else
        of our timed steps."""
        rounds = self.compare_our_step_times_s
        return statistics.median(rounds) if rounds else self.measured.step_s

    def judge_peak(self, freed_grads: int = 0, rebuilt_buckets: int = 0, warn: bool = True) -> None:
        """Say so (``over_prediction``, and with ``warn`` a warning) when the measured activation
        peak is above the predicted one, with the cause when it is known: ``freed_grads``
        forwards found the gradients freed (``optimizer.zero_grad()``'s default, or no backward
        yet) while the chain counts them as allocated, in ``base_bytes``: the backward then
        allocates them on top; ``rebuilt_buckets`` ``DistributedDataParallel`` laid their
        gradient buckets out anew in a measured step (``distributed.buckets_rebuilt``); or the
        excess is within what the encoded units' blobs may vary;
        or a saved storage grew past its profiled size after the first step (``arena_grew``)."""
        measured, predicted = self.measured.activation_peak_bytes, self.predicted.activation_peak_bytes
        if measured is None or measured <= predicted:
            return
        if freed_grads:
            why = (f"; {freed_grads} forward(s) found the gradients freed, which the chain counts as allocated "
                   "(profiled without --set-to-none): the backward allocated them on top of the activations. Call "
                   "optimizer.zero_grad(set_to_none=False) and run one step before measuring, or profile with "
                   "--set-to-none")
        elif rebuilt_buckets:
            why = ("; DistributedDataParallel laid its gradient buckets out anew in a measured step (it does in its "
                   "second step's forward, holding the gradients' bytes twice): run two steps before measuring")
        else:
            blobs = self.within_blob_slack(measured - predicted) or self.arena_grew()
            why = f"; {blobs}" if blobs else ""
        self.over_prediction = (f"the activation peak measured {format_bytes(measured)} is "
                                f"{format_bytes(measured - predicted)} above the predicted {format_bytes(predicted)}"
                                + why)
        if warn:
            warnings.warn(self.over_prediction, stacklevel=4)  # at the with statement of measured()

    def arena_grew(self) -> str:
        """Where the host arena took more than the schedule planned, the sentence that says so
        and why: a storage saved larger than the chain's (a sparse blob with fewer zeros than
        profiled, or a storage whose size follows the data or the routing, as a mixture of
        experts' inputs to each expert do, which move with the weights); else ''."""
        grown = self.measured.host_arena_grown_bytes
        if not grown:
            return ""
        return (f"the host arena took {format_bytes(grown)} beyond the plan: a saved storage was larger than profiled "
                "(a sparse blob with fewer zeros, or a storage whose size follows the data or the routing, as a "
                "mixture of experts' expert inputs do: docs/executor.md), so memory and copies differ from the "
                "chain's")

    def within_blob_slack(self, over: int) -> str:
        """Where ``over`` bytes above a prediction are what the encoded units' blobs may vary
        (``Predicted.blob_slack_bytes``), the sentence that says so; else ''."""
        slack = self.predicted.blob_slack_bytes
        if not slack or over > slack:
            return ""
        return (f"within the {format_bytes(slack)} the encoded units' blobs may differ from the profiled ones "
                "(sparse: its size follows the data, docs/encodings.md)")

    def copies_off(self) -> str:
        """Where the steps' copies moved other bytes per step than the schedule books, beyond
        what the encoded units' blobs may vary, the sentence that says so (``io.text.copies_off``);
        else ''."""
        m, p = self.measured, self.predicted
        return copies_off([("D2H a step", m.d2h_bytes_per_step, p.d2h_bytes_per_step),
                           ("H2D a step", m.h2d_bytes_per_step, p.h2d_bytes_per_step)], p.blob_slack_bytes)

    def in_scope(self, peaks: Measured | Predicted | Baseline) -> int | None:
        """``peaks``'s peak in the budget's scope (activations when there is no budget)."""
        return peaks.total_peak_bytes if self.budget is not None and self.budget.total else peaks.activation_peak_bytes

    def json(self) -> dict[str, Any]:
        """The JSON form, keys as the attributes, versioned."""
        return {"format": REPORT_FORMAT, **asdict(self)}
