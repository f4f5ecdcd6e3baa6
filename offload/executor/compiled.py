"""The schedule inside ``torch.compile``: the model compiled whole, our recomputation in its graph.

``Offloaded(torch.compile(m))`` runs a schedule on a compiled model by breaking its graph at
every stage boundary (the hooks and the runtime are ``torch.compiler.disable``d), so that
Inductor compiles one block at a time.  ``compile_scheduled`` compiles the user's module as
one graph instead and hands AOTAutograd a partitioner built from (chain, schedule):

* **stages**: each forward node of the joint graph carries the module calls it ran in
  (``nn_module_stack``); the chain's cut sites are module calls, so stage ``k`` ends with the
  last forward node inside the call of ``cuts[k-1]`` (the last one before it, where the cut
  is at the call's start) and every node up to there that is in no later stage is in stage
  ``k`` (``assign_stages``);
* **recomputation**: the forward nodes of each recomputed run's stages are tagged
  ``MUST_RECOMPUTE`` (those its in-stage option keeps ``MUST_SAVE``, by the ``KeepRule`` the
  eager executor uses, those that draw random numbers, those that read an input with
  no gradient, such as a batch norm's running statistics, which the step updates after
  the forward, and those a later stage outside the run reads, as that stage saves them in
  eager mode, where the partitioner would run the run again in that stage's backward:
  their outputs are saved, and a multi-output op with them, such as the layer norm that
  ends a BERT layer), each
  run its own ``ac_graph_id`` in order; the other stages' nodes are left to PyTorch's
  min-cut partitioner as in a plain compile (tagged ``MUST_SAVE`` they made a Llama's step
  hold 14% more than plain compile's), but for the values a recomputed run reads of them
  (its input, the checkpoint), ``MUST_SAVE``: made again in the backward from what the kept
  stage saves, they made that stage save more than with the run kept.  The partitioner
  then builds the forward and the backward graphs, as it does for ``torch.utils.checkpoint``
  under compile, and the backward graph runs a recomputed stage's forward ops again;

* **offloads, at the schedule's events** (``copies="schedule"``, the default): after the
  partitioner, ``offload.executor.compiled_copies`` puts our own copy ops
  (``offload.executor.graph_copies``) into the forward and backward graphs where
  ``offload.step.events`` says ``Offloaded`` does them: D2H as ``Fk`` ends, the wait and the
  free at the release point, H2D at the prefetch point, the wait before ``B(need)``; run by
  the same backends (CUDA streams and events, or the checking CPU ones) and the same pinned
  host arena.  A unit is what the eager executor calls one: the storages first saved for
  ``Bk``'s ops.  Each op takes inputs it does not read, so that Inductor's scheduler does
  not run it earlier: the last value of the stage it follows, and in the backward every
  value the graph before it hands on (``compiled_copies.handed_on``), so that no work of
  the stage before is fused into a kernel after it; and the
  forward makes each moved value where the graph does, in the graph's layout (Inductor
  would otherwise leave a value that only our copy reads to be made again inside a later
  kernel, from inputs it then holds: a dropout's random numbers);

* **offloads, placed by PyTorch** (``copies="pytorch"``, the baseline): the units' forward
  nodes are marked ``should_offload`` and PyTorch's own activation offloading
  (``torch._functorch._activation_offloading``) inserts the copies: on CUDA on a side
  stream, the waits sunk to the forward's end, the reloads hoisted by their estimated
  transfer time at the chain's measured H2D bandwidth.  Our schedule chooses *what* moves;
  *when* is PyTorch's rule.  PyTorch skips what it cannot move (views, ``getitem`` values,
  non-contiguous tensors, model outputs).  ``copies="pytorch-matmuls"`` marks every matmul,
  convolution and attention output instead, whatever the schedule (which then offloads
  nothing): the second baseline, what users of PyTorch's pass mark by hand;

In both, a unit of which nothing moves is refused, naming it; one that moves in part is
warned of, with what stays (``SchedulePartitioner.moved``).

A recomputed run that offloads its checkpoint (ours only) moves the storages that only the
run reads in the backward (its input, what its option or its random ops keep) at its own
events; what other stages read too stays, as the eager executor's held tensors do, and so
do the weights it reads (the module holds them).

The chain says where stages end.  A chain of the eager model predicts the eager step, not
this one (the compiled forward saves other, fewer tensors, and the graph's kernels hold
other transients): its budget is no promise here, and a warning says so.  The weight
gradients are accumulated into ``.grad`` inside the backward graph, each where it is made
(``graph_grads``), as the eager engine does after each op, not handed back at the graph's
end.  A chain profiled from this graph (``offload.profiler.compiled``, ``recipe.whole_graph``)
is: its units are what our copies move (checked as the graph is partitioned), its memory and
times this graph's, and the run has the profile's marks at its stage boundaries (reading
nothing: they keep Inductor's kernels on the sides of the boundaries the profile measured).
Its recomputed stages' costs were read from compiles of this graph that recompute them
(``offload.profiler.compiled``); each run's checkpoint is handed to the backward where the
run begins, as a unit's is where its stage's backward begins (``compiled_copies.place_ready``),
and on such a chain an offloaded unit may move less than the chain counts (it counts a
unit's largest over its neighbours' choices), never more.  Not here:
encodings (refused).
"""
from __future__ import annotations

