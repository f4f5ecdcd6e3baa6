"""Where the schedule's copies go in a compiled graph: the events of a step, placed among its nodes.

AOTAutograd's partitioner has made a forward graph that hands the backward graph the values
it saves.  ``place_copies`` moves the storages of the offloaded units with the ops of
``offload.executor.graph_copies``, at the points ``offload.step.events`` names, so that the
compiled step does what ``Offloaded`` does at its stage boundaries:

* **units** as the eager executor's (``offload.core.units``): a saved storage belongs to the
  first stage that saves it.  A value is saved by the stages whose backward reads it (a
  backward node's stage is that of the forward node it differentiates: AOTAutograd gives
  them one ``seq_nr``; a value read through a view, by the view's readers), a recomputed
  stage aside: what only recomputed stages read is their run's checkpoint
  (``value_units``); values sharing a storage (a fused projection's query, key and value)
  move as one storage, copied once;
* **forward** (nodes in stages by ``assign_stages``): after the last node of ``Fk``, the D2H
  of ``Uk``'s storages, then the releases due at ``k`` (due at ``L``: just before the graph's
  output), in the events' order, each unit's storages in forward order (their *keys*); the
  forward then hands the backward the host copy instead of each value;
* **backward**: a stage's backward begins with its first node (a node of a later stage past
  that point, such as a gradient sum, is in the earlier one); the H2D copies of prefetch
  point ``k`` go right before ``Bk``'s first node, or the recomputed forward nodes before
  it, in ``prefetch_key`` order: after every node of ``B(k+1)``, the gradient sums that
  close it too, which no ``seq_nr`` names (issued before one, a prefetch held its buffer
  through it: 311 KiB over a BERT op's prediction); the wait for a unit before the first
  node of ``B(need)``, or before a reader of it that comes earlier (then the H2D too, if its
  point came after that reader: ``late``); each value is read as a view (``as_strided``) of
  its storage's buffer.  On a chain of the compiled graph, which counts a unit as needed
  from its storages' first backward reader (``counted_storages``), no reader comes earlier,
  and the units that stay are handed to the backward at the same place (``place_ready``).

A storage is copied over the extent its saved values cover, not whole: Inductor may put a
value in a larger buffer than the value needs, or in a part of another's; and the copy holds
the values in the graph's layout, which the backward's views read, even where Inductor laid
a value out otherwise (``offload.executor.graph_copies``).

What cannot move is said (``PlacedCopies.stay``): a storage that is also an output of the
model, that holds values of several dtypes, or whose size the compiler left symbolic (the
random state a checkpointed region saves to draw its dropouts again: a transformers model
under ``gradient_checkpointing_enable()``).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import fx
try:  # a symbolic size's value as traced: torch 2.13's name for it
    from torch.fx.experimental.symbolic_shapes import optimization_hint as size_hint
except ImportError:  # torch 2.11's (the GPU machines' torch): without it no module of the package imported there
    from torch.fx.experimental.symbolic_shapes import size_hint
from torch.multiprocessing.reductions import StorageWeakRef

from offload.core.devices import allocated_bytes
from offload.step.actions import Recompute
from offload.step.events import D2H, H2D, RELEASE, WAIT, StepEvents

from .graph_copies import ALL_OPS, D2H_OP, H2D_OP, MARK_OP, READY_OP, RELEASE_OP, WAIT_OP, GraphCopies


def backward_stages(joint: fx.Graph, stages: Mapping[fx.Node, int]) -> dict[str, int]:
    """Stage of each backward node of a joint graph that differentiates a staged forward node
    (by ``seq_nr``), by name (the partitioned backward graph keeps the names)."""
    of_seq = {n.meta["seq_nr"]: k for n, k in stages.items() if "seq_nr" in n.meta}
    return {n.name: of_seq[n.meta["seq_nr"]] for n in joint.nodes
            if n.meta.get("partitioner_tag") == "is_backward" and n.meta.get("seq_nr") in of_seq}


def value_units(stages: Mapping[fx.Node, int], back: Mapping[str, int], recomputed: set[int]) -> dict[str, int]:
    """The unit of each forward node's value, were it saved: the first stage whose backward
    reads it, a recomputed stage aside, or its own stage if no backward node reads it.  A
    value that only recomputed stages read in the backward (their backward nodes, or their
    forward nodes run again there: a run's input, its random ops' outputs) is in no unit: it
    is its run's checkpoint, which the run holds until it is rebuilt.  A backward node the
    partitioner moved into the forward graph (it reads forward values only: a transpose of
    attention probabilities for a matmul's backward) is in its own stage's unit.  Inductor's
    random seeds are in none: they are the step's random state, not an activation (the
    eager executor moves none), and its generated kernels read them where they are.  Nor is
    a value off the graph's device: SDPA's random seed and offset on CUDA, which the tracer
    puts on the ``meta`` device and the kernels make on the host (its backward reads them
    there: moved to the device, they would be read through a device pointer, a segfault on
    the H200), as ``offload.core.units`` leaves out what is not on the model's device."""
    device = _graph_device(stages)
    units = {}
    for n, k in stages.items():
        if _never_moved(n, device):
            continue
        readers = _backward_readers(n, stages, back, recomputed)
        kept = readers - recomputed
        if kept or not readers:
            units[n.name] = min(kept, default=k)
    return {**back, **units}


def _backward_readers(node: fx.Node, stages: Mapping[fx.Node, int], back: Mapping[str, int],
                      recomputed: set[int]) -> set[int]:
    """The stages whose backward reads ``node``'s value: its backward users', its users' in
    recomputed stages (they run again in the backward), and through its views the views'
    readers: a view costs nothing to make again, so where the partitioner saves the value
    and makes the view in the backward (a stage's input, saved as the recomputed stage
    before it made it), the view's readers read the value."""
    readers = set()
    for u in node.users:
        if u.name in back:
            readers.add(back[u.name])
        elif stages.get(u) in recomputed:
            readers.add(stages[u])
        elif u in stages and getattr(u.target, "is_view", False):
            readers |= _backward_readers(u, stages, back, recomputed)
    return readers


def _graph_device(nodes: Iterable[fx.Node]) -> torch.device | None:
    """The device most of the nodes' tensor values are on (the model's)."""
    devices = Counter(v.device for n in nodes if isinstance(v := n.meta.get("val"), torch.Tensor))
    return devices.most_common(1)[0][0] if devices else None


def _never_moved(node: fx.Node, device: torch.device | None) -> bool:
    """Whether no copy moves ``node``'s value: Inductor's random seeds, or a value off the
    graph's ``device`` (``value_units``)."""
    value = node.meta.get("val")
    return node.target is torch.ops.prims.inductor_seeds.default or (
        isinstance(value, torch.Tensor) and value.device != device)


@dataclass
class _Storage:
    """One saved storage that moves: its values (forward nodes, the first is copied) and unit,
    or the recomputed run whose offloaded checkpoint it is part of."""

    unit: int
    values: list[fx.Node]
    run: Recompute | None = None
    shared: bool = False  # of a run's checkpoint, but other runs read it too (``checkpoint_storages``)

    @property
    def owner(self) -> tuple[int, Recompute | None]:
        """What its events name: ``(stage, run)`` (``offload.step.events.Event``)."""
        return (self.run.first, self.run) if self.run is not None else (self.unit, None)

    @property
    def extent(self) -> tuple[int, int]:
        """The elements of the storage its values cover, ``[lo, hi)`` (a compiler may place a
        value in a larger buffer: only this part is copied)."""
        vals = [v.meta["val"] for v in self.values]
        return (min(v.storage_offset() for v in vals),
                max(v.storage_offset() + sum((n - 1) * st for n, st in zip(v.size(), v.stride())) + 1
                    if v.numel() else v.storage_offset() for v in vals))

    @property
    def nbytes(self) -> int:
        lo, hi = self.extent
        return (hi - lo) * self.values[0].meta["val"].element_size()

    @property
    def layout(self) -> list[int]:
        """The values' places in the copy, flat for ``offload::d2h``: per value its rank, size,
        stride and offset from the extent's start (``graph_copies._layouts`` reads it)."""
        lo, _ = self.extent
        out: list[int] = []
        for v in self.values:
            val = v.meta["val"]
            out += [val.dim(), *val.size(), *val.stride(), val.storage_offset() - lo]
        return out

    @property
    def name(self) -> str:
        return self.values[0].name


@dataclass
class PlacedCopies:
    """What ``place_copies`` did: the storages that move (``storages``, in key order) and the
    values of the offloaded units that stay, with why (``stay``); ``late``: storages the
    compiled backward reads before the schedule's point; ``copies``: their runtime;
    ``counted``: the units' storages as a chain of the compiled graph counts them."""

    copies: GraphCopies
    offloaded: list[int]
    runs: list[Recompute]
    storages: list[_Storage] = field(default_factory=list)
    stay: dict[int, list[tuple[str, str]]] = field(default_factory=dict)
    late: list[str] = field(default_factory=list)
    counted: list[UnitStorage] = field(default_factory=list)  # the units' moving storages as a chain counts them

    def _by(self, owner: Callable[[_Storage], bool]) -> dict[str, list[str]]:
        return {s.name: [v.name for v in s.values] for s in self.storages if owner(s)}

    @property
    def moved(self) -> dict[int, dict[str, list[str]]]:
        """Per offloaded unit, the values it moves by storage (the first value's name -> all)."""
        return {k: self._by(lambda s: s.run is None and s.unit == k) for k in self.offloaded}

    @property
    def moved_bytes(self) -> dict[int, int]:
        return {k: sum(s.nbytes for s in self.storages if s.run is None and s.unit == k) for k in self.offloaded}

    @property
    def checkpoints(self) -> dict[int, dict[str, list[str]]]:
        """Per run that offloads its checkpoint (by its first stage), the checkpoint's values."""
        return {r.first: self._by(lambda s: s.run == r) for r in self.runs}

    @property
    def checkpoint_bytes(self) -> dict[int, int]:
        return {r.first: sum(s.nbytes for s in self.storages if s.run == r) for r in self.runs}

    @property
    def values(self) -> set[str]:
        """The names of every value that moves."""
        return {v.name for s in self.storages for v in s.values}