import hashlib
import operator
import re
import uuid
import warnings
from typing import Any, Sequence

import torch
from torch import fx, nn
from torch._functorch import config
from torch._functorch._activation_offloading.activation_offloading import CPU_OFFLOAD_PREFIX
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointPolicy

from offload.core.devices import allocated_bytes
from offload.core.selective import KeepRule, keeps
from offload.core.staging import Site, is_staged
from offload.errors import ChainMismatch
from offload.io.text import format_bytes
from offload.step.chain import Chain
from offload.step.events import step_events
from offload.step.schedule import Schedule

from .api import PathLike, chain_and_schedule, cut_sites
from .compiled_copies import (PlacedCopies, UnitStorage, backward_stages, checkpoint_storages, counted_storages,
                              keep_crossing, movable, place_copies, place_marks, place_ready, shared_saves,
                              storage_bytes, unit_needs, value_units)
from .graph_copies import ALL_OPS, GraphCopies
from .graph_grads import GRAD_OPS, GraphGrads, add_accumulation

_PROCESS = uuid.uuid4().hex  # in every partitioner's key: no compiled graph of another process is reused
COPIES = ("schedule", "pytorch", "pytorch-matmuls")  # who places which copies (SchedulePartitioner)

_ROOT = re.compile(r"^L\[(['\"])[^'\"]+\1\]")  # the compiled function's ``self``: L['self']