def _saved_storages(forward: fx.GraphModule, num_fwd_outputs: int) -> dict[StorageWeakRef, list[fx.Node]]:
    """The forward's saved values by storage, each storage's values in forward order; not the
    graph's inputs' storages (a weight, the batch: its caller holds it, so freeing a view of
    it, GPT-2's ``input_ids.view(-1, seq)``, frees nothing), which no unit or checkpoint holds."""
    outputs = [n for n in forward.graph.find_nodes(op="output")[0].args[0][num_fwd_outputs:] if isinstance(n, fx.Node)]
    inputs = {StorageWeakRef(n.meta["val"].untyped_storage()) for n in forward.graph.find_nodes(op="placeholder")
              if isinstance(n.meta.get("val"), torch.Tensor)}
    order = {n: i for i, n in enumerate(forward.graph.nodes)}
    groups: dict[StorageWeakRef, list[fx.Node]] = {}
    for node in sorted(set(outputs), key=order.__getitem__):
        if isinstance(node.meta.get("val"), torch.Tensor):
            ref = StorageWeakRef(node.meta["val"].untyped_storage())
            if ref not in inputs:
                groups.setdefault(ref, []).append(node)
    return groups


def storage_bytes(value: torch.Tensor) -> int:
    """The bytes of ``value``'s storage (a graph's meta value), a number: where the compiler left
    the size symbolic, the size it had when traced."""
    n = value.untyped_storage().nbytes()
    return n if isinstance(n, int) else size_hint(n)


def _symbolic(values: list[fx.Node]) -> bool:
    """Whether the storage of ``values`` has a size the compiler left symbolic: its copies would
    have no size to allocate (``run_and_save_rng_state``'s random state under a user's
    checkpoint, compiled whole: a transformers Qwen2's profile failed on one)."""
    return not isinstance(values[0].meta["val"].untyped_storage().nbytes(), int)


def _storages(forward: fx.GraphModule, num_fwd_outputs: int, units: Mapping[str, int], offloaded: set[int]
              ) -> tuple[list[_Storage], dict[int, list[tuple[str, str]]]]:
    """The saved storages of the offloaded units that move, in forward order, and the values
    of those units that stay (why)."""
    outputs = list(forward.graph.find_nodes(op="output")[0].args[0])
    model = {StorageWeakRef(n.meta["val"].untyped_storage()) for n in outputs[:num_fwd_outputs]
             if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)}
    moving, stay = [], {k: [] for k in sorted(offloaded)}
    for ref, values in _saved_storages(forward, num_fwd_outputs).items():
        # the graph's inputs (weights, the batch) and random seeds are in no unit
        unit = min((units[v.name] for v in values if v.name in units), default=None)
        if unit not in offloaded:
            continue
        why = ("an output of the model" if ref in model else
               "values of several dtypes" if len({v.meta["val"].dtype for v in values}) > 1 else
               "a size the compiler left symbolic" if _symbolic(values) else None)
        if why:
            stay[unit] += [(v.name, why) for v in values]
        else:
            moving.append(_Storage(unit, values))
    return moving, stay


def checkpoint_storages(forward: fx.GraphModule, backward: fx.GraphModule, num_fwd_outputs: int, runs: list[Recompute],
                        stages: Mapping[str, int], back_stages: Mapping[str, int], taken: set[StorageWeakRef],
                        recomputed: set[int] | None = None) -> list[_Storage]:
    """The saved storages of each run's checkpoint, for the runs that offload it: those that
    only the run reads in the backward (its recomputed ops and its stages' backward ops: the
    run's input, and what its in-stage option or its random ops keep), not taken by a unit
    that moves.  What other stages read too (a rotary table, a mask) stays, as the eager
    executor's held tensors do, and so do the graph's inputs (weights the run reads: the
    module holds them) and what no copy moves (``value_units``).  With ``recomputed`` (the
    recomputed stages), also each storage that the run reads and only those stages read
    besides, in every such run: no unit holds it (a mask that every recomputed attention
    reads, or Inductor's random seeds, which runs that draw their dropouts again read), so
    each run that reads it counts it with its checkpoint, as the eager model's held tensors
    do (``shared``); none of these are ``taken``."""
    readers = {n.name: list(n.users) for n in backward.graph.find_nodes(op="placeholder")}
    device = _graph_device(forward.graph.nodes)
    groups = {ref: values for ref, values in _saved_storages(forward, num_fwd_outputs).items()
              if all(v.op == "call_function" and getattr(v.meta.get("val"), "device", None) == device
                     for v in values) and not _symbolic(values)}
    out = []
    for run in runs:
        inside = range(run.first, run.last + 1)
        for ref, values in groups.items():
            read = {stages.get(r.name, back_stages.get(r.name)) for v in values for r in readers.get(v.name, ())}
            if ref in taken or not read:
                continue
            if read <= set(inside) and not any(_never_moved(v, device) for v in values):
                out.append(_Storage(run.first, values, run))
                taken.add(ref)
            elif recomputed is not None and read & set(inside) and read <= recomputed:
                out.append(_Storage(run.first, values, run, shared=True))
    return out