def module_path(dynamo_path: str) -> str:
    """A module path as ``named_modules`` writes it, from ``nn_module_stack``'s
    (``L['self'].layers[0].mlp``, ``L['self']._modules['layers']._modules['0']`` -> ``layers.0.mlp``)."""
    path = _ROOT.sub("", dynamo_path)
    path = re.sub(r"\._modules\[(['\"])([^'\"]+)\1\]", r".\2", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.lstrip(".")




def forward_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The joint graph's forward ops, in order."""
    return [n for n in graph.nodes if n.op == "call_function" and n.meta.get("partitioner_tag") != "is_backward"]


def assign_stages(graph: fx.Graph, cuts: Sequence[Site]) -> dict[fx.Node, int]:
    """Stage (1..L) of each forward node of a joint graph: stage ``k`` ends with the last node
    inside the call of ``cuts[k-1]`` (the last node before it, where the cut is at the call's
    start: ``Site.before``).  Empty for a graph that runs none of the cut sites (a
    graph break has put it outside the model's stages, e.g. a loss after the model);
    ``ChainMismatch`` when it runs some of them only (a graph break between two cut sites)
    or out of order."""
    if not any(n.meta.get("partitioner_tag") == "is_backward" for n in graph.nodes):
        raise ChainMismatch(f"this torch ({torch.__version__}) does not mark the joint graph's backward nodes",
                            "use a torch that does (2.13 does), or Offloaded(torch.compile(model), ...)")
    nodes = forward_nodes(graph)
    paths = [{module_path(path) for path, _ in (n.meta.get("nn_module_stack") or {}).values()} for n in nodes]
    ends, missing = [], []
    for site in cuts:
        if site.occurrence:
            raise ChainMismatch(f"the chain cuts at call {site.occurrence + 1} of {site.module!r}: a compiled graph "
                                "tells a module's calls apart by their nodes alone, which is not done yet",
                                "train it with Offloaded(torch.compile(model), ...) (a graph break at each boundary)")
        inside = [i for i, held in enumerate(paths) if any(p == site.module or p.startswith(site.module + ".")
                                                           for p in held)]
        if inside:
            ends.append(inside[0] - 1 if site.before else inside[-1])
        else:
            missing.append(site.module)
    if missing and ends:
        raise ChainMismatch(f"a compiled graph runs some of the chain's cut sites but not {missing[0]!r}: a graph break "
                            "falls between two stage boundaries, or that call computes nothing the compiler keeps",
                            "remove the break (compile with fullgraph=True to see where it is), or train with "
                            "Offloaded(torch.compile(model), ...)")
    if missing:
        return {}
    if ends != sorted(ends):
        raise ChainMismatch("the compiled graph runs the chain's cut sites in another order than the chain's stages",
                            "profile the model again")
    stages, k = {}, 0
    for i, node in enumerate(nodes):
        stages[node] = k + 1
        while k < len(ends) and i >= ends[k]:
            k += 1
    return stages


def _random(node: fx.Node) -> bool:
    """An op that draws random numbers: its output is saved, never drawn again (the
    partitioner would replay the generator's state around it, which Inductor cannot lower
    on every device), so a re-run reads the forward's numbers, as the eager executor's
    replay under the recorded random state does."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _read_after(node: fx.Node, stages: dict[fx.Node, int], last: int) -> bool:
    """Whether a stage after ``last`` reads ``node``'s value, or one of its values (a layer
    norm's output, its first): then it is saved, not made again in that stage's backward."""
    return any(stages.get(u, 0) > last or (u.target is operator.getitem and any(stages.get(w, 0) > last
                                                                              for w in u.users))
               for u in node.users)


def _inputs_without_gradient(graph: fx.Graph, forward_outputs: int) -> set[fx.Node]:
    """The joint graph's primal inputs that get no gradient (buffers, the batch): a node that
    reads one is not recomputed, because the step may change it after the forward (a batch
    norm's running statistics) and its saved version would no longer match."""
    primals = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]
    grads = list(graph.find_nodes(op="output")[0].args[0])[forward_outputs:]
    return {p for p, g in zip(primals, grads) if g is None}


def _offloading_settings(on: bool, cuda: bool, bandwidth: float) -> dict[str, Any]:
    """PyTorch's activation offloading pass switched on (``on``) or off for one partition, on
    a side stream with deferred waits and prefetched reloads where the graph runs on CUDA.
    Only the settings this torch has: 2.11 has the pass but not its bandwidth setting
    (``activation_offload_cpu_gpu_bw``, 2.13), and a patch of a setting it lacks fails the
    whole compile (seen on an H200 with torch 2.11)."""
    wanted = {"enable_activation_offloading": on, "activation_offload_separate_stream": cuda,
              "activation_offload_sink_wait": cuda, "activation_reload_prefetch": cuda,
              "activation_offload_cpu_gpu_bw": bandwidth / 1e9}
    return {k: v for k, v in wanted.items() if hasattr(config, k)}


class SchedulePartitioner(CustomPartitionerFn):
    """AOTAutograd's partitioner for one (chain, schedule): the recompute tags (module
    docstring), then ``min_cut_rematerialization_partition``, then the copies (ours, placed
    by ``offload.executor.compiled_copies``, or PyTorch's pass's).  ``stages`` and ``tags``
    hold what it decided for the last graph it partitioned (node name -> stage, -> policy),
    ``graphs`` the forward and backward graphs it made of it, ``saved`` what the forward
    saves, ``moved`` what the copies move of each offloaded unit, ``placed`` where ours went
    and ``runtime`` what runs them (its bytes moved so far); for (or with) a chain of this
    graph, ``counted`` every unit's storages that can move, their ops hoisted into their
    stages as the profile had them (``offload.profiler.compiled``)."""

    def __init__(self, chain: Chain, schedule: Schedule, copies: str = "schedule",
                 copy_backend: str | None = None, marks: bool = False) -> None:
        if copies not in COPIES:
            raise ValueError(f"copies {copies!r}: choose one of {', '.join(COPIES)}")
        if schedule.encode:
            raise ChainMismatch(f"a compiled graph runs no encoder, and this schedule encodes "
                                f"{', '.join(f'U{i}' for i in sorted(schedule.encode))}",
                                "train it with Offloaded(torch.compile(model), chain, schedule) (a graph break at each "
                                "stage boundary), or solve without --encodings")
        restoring = [o.stage for o in schedule.offloads if o.restore]
        if restoring:
            raise ChainMismatch(f"a compiled graph cannot take a held part off the device (the graph's own values), "
                                f"and this schedule restores those of {', '.join(f'U{i}' for i in restoring)}",
                                "train it with Offloaded(torch.compile(model), chain, schedule) (a graph break at each "
                                "stage boundary), or give it the schedule without restores")
        moving = [r.text for r in schedule.recompute if r.moves]
        if schedule.offloads and copies == "pytorch-matmuls":
            raise ChainMismatch("copies='pytorch-matmuls' offloads the matmuls' outputs, not a schedule's units, and "
                                "this schedule offloads some", "give it a schedule without offloads")
        if moving and copies != "schedule":
            raise ChainMismatch(f"PyTorch's activation offloading moves no recomputed run's checkpoint, and this "
                                f"schedule offloads those of {', '.join(moving)}",
                                "place the copies with ours (copies='schedule'), or solve with those checkpoints kept")
        self.offloaded = sorted(o.stage for o in schedule.offloads)
        self.copies = copies
        self.marks = marks  # the profiler's marks at the stage boundaries (offload.profiler.compiled)
        self.whole = chain.recipe is not None and chain.recipe.whole_graph  # a chain of this compiled graph
        self.chain_units = {k: chain.stage(k).saved_bytes for k in range(1, chain.L + 1)}
        self.events = step_events(chain, schedule.offloads, schedule.recompute)
        self.placed: PlacedCopies | None = None
        self.bandwidth = chain.platform.h2d_bytes_per_s
        self.cuts = cut_sites(chain)
        self.runs = list(schedule.recompute)
        self.recomputed = {k for r in self.runs for k in range(r.first, r.last + 1)}  # the runs' stages
        self.runtime = GraphCopies(copy_backend)  # the copies' ops name it by its number: part of the key
        self.grads = GraphGrads()  # what accumulates the weight gradients in the backward: so is its number
        self.accumulated = 0  # how many weights' gradients it accumulates (``graph_grads.add_accumulation``)
        self.key = hashlib.sha256(repr((chain.sha256, self.runs, self.offloaded, copies, copy_backend, marks,
                                        _PROCESS, self.runtime.number, self.grads.number,
                                        [str(op._schema) for op in (*ALL_OPS, *GRAD_OPS)])).encode()).hexdigest()
        self.stages: dict[str, int] = {}
        self.tags: dict[str, CheckpointPolicy | None] = {}
        self.graphs: tuple[fx.GraphModule, fx.GraphModule] | None = None
        self.units: dict[str, int] = {}  # forward node name -> the unit its value is in when saved
        self.back_stages: dict[str, int] = {}  # backward node name -> the stage whose backward it is
        # each storage the forward graph saves for the backward, as partitioned (Inductor may
        # change the graphs after): its unit (0: the graph's inputs, weights and batch), its
        # bytes, whether it goes to the host; what a unit is in the compiled graph, to set
        # beside the eager chain's ``saved_bytes``
        self.saved: list[tuple[int, int, bool]] = []
        self.moved: dict[int, tuple[int, int]] = {}  # offloaded unit -> (bytes moved, bytes left on the device)
        self.counted: list[UnitStorage] = []  # of a chain of this graph: every unit's storages that can move
        self.outputs = 0  # how many of the forward graph's outputs are the model's (the rest it saves)
        # per run (by its first stage), its checkpoint's bytes as partitioned (``_checkpoints``)
        self.checkpoints: dict[int, tuple[int, int]] = {}
        self.recomputable = set(chain.recomputable)

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
                 ) -> tuple[fx.GraphModule, fx.GraphModule]:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        stages = assign_stages(gm.graph, self.cuts)
        if not stages and self.cuts:
            warnings.warn("a graph of the compiled model runs none of the chain's stage boundaries (a graph break put "
                          "it outside them, e.g. a loss after the model): it is partitioned as plain compile does, "
                          "the schedule does not act in it", stacklevel=2)
            return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        fixed = _inputs_without_gradient(gm.graph, kwargs.get("num_fwd_outputs", 0))
        self.back_stages = backward_stages(gm.graph, stages)
        run_of = {k: (n, run) for n, run in enumerate(self.runs, 1) for k in range(run.first, run.last + 1)}
        self.units = value_units(stages, self.back_stages, set(run_of))
        rules = {n: KeepRule(run.option) for n, run in enumerate(self.runs, 1) if run.option}
        self.stages, self.tags = {}, {}
        for node, k in stages.items():
            policy = None  # a kept stage's node: the partitioner's own choice, as in a plain compile
            if k in run_of:
                n, run = run_of[k]
                node.meta["ac_graph_id"] = n
                read_later = _read_after(node, stages, run.last)
                if node.target is operator.getitem and node.args[0].name in self.tags:
                    # a value of a multi-output op: as the op, or saved where a later stage reads it
                    policy = CheckpointPolicy.MUST_SAVE if read_later else self.tags[node.args[0].name]
                elif _random(node) or any(a in fixed for a in node.all_input_nodes) or read_later or (
                        n in rules and isinstance(node.target, torch._ops.OpOverload)
                        and rules[n](node.target, node.args, node.kwargs)):
                    policy = CheckpointPolicy.MUST_SAVE
                else:
                    policy = CheckpointPolicy.MUST_RECOMPUTE
            elif any(stages.get(u) in run_of for u in node.users):
                # a kept stage's value that a recomputed run reads (its checkpoint): saved as it
                # is, not made again in the backward from other values of the kept stage, which
                # would then save more than it does with the run kept
                policy = CheckpointPolicy.MUST_SAVE
            if policy is not None:
                node.meta["recompute"] = policy
            node.meta["should_offload"] = (self.copies == "pytorch" and self.units.get(node.name) in self.offloaded) or (
                self.copies == "pytorch-matmuls" and isinstance(node.target, torch._ops.OpOverload)
                and keeps(node.target, node.args, node.kwargs))
            self.stages[node.name], self.tags[node.name] = k, policy
        outputs = self.outputs = kwargs.get("num_fwd_outputs", 0)
        cuda = any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.is_cuda for n in gm.graph.nodes)
        pytorch = (self.copies == "pytorch" and bool(self.offloaded)) or self.copies == "pytorch-matmuls"
        with config.patch(_offloading_settings(pytorch, cuda, self.bandwidth)):
            self.graphs = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        self.units.update(dict.fromkeys(shared_saves(*self.graphs, outputs, self.units, self.back_stages,
                                                     self.events.L), 0))
        saved = list(self.graphs[0].graph.find_nodes(op="output")[0].args[0][outputs:])
        self.checkpoints = self._checkpoints()
        moved: set[str] = set()
        stages = self.stages
        if self.whole or self.marks:  # the graph its chain measures: every unit's ops hoisted as if it moved
            L = self.events.L
            moving, _, stages = movable(self.graphs[0], outputs, self.units, set(range(1, L + 1)), self.stages)
            keep_crossing(self.graphs[0], stages, L)
            self.counted = counted_storages(*self.graphs, moving, stages, self.back_stages, L)
            # and the runs' checkpoints, each storage handed to the first run that reads it where
            # that run begins: Inductor otherwise fused a BERT layer's re-run into the backward two
            # stages before its own (its softmax with theirs), which then held it (451 KiB over)
            taken = {StorageWeakRef(s.values[0].meta["val"].untyped_storage()) for s in moving}
            first_run: dict[str, Any] = {}
            for s in checkpoint_storages(*self.graphs, outputs, self.runs, stages, self.back_stages, taken,
                                         self.recomputed):
                if s.name not in first_run or s.run.last > first_run[s.name].run.last:
                    first_run[s.name] = s
            moving += first_run.values()
        if self.ours:
            self.placed = place_copies(*self.graphs, outputs, self.events, stages, self.units, self.back_stages,
                                       set(self.offloaded), self.runtime, [r for r in self.runs if r.moves])
            moved = self.placed.values
        if self.marks or self.whole:  # what stays handed to the backward as if fetched, the boundaries marked
            place_ready(self.graphs[1], [s for s in moving if s.name not in moved], unit_needs(self.counted),
                        self.back_stages, stages, self.events.L)
            place_marks(*self.graphs, self.events.L, stages, self.back_stages, self.runtime.number)
        self.saved = self._saved(saved, moved)
        self._check_moved()
        self._check_units()
        self.accumulated = add_accumulation(*self.graphs, kwargs.get("static_lifetime_input_indices") or (), self.grads)
        return self.graphs

    def _checkpoints(self) -> dict[int, tuple[int, int]]:
        """Per recomputed run (by its first stage): the bytes of the saved storages that only
        the run reads in the backward (what offloading its checkpoint moves,
        ``compiled_copies.checkpoint_storages``: its input, and what its own forward made, its
        dropouts' outputs and masks, which a compiled run saves where the eager one draws them
        again), each whole as the allocator counts it; and the bytes of those it reads that
        only stages the chain may recompute read besides (a mask every attention reads), which
        stay: with those stages recomputed no unit holds them (kept, one does too: the chain
        then counts them twice).  Read from the partitioned graphs before any op of ours goes in."""
        forward, backward = self.graphs
        out = {r.first: (0, 0) for r in self.runs}
        for s in checkpoint_storages(forward, backward, self.outputs, self.runs, self.stages, self.back_stages, set(),
                                     self.recomputable | self.recomputed):
            value = s.values[0].meta["val"]
            nbytes = allocated_bytes(storage_bytes(value), value.device)
            whole, shared = out[s.run.first]
            out[s.run.first] = (whole, shared + nbytes) if s.shared else (whole + nbytes, shared)
        return out

    @property
    def plans_memory(self) -> bool:
        """Whether the schedule makes the compiled step's memory plan (Inductor under
        ``PLANNED_OPTIONS``): our copies are in the graph, or the chain was profiled from this
        graph so (``offload.profiler.compiled``), or this is that profile."""
        return self.ours or self.whole or self.marks

    def _check_units(self) -> None:
        """On a chain of the compiled graph: each offloaded unit moves the bytes the chain
        counts, or, on a chain that offers recomputation, at most those (it counts a unit's
        largest over its neighbours' choices, ``offload.profiler.compiled``: T5's first stage
        saves 2 KiB more beside a recomputed neighbour, so a schedule that recomputes none
        moves less)."""
        if not (self.whole and self.placed):
            return
        counted: dict[int, int] = {}
        for s in self.placed.counted:
            counted[s.unit] = counted.get(s.unit, 0) + s.nbytes
        wrong = [k for k in self.offloaded if counted.get(k, 0) > self.chain_units[k]
                 or (counted.get(k, 0) < self.chain_units[k] and not self.recomputable)]
        if wrong:
            k = wrong[0]
            raise ChainMismatch(f"the compiled graph saves {format_bytes(counted.get(k, 0))} that can move for U{k}, "
                                f"where the chain, profiled from it, counts {format_bytes(self.chain_units[k])}: the "
                                "model, its batch, torch or the compile options differ from the profile's",
                                "profile it again (offload profile --compile inductor --whole-graph) and solve again")

    @property
    def ours(self) -> bool:
        """Whether our copy ops go into the graphs (the schedule moves something, and we place it)."""
        return self.copies == "schedule" and bool(self.offloaded or any(r.moves for r in self.runs))

    def _saved(self, saved: Sequence[object], moved: set[str]) -> list[tuple[int, int, bool]]:
        """``saved``: the forward's saved outputs; ``moved``: the values our copies move."""
        out, seen = [], set()
        for node in saved:
            source = node
            while isinstance(source, fx.Node) and (source.name.startswith(CPU_OFFLOAD_PREFIX)
                                                   or "async_" + CPU_OFFLOAD_PREFIX in source.name):
                source = source.args[0]  # PyTorch's copy (and its wait) of the value
            value = source.meta.get("val") if isinstance(source, fx.Node) else None
            if isinstance(value, torch.Tensor) and (ref := StorageWeakRef(value.untyped_storage())) not in seen:
                seen.add(ref)
                out.append((self.units.get(source.name, 0), storage_bytes(value),
                            source is not node or source.name in moved))
        return out

    def host_bytes(self) -> int:
        """The bytes of ``saved`` that go to the host (ours or PyTorch's copies)."""
        return sum(nbytes for _, nbytes, host in self.saved if host)

    def saved_bytes(self) -> dict[int, int]:
        """Per stage, the bytes of ``saved``."""
        out: dict[int, int] = {}
        for k, nbytes, _ in self.saved:
            out[k] = out.get(k, 0) + nbytes
        return out

    def _check_moved(self) -> None:
        """What the copies moved of each offloaded unit: ``ChainMismatch`` for a unit or an
        offloaded checkpoint of which they moved nothing, a warning for a unit they moved in
        part (module docstring)."""
        empty = [r.text for r in self.runs if r.moves and self.placed and not self.placed.checkpoint_bytes[r.first]]
        if empty:
            raise ChainMismatch(f"the compiled graph saves nothing that only the run reads for the checkpoints of "
                                f"{', '.join(empty)}: they cannot be offloaded there",
                                "train it with Offloaded(torch.compile(model), chain, schedule), or solve with those "
                                "checkpoints kept")
        if not self.offloaded:
            return
        moved = {k: [0, 0] for k in self.offloaded}  # bytes to the host, bytes left on the device
        for k, nbytes, host in self.saved:
            if k in moved:
                moved[k][0 if host else 1] += nbytes
        self.moved = {k: (m, left) for k, [m, left] in moved.items()}
        if self.copies == "pytorch":
            mover, skipped = ("PyTorch's activation offloading",
                              "it skips views, getitem values, non-contiguous tensors and model outputs")
        else:
            mover, skipped = ("the compiled graph", "a storage that is also the model's output, holds several "
                              "dtypes, has a size the compiler left symbolic or is made from a later stage's "
                              "values stays")
        # a unit the graph saves nothing of is not one that stays: beside a recomputed
        # neighbour, all a stage saved may be that run's checkpoint (a ViT's embeddings,
        # which their own backward never reads), held and moved as the checkpoint
        none = [k for k, (m, left) in self.moved.items() if not m and left]
        if none:
            raise ChainMismatch(f"{mover} moves nothing of {', '.join(f'U{k}' for k in none)} "
                                f"({skipped}{self._staying(none)})",
                                "train it with Offloaded(torch.compile(model), chain, schedule), or offload other units")
        part = [k for k, (_, left) in self.moved.items() if left]
        if part:
            warnings.warn(f"{mover} moves {', '.join(f'U{k} ({format_bytes(self.moved[k][1])} stay)' for k in part)} "
                          f"only in part ({skipped}{self._staying(part)})", stacklevel=2)

    def _staying(self, units: list[int]) -> str:
        """The values of ``units`` that stay, by name and why, when our copies placed them."""
        names = [f"{name} ({why})" for k in units for name, why in (self.placed.stay.get(k, ()) if self.placed else ())]
        return ": " + ", ".join(names) if names else ""

    def __deepcopy__(self, memo: dict) -> "SchedulePartitioner":
        """Inductor snapshots its options by deep copy (a recompile, e.g. with dynamic shapes):
        the snapshot is this partitioner, which holds the graphs it made and the runtime their
        ops call."""
        return self

    def __reduce__(self) -> tuple:
        """Pickled as its key: Inductor's cache key pickles its config, this partitioner in it
        (which holds the graphs it made, cyclic once the copies are placed)."""
        return (str, (self.key,))

    def uuid(self) -> str:
        """Part of Inductor's cache key: another schedule is another compiled graph.  It names
        this process too: the copies' runtime is made as the partitioner runs, so a graph
        compiled by another process cannot be served from the caches (AOTAutograd's would
        skip the partitioner)."""
        return self.key


def compile_scheduled(module: nn.Module, chain: Chain | PathLike, schedule: Schedule | PathLike,
                      backend: str = "inductor", copies: str = "schedule", copy_backend: str | None = None,
                      **compile_kwargs: Any) -> nn.Module:
    """``module`` compiled as one graph whose backward recomputes what ``schedule`` recomputes
    and whose saved tensors of the units ``schedule`` offloads go to the host.

    Args:
        module: the user's module, the one ``chain`` was profiled from (not wrapped in
            ``Offloaded``: the graph is not broken at stage boundaries).
        chain: its chain, or its path (the cut sites say where stages end).
        schedule: a schedule of ``chain``, or its path: its recomputation in the graph, its
            offloads and offloaded checkpoints as copies in the graph (module docstring);
            encodings are refused with ``ChainMismatch`` (``Offloaded`` runs them).
        backend: ``inductor`` (the partitioner goes in as ``custom_partitioner_fn``) or
            ``aot_eager`` (AOTAutograd with the same partitioner, no code generation).
        copies: ``schedule``: our copy ops at the schedule's events, run by ``copy_backend``
            (``offload.executor.compiled_copies``); ``pytorch``: PyTorch's activation
            offloading places them by its own rule (a baseline).
        copy_backend: the copies' backend (``offload.executor.backends``: ``cuda``,
            ``cpu-eager``, ``cpu-lazy``); ``None``: the device's default.
        compile_kwargs: passed to ``torch.compile``.  ``fullgraph`` defaults to True: the
            stages are found in one graph; with ``fullgraph=False`` a graph break is allowed
            outside the stage boundaries (a loss after the model: that graph is compiled
            plainly, with a warning), and refused between two of them.  With our copies,
            or on a chain of the compiled graph, Inductor's options are ``PLANNED_OPTIONS``
            (no peak-memory reordering, no layout optimization, no buffer reuse) unless ``options`` sets
            them.

    Returns:
        The compiled module (``torch.compile``'s ``OptimizedModule``); its ``partitioner``
        attribute is the ``SchedulePartitioner``, which keeps what it decided.
    """
    if is_staged(module):
        raise ChainMismatch("this module is inside an Offloaded: its stage boundaries break a compiled graph",
                            "compile a module of its own (copy.deepcopy(model) before wrapping either)")
    chain, schedule = chain_and_schedule(chain, schedule)
    partitioner = SchedulePartitioner(chain, schedule, copies, copy_backend)
    if chain.recipe is not None and chain.recipe.compile and not partitioner.whole:
        raise ChainMismatch(f"chain {chain.name!r} was profiled compiled with a graph break at every stage boundary "
                            "(for Offloaded(torch.compile(model))): its units and times are that run's, not one "
                            "graph's", "profile with --compile inductor --whole-graph (or without --compile, whose "
                            "chain gives the cuts and the eager model's figures)")
    if partitioner.whole and chain.recipe.compile != backend:
        raise ChainMismatch(f"chain {chain.name!r} was profiled as one graph compiled by {chain.recipe.compile}, "
                            f"not {backend}", f"compile it with backend={chain.recipe.compile!r}, or profile again")
    if schedule.budget is not None and not partitioner.whole:
        warnings.warn(f"the schedule was solved for {schedule.budget} on the eager chain: a compiled step's memory "
                      "is not this chain's (it saves other tensors, and its kernels hold other transients), "
                      "so the budget is not a promise here: profile the compiled graph "
                      "(offload profile --compile inductor --whole-graph) and solve on that chain", stacklevel=2)
    return compile_with(module, partitioner, backend, **compile_kwargs)