def movable(forward: fx.GraphModule, num_fwd_outputs: int, units: Mapping[str, int], offloaded: set[int],
            stages: Mapping[str, int]) -> tuple[list[_Storage], dict[int, list[tuple[str, str]]], dict[str, int]]:
    """The saved storages of the ``offloaded`` units that can move, in forward order, the
    values of those units that stay (why), and the forward nodes' stages once the ops making
    the moving values are hoisted into their stage (``_hoist``; ``forward`` is changed so)."""
    moving, stay = _storages(forward, num_fwd_outputs, units, offloaded)
    stages = dict(stages)
    for s in list(moving):
        if not _hoist(forward.graph, s.values, s.unit, stages):
            moving.remove(s)
            stay[s.unit] += [(v.name, "made from a later stage's values") for v in s.values]
    return moving, stay, stages


@dataclass(frozen=True)
class UnitStorage:
    """A saved storage that moves with its unit, as a chain of the compiled graph counts it
    (``offload.profiler.compiled``): ``nbytes`` the whole storage (what freeing it frees, as
    the device's allocator counts it), ``held_until`` the last stage whose forward reads it
    (the graph keeps it that long, released or not; the forward's end, ``L``, for a reader
    the partitioner put there), ``need_from`` the first backward stage that reads it (the
    largest: a causal mask that every attention backward reads is needed from the last's,
    though it is its first stage's unit), ``moved`` what its copy moves (the extent its
    values span: ``None``, the whole storage)."""

    unit: int
    name: str
    nbytes: int
    held_until: int
    need_from: int
    moved: int | None = None


def counted_storages(forward: fx.GraphModule, backward: fx.GraphModule, moving: Sequence[_Storage],
                     stages: Mapping[str, int], back_stages: Mapping[str, int], L: int) -> list[UnitStorage]:
    """``moving`` (``movable``'s) with the bytes, the holding and the need a chain counts."""
    readers: dict[StorageWeakRef, int] = {}
    for node in forward.graph.nodes:
        value = node.meta.get("val")
        if node.op != "call_function" or not isinstance(value, torch.Tensor):
            continue
        ref = StorageWeakRef(value.untyped_storage())
        read = [stages.get(u.name, L) for u in node.users if u.op == "call_function"]
        readers[ref] = max([readers.get(ref, 0), *read])
    needed = _needed_from(backward.graph, back_stages, L)
    out = []
    for s in moving:
        value = s.values[0].meta["val"]
        ref = StorageWeakRef(value.untyped_storage())
        out.append(UnitStorage(s.unit, s.name, allocated_bytes(storage_bytes(value), value.device),
                               max(s.unit, readers.get(ref, 0)),
                               max([s.unit, *(needed.get(v.name, 0) for v in s.values)]), s.nbytes))
    return out


def unit_needs(counted: Sequence[UnitStorage]) -> dict[int, int]:
    """Unit -> its ``need_from``: the first backward stage that reads any of its storages."""
    need: dict[int, int] = {}
    for c in counted:
        need[c.unit] = max(need.get(c.unit, c.unit), c.need_from)
    return need


_CONVERSIONS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def keep_crossing(forward: fx.GraphModule, stages: Mapping[str, int], L: int) -> None:
    """Make Inductor keep each value computed elementwise in a stage that a later stage reads
    (``inductor_realize_to_strides``), instead of computing it again inside each reader's
    kernel from the values it is made of: those would then be read, and held, where the graph
    reads only the value (a gate ``expand``ed and ``clone``d in the first block, read by every
    block's product: each product's kernel read the gate itself, held to the last block, 32 B
    over).  Values read later are then held as ``counted_storages`` reads the graph."""
    for node in forward.graph.nodes:
        target = node.target
        if (node.op == "call_function" and node.name in stages and isinstance(target, torch._ops.OpOverload)
                and (torch.Tag.pointwise in target.tags or target in _CONVERSIONS)
                and any(stages.get(u.name, L) > stages[node.name] for u in node.users if u.op == "call_function")):
            node.meta["inductor_realize_to_strides"] = True


def _needed_from(graph: fx.Graph, back_stages: Mapping[str, int], L: int) -> dict[str, int]:
    """Each input of the backward graph -> the stage whose backward reads it first (its
    first reader's region, ``_regions``: a node between stages is in the one before it)."""
    needed: dict[str, int] = {}
    for n, current in _walk_regions(graph, back_stages, L):
        for x in n.all_input_nodes:
            if x.op == "placeholder" and n.op != "output":
                needed.setdefault(x.name, current)
    return needed


def shared_saves(forward: fx.GraphModule, backward: fx.GraphModule, num_fwd_outputs: int, units: Mapping[str, int],
                 back_stages: Mapping[str, int], L: int) -> set[str]:
    """The saved values whose storage a backward stage after its unit's next one reads first
    (its first reader's region: a node between stages is in the one before it), to be in no
    unit, as the eager chain's shared saves are: they stay on the device, in the memory of the
    ops they live through.  In their unit they made the whole unit needed from that reader: in
    the compiles that recompute a later layer of a Llama, a storage of its first layer's unit
    read where the last layer's re-run is, and the first layer's 13 MiB unit was needed from
    that layer's backward, three stages early (its smallest budget 31.20 MiB with recomputation
    offered, 26.23 MiB without)."""
    needed = _needed_from(backward.graph, back_stages, L)
    shared: set[str] = set()
    for values in _saved_storages(forward, num_fwd_outputs).values():
        unit = min((units[v.name] for v in values if v.name in units), default=0)
        if unit and max(needed.get(v.name, 0) for v in values) > unit + 1:
            shared.update(v.name for v in values)
    return shared


def place_copies(forward: fx.GraphModule, backward: fx.GraphModule, num_fwd_outputs: int, events: StepEvents,
                 stages: Mapping[str, int], units: Mapping[str, int], back_stages: Mapping[str, int],
                 offloaded: set[int], copies: GraphCopies, runs: Sequence[Recompute] = ()) -> PlacedCopies:
    """Put the copies of the ``offloaded`` units into the partitioned graphs (module docstring).

    Args:
        forward, backward: AOTAutograd's graphs, changed in place.
        num_fwd_outputs: how many of the forward's outputs are the model's (the rest are saved).
        events: the step's events (``offload.step.events.step_events``).
        stages: forward node name -> stage; ``units``: -> unit (``value_units``);
            ``back_stages``: backward node name -> stage (``backward_stages``).
        offloaded: the offloaded units.
        copies: the runtime the ops call (its arena planned here).
        runs: the recomputed runs that offload their checkpoints.

    Returns:
        What moved and what stays.
    """
    moving, stay, stages = movable(forward, num_fwd_outputs, units, offloaded, stages)
    taken = {StorageWeakRef(s.values[0].meta["val"].untyped_storage()) for s in moving}
    moving += checkpoint_storages(forward, backward, num_fwd_outputs, list(runs), stages, back_stages, taken)
    copies.planned_bytes = sum(s.nbytes for s in moving)
    copies.device = _graph_device(forward.graph.nodes)
    # keys in the order the forward issues the D2H copies (the arena's slots are handed out so)
    issued = [s for e in events.of(D2H) for s in moving if s.owner == (e.stage, e.run)]
    placed = PlacedCopies(copies, sorted(offloaded), list(runs), issued, stay)
    placed.counted = counted_storages(forward, backward, [s for s in issued if s.run is None], stages, back_stages,
                                      events.L)
    by_owner: dict[tuple[int, Recompute | None], list[tuple[int, _Storage]]] = {}
    for key, s in enumerate(issued):
        by_owner.setdefault(s.owner, []).append((key, s))
    hosts = _place_forward(forward, events, stages, by_owner, copies.number)
    _place_backward(backward, events, stages, back_stages, by_owner, hosts, copies.number, placed)
    _done(forward, backward)
    return placed


def _done(*graphs: fx.GraphModule) -> None:
    for gm in graphs:
        gm.graph.lint()
        gm.recompile()


def place_marks(forward: fx.GraphModule, backward: fx.GraphModule, L: int, stages: Mapping[str, int],
                back_stages: Mapping[str, int], number: int) -> None:
    """The profiler's marks (``offload::mark``) at the stage boundaries of the partitioned
    graphs: index ``k`` as ``Fk`` ends (``L``: before the forward's output), ``L + 1`` as the
    backward begins, ``2L - k + 2`` as ``Bk`` ends (``1``: before the backward's output).  Each
    comes after the ops before it as the copies do (``after``); with copies in the graph, a
    stage's D2H copies and the releases due at its end come before its mark, the prefetches,
    re-runs and waits of the next backward stage after it (the model's order: an op's
    interval holds what the model counts in it)."""
    graph = forward.graph
    for k in range(1, L + 1):
        at, after, end = _forward_end(graph, stages, k, L)
        while after and at.next.op == "call_function" and at.next.target in (D2H_OP, RELEASE_OP):
            at = at.next  # Fk's copies and releases end it, as the model has them
        _call(graph, at, after, MARK_OP, (number, k, end), f"mark_F{k}", None)
    graph = backward.graph
    region = _regions(graph, back_stages, L)
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    if nodes:
        _call(graph, nodes[0], False, MARK_OP, (number, L + 1, []), "mark_backward", None)
    output = graph.find_nodes(op="output")[0]
    for k in range(L, 0, -1):
        ahead = [n for n in region if region[n] < k]
        first = ahead[0] if ahead and k > 1 else output
        at = first
        # B(k-1)'s prefetches, re-runs and waits begin it, as the model has them
        while at.prev.op == "call_function" and (at.prev.name in stages or _fetching(at.prev)):
            at = at.prev
        _call(graph, at, False, MARK_OP, (number, 2 * L - k + 2, handed_on(_up_to(graph, at.prev))), f"mark_B{k}", None)
    _done(forward, backward)