# Inductor's options where the schedule makes the compiled step's memory plan
# (``SchedulePartitioner.plans_memory``):
# * its peak-memory reordering moves a node as late as its readers allow: a D2H copy would
#   be issued just before its release (its only reader), not as its stage ends;
# * its layout optimization gives a conv net's activations another layout (channels last)
#   than the graph's, which our copies would have to put back into the graph's layout in a
#   buffer that no profile counts (a U-Net compiled with copies went 7.6% over its budget),
#   and the backward would round otherwise than without copies;
# * its buffer reuse keeps a freed buffer until a later allocation of its size takes it,
#   which extends its life by as much as the pool's order says: a copy that changed which
#   buffers were freed made a ViT hold 520 B over its prediction (and without it, its
#   backward's peaks are 25-77 KiB lower: every buffer is freed after its last reader).
PLANNED_OPTIONS = {"reorder_for_peak_memory": False, "layout_optimization": False, "allow_buffer_reuse": False}


def plain_compile(module: nn.Module, backend: str) -> nn.Module:
    """``module`` compiled as ``compile_with`` compiles it, but without a partitioner: the
    step whose gradients a schedule of an eager chain keeps bit for bit (one of a chain of the
    compiled graph keeps those of the same compile with an empty schedule, whose stage marks
    this one lacks), and the baselines' (``offload train --compare``).  With Inductor that is
    under ``PLANNED_OPTIONS``: a plain ``torch.compile`` lays a conv net out channels last, and
    its kernels then round otherwise."""
    if backend == "inductor":
        return torch.compile(module, backend=backend, options=dict(PLANNED_OPTIONS))
    return torch.compile(module, backend=backend)