def _backward_start(first_of_k: fx.Node, stages: Mapping[str, int]) -> fx.Node:
    """Where ``Bk`` starts in the backward graph: its first node, or the forward nodes the
    partitioner put right before it to recompute them (they keep their forward names)."""
    at = first_of_k
    while at.prev.op == "call_function" and at.prev.name in stages:
        at = at.prev
    return at


def _up_to(graph: fx.Graph, last: fx.Node) -> list[fx.Node]:
    """The graph's calls up to ``last``, included."""
    out = []
    for n in graph.nodes:
        if n.op == "call_function":
            out.append(n)
        if n is last:
            return out
    return out


def _fetching(node: fx.Node) -> bool:
    """Whether ``node`` is one of our H2D copies, waits or readies, or a view of what they hand on."""
    if node.op != "call_function":
        return False
    if node.target is torch.ops.aten.as_strided.default:
        return _fetching(node.args[0])
    return node.target in (H2D_OP, WAIT_OP, READY_OP)


def _regions(graph: fx.Graph, back_stages: Mapping[str, int], L: int) -> dict[fx.Node, int]:
    """A backward node -> the stage whose backward it is in: a stage's backward begins with its
    first node, and a node of a later stage past that point (a gradient sum) is in the earlier one."""
    return {n: current for n, current in _walk_regions(graph, back_stages, L)
            if n.op == "call_function" and n.name in back_stages}


def _walk_regions(graph: fx.Graph, back_stages: Mapping[str, int], L: int) -> Iterator[tuple[fx.Node, int]]:
    """Each node of a backward graph with the stage whose backward it is in (``_regions``)."""
    current = L
    for n in graph.nodes:
        if n.op == "call_function" and n.name in back_stages:
            current = min(current, back_stages[n.name])
        yield n, current