def compile_with(module: nn.Module, partitioner: SchedulePartitioner, backend: str = "inductor",
                 **compile_kwargs: Any) -> nn.Module:
    """``module`` compiled whole with ``partitioner`` (``compile_scheduled``'s arguments)."""
    names = dict(module.named_modules())
    missing = [site.module for site in partitioner.cuts if site.module not in names]
    if missing:
        raise ChainMismatch(f"{type(module).__name__} has no submodule {missing[0]!r}, a cut site of the chain",
                            "compile the module the chain was profiled from")
    compile_kwargs.setdefault("fullgraph", True)
    if backend == "inductor":
        options = {**(PLANNED_OPTIONS if partitioner.plans_memory else {}),
                   **compile_kwargs.pop("options", {}), "custom_partitioner_fn": partitioner}
        # a weight's gradient may become its .grad where Inductor reuses no buffer it freed
        partitioner.grads.steal = options.get("allow_buffer_reuse", True) is False and not (
            options.get("triton.cudagraphs") or compile_kwargs.get("mode") in ("reduce-overhead", "max-autotune"))
        compiled = torch.compile(module, backend="inductor", options=options, **compile_kwargs)
    elif backend == "aot_eager":
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        # the graphs run as torch's aot_eager runs them: each value, inputs included, let go
        # after its last reader (functorch's ``nop`` kept every input of the backward to its end)
        partitioner.grads.steal = True
        compiled = torch.compile(module, backend=aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                                                              partition_fn=partitioner), **compile_kwargs)
    else:
        raise ValueError(f"backend {backend!r}: the schedule goes into inductor or aot_eager")
    compiled.partitioner = partitioner
    return compiled