def _hoist(graph: fx.Graph, values: list[fx.Node], k: int, stages: dict[str, int]) -> bool:
    """Move the ops making ``values`` that come after ``Fk``'s last node to just after it, so that
    their D2H can be issued as ``Fk`` ends; they join ``Fk`` in ``stages``.  The partitioner
    puts a backward op that reads forward values only (a transpose of a matmul's input) at the
    forward graph's end.  ``False`` (nothing moved) when one of them needs a later stage's op."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    end = max((n for n in graph.nodes if stages.get(n.name, k + 1) <= k), key=order.__getitem__)
    needed: list[fx.Node] = []

    def visit(n: fx.Node) -> bool:
        if n in needed or n.op == "placeholder" or order[n] <= order[end]:
            return True
        if n.name in stages:
            return False
        if not all(visit(a) for a in n.all_input_nodes):
            return False
        needed.append(n)
        return True
    if not all(visit(v) for v in values):
        return False
    for n in sorted(needed, key=order.__getitem__):
        end.append(n)
        end = n
        stages[n.name] = k
    return True


def _call(graph: fx.Graph, at: fx.Node, after: bool, op: object, args: tuple, name: str, val: torch.Tensor
          ) -> fx.Node:
    """A call of ``op`` right after (or before) ``at``, its fake value ``val``."""
    with graph.inserting_after(at) if after else graph.inserting_before(at):
        node = graph.call_function(op, args, name=name)
    node.meta["val"] = val
    return node


def _last_tensor(nodes: list[fx.Node]) -> fx.Node | None:
    """The last of ``nodes`` whose value is a tensor (what a copy placed after them waits for)."""
    return next((n for n in reversed(nodes) if isinstance(n.meta.get("val"), torch.Tensor)), None)


def handed_on(prefix: list[fx.Node]) -> list[fx.Node]:
    """The ``after`` of an op placed right after ``prefix`` (the graph's calls up to there):
    the values computed there that a computing node after it reads, and the last value.
    Taking them all, the op comes after every node whose work a later one needs, and
    Inductor cannot fuse such a node into a kernel past the boundary (the fused kernel would
    need the op, the op the kernel): a backward node of ``B(k+1)`` fused with ``Bk``'s first
    would wait for ``Bk``'s prefetches and hold them through its own work, which the model
    counts in ``B(k+1)``.  Only readers after the boundary count: a value whose readers are
    all before it is done with (taken at every later boundary, it was held to the last one:
    2 MB over a GPT-2's backward)."""
    inside = set(prefix)
    out = [n for n in prefix if isinstance(n.meta.get("val"), torch.Tensor)
           and any(u.op == "call_function" and u not in inside and u.target not in ALL_OPS for u in n.users)]
    last = _last_tensor(prefix)
    return out + [last] if last is not None and last not in out else out


def _flat(val: torch.Tensor, length: int, device: torch.device | str) -> torch.Tensor:
    """The fake value of ``length`` elements of ``val``'s dtype, flat, on ``device``."""
    with val.fake_mode:
        return torch.empty(length, dtype=val.dtype, device=device)


def _forward_end(graph: fx.Graph, stages: Mapping[str, int], k: int, L: int) -> tuple[fx.Node, bool, list[fx.Node]]:
    """Where ``Fk`` ends in the forward graph: the node an op placed there goes after (or, for
    ``k = L``, before: the graph's output), and its ``after``: the last value before it.  Not
    all that the stages hand on (``handed_on``), as in the backward: Inductor may then fuse
    work of ``Fk`` into a kernel of ``F(k+1)``, as it does in the profile, whose marks take
    the same; made to finish first, a GPT-2 block's forward held 128 KiB more."""
    before = [n for n in graph.nodes if stages.get(n.name, k + 1) <= k]
    at, after = (before[-1], True) if before and k < L else (graph.find_nodes(op="output")[0], False)
    last = _last_tensor(before)
    return at, after, [last] if last is not None else []


def _place_forward(forward: fx.GraphModule, events: StepEvents, stages: Mapping[str, int],
                   by_owner: dict[tuple[int, Recompute | None], list[tuple[int, _Storage]]], number: int
                   ) -> dict[str, fx.Node]:
    """The D2H and release ops; each moved value's place among the saved outputs taken by its
    storage's host copy.  Returns value name -> the release node handing that copy over."""
    graph = forward.graph
    output = graph.find_nodes(op="output")[0]
    copied: dict[int, fx.Node] = {}
    hosts: dict[str, fx.Node] = {}
    for k in range(1, events.L + 1):
        at, after, end = _forward_end(graph, stages, k, events.L)
        for e in events.after_forward(k) if k < events.L else events.before_backward(events.L):
            if e.kind not in (D2H, RELEASE):
                continue
            for key, s in by_owner.get((e.stage, e.run), ()):
                first = s.values[0]
                if e.kind == D2H:
                    for v in s.values:
                        v.meta["inductor_realize_to_strides"] = True
                    lo, hi = s.extent
                    node = copied[key] = _call(graph, at, after, D2H_OP, (s.values, s.layout, hi - lo, number, key, end),
                                               f"d2h_{s.name}", _flat(first.meta["val"], hi - lo, "cpu"))
                else:
                    node = _call(graph, at, after, RELEASE_OP, (copied[key], first, number, key, end),
                                 f"released_{s.name}", copied[key].meta["val"])
                    hosts.update((v.name, node) for v in s.values)
                if after:
                    at = node
    output.update_arg(0, tuple(hosts.get(n.name, n) if isinstance(n, fx.Node) else n for n in output.args[0]))
    return hosts


def _place_backward(backward: fx.GraphModule, events: StepEvents, stages: Mapping[str, int],
                    back_stages: Mapping[str, int],
                    by_owner: dict[tuple[int, Recompute | None], list[tuple[int, _Storage]]],
                    hosts: dict[str, fx.Node], number: int, placed: PlacedCopies) -> None:
    """The H2D and wait ops; the backward's inputs that were moved values now take the host
    copies, and their readers read views of the fetched buffers."""
    graph = backward.graph
    inputs = {n.name: n for n in graph.find_nodes(op="placeholder")}
    for name, host in hosts.items():  # the same place among the inputs, the host copy's value
        inputs[name].meta["val"] = host.meta["val"]
    region = _regions(graph, back_stages, events.L)
    fetched: dict[int, fx.Node] = {}
    for k in range(events.L, 0, -1):
        first_of_k = next((n for n in region if region[n] <= k), graph.find_nodes(op="output")[0])
        at = _backward_start(first_of_k, stages).prev  # B(k+1) is done there, its gradient sums too
        end = handed_on(_up_to(graph, at))
        for e in events.before_backward(k):
            if e.kind not in (H2D, WAIT):
                continue
            for key, s in by_owner.get((e.stage, e.run), ()):
                host = inputs[s.name]
                if e.kind == H2D:
                    val = s.values[0].meta["val"]
                    at = fetched[key] = _call(graph, at, True, H2D_OP, (host, val.device, number, key, end),
                                              f"h2d_{s.name}", _flat(val, host.meta["val"].numel(), val.device))
                    end = [at]
                else:
                    end = [_place_wait(graph, s, [inputs[v.name] for v in s.values], fetched[key], first_of_k, end,
                                       number, key, placed)]


def _place_wait(graph: fx.Graph, s: _Storage, inputs: list[fx.Node], h2d: fx.Node, first_of_k: fx.Node,
                end: list[fx.Node], number: int, key: int, placed: PlacedCopies) -> fx.Node:
    """The wait for ``h2d`` before ``first_of_k`` (after ``end``) or the storage's first
    reader, whichever comes first; each of its values read as a view of the buffer from there.
    Returns the wait."""
    at, end = _first_read(graph, inputs, first_of_k, end, skip=h2d)
    order = {n: i for i, n in enumerate(graph.nodes)}
    if order[at] < order[h2d]:  # the compiled backward reads it before the schedule's prefetch point
        at.prepend(h2d)
        h2d.update_arg(4, [])
        placed.late.append(s.name)
    wait = _call(graph, at, False, WAIT_OP, (h2d, number, key, end), f"fetched_{s.name}", h2d.meta["val"])
    _read_through(graph, at, wait, s, inputs, s.extent[0], skip=h2d)
    return wait


def _first_read(graph: fx.Graph, inputs: list[fx.Node], first_of_k: fx.Node, end: list[fx.Node],
                skip: fx.Node | None = None) -> tuple[fx.Node, list[fx.Node]]:
    """Where an op handing ``inputs`` (a storage's values) to the backward goes, and its
    ``after``: before ``first_of_k``, after ``end``; or before the first reader (but ``skip``)
    if it comes earlier, after what the graph before that reader hands on (only the value
    before it let Inductor fuse a Llama's backward otherwise than plain compile: gradients
    off by rounding)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    readers = [u for x in inputs for u in x.users if u is not skip]
    at = min([first_of_k, *readers], key=order.__getitem__)
    if at is not first_of_k:
        end = handed_on([n for n in graph.nodes if order[n] < order[at] and n.op == "call_function"])
    return at, end


def _read_through(graph: fx.Graph, at: fx.Node, handed: fx.Node, s: _Storage, inputs: list[fx.Node], lo: int,
                  skip: fx.Node | None = None) -> None:
    """Each of ``s``'s values (``inputs``) read, but by ``skip`` and ``handed``, as a view of ``handed``, its
    storage from element ``lo`` on, made right before ``at``."""
    for x, value in zip(inputs, s.values):
        val = value.meta["val"]
        view = _call(graph, at, False, torch.ops.aten.as_strided.default,
                     (handed, list(val.size()), list(val.stride()), val.storage_offset() - lo), f"{value.name}_back", val)
        for u in [u for u in x.users if u not in (skip, handed)]:
            u.replace_input_with(x, view)


def place_ready(backward: fx.GraphModule, staying: Sequence[_Storage], need: Mapping[int, int],
                back_stages: Mapping[str, int], stages: Mapping[str, int], L: int) -> None:
    """The saved storages that ``staying`` names (those a schedule does not move) handed to
    the backward where a fetched one would be: ``offload::ready`` (an alias) before the first
    node of ``B(need)`` of its unit, or for a run's checkpoint (``run``) of ``B(last)``, where
    the run begins, as a wait, and read through it as views, as a fetched one is.  Inductor
    fuses and orders the backward's kernels by what they read: with the values of every unit
    handed on so, a schedule's copies change none (readers of a kept value pulled into
    ``B(k+1)``'s kernels, as without these, hold a buffer there that a run fetching the value
    at ``Bk`` holds in ``Bk``: 2 KiB over a block's prediction); and a re-run whose checkpoint
    was there from the start was fused into a kernel two stages before its own (451 KiB)."""
    graph = backward.graph
    inputs = {n.name: n for n in graph.find_nodes(op="placeholder")}
    region = _regions(graph, back_stages, L)
    for k in range(L, 0, -1):
        first_of_k = next((n for n in region if region[n] <= k), graph.find_nodes(op="output")[0])
        for s in (s for s in staying if (s.run.last if s.run else need[s.unit]) == k and s.name in inputs):
            values = [inputs[v.name] for v in s.values]
            at = _backward_start(first_of_k, stages)
            at, end = _first_read(graph, values, first_of_k, handed_on(_up_to(graph, at.prev)))
            # handed on as the whole storage from its first element, each value a view of that at
            # its own offset (an alias of a first value at an offset of its own was read by
            # Inductor as a buffer there, its views offset twice: GPT-NeoX's fused query/key/value,
            # out of bounds); its other values read there too: read through the alias only, they
            # were held to the graph's end
            first = s.values[0].meta["val"]
            length = first.untyped_storage().nbytes() // first.element_size()
            with first.fake_mode:
                storage = torch.as_strided(first, [length], [1], 0)
            ready = _call(graph, at, False, READY_OP, (values[0], length, [*end, *values[1:]]), f"ready_{s.name}",
                          storage)
            _read_through(graph, at, ready, s, values, 0)
    _done(backward)
