"""Find where a model can be cut into stages, by running it once.

One real forward and loss of the user's own module, under a ``TorchFunctionMode`` that
records every torch call and forward hooks on every submodule, gives two things:

* the **differentiable activation graph**: a node per torch call whose output depends on
  the model's inputs *and* requires grad, an edge per such value it reads.  Values that
  carry no gradient (attention masks, position ids, rotary tables, a frozen prefix) and
  values computed from parameters alone (a transposed weight) are left out: they can be
  shared between stages without changing the order of the backward, which is all a
  stage boundary needs.  (Left in, a mask read by every layer would make no layer's
  output a cut; that is why earlier fx and top-level captures collapsed Hugging Face
  models to two stages.)
* the **module call sites**: each call of each submodule (its path in the model and which
  call of it this is), with the values it returned.

A *cut candidate* is a call site that returned exactly one value on the way to the loss,
produced by a node that every source-to-loss path of the graph passes through (a
dominator of the loss, networkx): a boundary there splits the computation in two.  A
*block* is a candidate too, whatever else crosses it: a call of a module with submodules
held in an ``nn.ModuleList``/``nn.Sequential`` (a T5 or MoE layer, a U-Net's down or up
block) or of a layer held in a ``ModuleList``, not inside another block, that returned a
value on the way to the loss (the one made last, when several).  Across a block boundary
other values may cross (a U-Net's skip features, an encoder's output read by every decoder
layer, an attention bias every layer reads): the stages on both sides share them as the
model's code holds them, and their memory is measured where it is live.  The boundary
still fires in the backward between the two stages' backward ops: autograd runs a
backward's nodes in the reverse order of their creation (its ready queue pops the
latest-created ready node first, and a node is ready once the later nodes that feed it
ran), so every op after the boundary has its backward before the boundary's, every op
before it after.  Where several nested calls return the same value (a block and its last
layer), the outermost is kept.  Where the model's own code makes a block's input outside
any call (an encoder's positions added and dropped out before its first layer), the start
of the block's call is a candidate too (``Site.before``, ``_add_openings``).  Stage
boundaries are then forward hooks at these call sites on the user's own module
(``offload.core.staging``), so its forward, hooks, checkpointing and compilation run as
written.
"""
from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import networkx as nx
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from offload.core.staging import Site

SOURCE, SINK = "source", "sink"


@dataclass
class CallRecord:
    """One call of a submodule during the captured forward."""

    site: Site  # its path and occurrence (leaf: which output value, once chosen)
    depth: int  # nesting depth (0: a child of the root)
    outputs: list[tuple[int, int | None]]  # (pytree leaf index, producing node) of each differentiable activation
    start: int = 0  # graph nodes made before the call began
    inputs: list[tuple[int, int]] = field(default_factory=list)  # (leaf of (args, kwargs), producer) of its activations
    end: int = 0  # graph nodes made when it returned (``start``: it made none, as an ``nn.Identity``)


@dataclass
class Capture:
    """The differentiable activation graph of one model and its cut candidates."""

    graph: nx.DiGraph  # nodes: call index (execution order) with attributes op, module, kind, params; SOURCE, SINK
    order: list[int]  # the nodes in execution order
    candidates: list[Site]  # in execution order
    ends: dict[Site, int]  # candidate -> the node producing its value
    notes: list[str] = field(default_factory=list)
    idle: frozenset[Site] = frozenset()  # candidates whose call made no node (its output is a value made before it)


class CaptureError(Exception):
    """The model cannot be cut (its loss does not depend on a trainable activation, say)."""


def _kind(name: str) -> str:
    name = name.lower()
    for key, kind in (("norm", "norm"), ("conv", "conv"), ("attention", "attention"), ("attn", "attention"),
                      ("softmax", "attention"), ("linear", "linear"), ("embedding", "embedding"), ("pool", "pool"),
                      ("relu", "activation"), ("gelu", "activation"), ("dropout", "dropout")):
        if key in name:
            return kind
    return name


class _Recorder(TorchFunctionMode):
    """Records torch calls (the graph) and submodule calls (the sites) of one forward."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self.names = {m: n for n, m in root.named_modules()}
        self.kinds = {n: _kind(type(m).__name__) for m, n in self.names.items()}
        self.params = {id(p) for p in root.parameters()}
        self.graph = nx.DiGraph()
        self.order: list[int] = []
        self.values: dict[int, tuple[weakref.ref, int | None, bool]] = {}  # id -> (tensor, producer node, from data)
        self.stack: list[str] = []
        self.count: Counter[str] = Counter()
        self.calls: list[CallRecord] = []
        # (module, occurrence, depth, nodes made before it, its activation inputs) of the calls running now
        self.open: list[tuple[str, int, int, int, list[tuple[int, int]]]] = []
        self.fn_nodes: dict[Any, int] = {}  # autograd node of a recorded output -> its graph node

    # -- values
    def _lookup(self, t: torch.Tensor) -> tuple[int | None, bool]:
        entry = self.values.get(id(t))
        if entry is None or entry[0]() is not t:
            return None, False
        if entry[1] is None and entry[2] and t.requires_grad and t.grad_fn is not None:
            # a custom autograd.Function's output: its forward ran without grad (no node), its
            # ``apply`` is no torch function (the mode never sees it); the autograd graph links it
            node = self._node_of(t.grad_fn)
            self.values[id(t)] = (entry[0], node, True)
            return node, True
        return entry[1], entry[2]

    def _weight(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a parameter of the model, or a view of one (Falcon's linear layers
        multiply by ``self.weight.T``: read as no weight, its stages were named by their norms)."""
        return id(t) in self.params or (t._base is not None and id(t._base) in self.params)

    def _node_of(self, fn: Any) -> int | None:
        """The graph node of autograd node ``fn``: one recorded, or a new one (a custom
        Function's backward) whose edges come from the nodes its inputs' autograd nodes are."""
        if fn is None or type(fn).__name__ == "AccumulateGrad":  # a leaf: a parameter, not an activation
            return None
        if fn in self.fn_nodes:
            return self.fn_nodes[fn]
        producers = {self._node_of(before) for before, _ in fn.next_functions} - {None}
        node = len(self.order)
        inner = self.stack[-1] if self.stack else ""
        name = type(fn).__name__.removesuffix("Backward")
        params = any(type(b).__name__ == "AccumulateGrad" for b, _ in fn.next_functions)
        self.graph.add_node(node, op=name, module=inner, kind=self.kinds[inner] if inner else _kind(name),
                            params=params, weights=params,
                            checkpointed=name == "CheckpointFunction")  # a reentrant checkpoint's region
        self.order.append(node)
        for producer in producers:
            self.graph.add_edge(producer, node)
        if not producers:
            self.graph.add_edge(SOURCE, node)
        self.fn_nodes[fn] = node
        return node

    def mark_inputs(self, inputs: Any) -> None:
        """The model's inputs: the data every activation comes from."""
        for t in tree_flatten(inputs)[0]:
            if isinstance(t, torch.Tensor):
                self.values[id(t)] = (weakref.ref(t), None, True)

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        versions = {id(t): t._version for t in ins}
        out = func(*args, **kwargs)
        # an input handed back untouched (a dropout of p=0, which ATen returns as it is, or
        # nn.Identity) is no new value: it keeps its producer, so no cut lands on a call that
        # computes nothing (a compiled graph has no node inside it: GPT-NeoX's emb_dropout);
        # one changed in place (its version moved) is the op's new value
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
                and not (id(t) in versions and t._version == versions[id(t)] and any(t is i for i in ins))]
        if not outs:
            return out
        looked = [self._lookup(t) for t in ins]
        from_data = any(data for _, data in looked)
        node = None
        if from_data and any(t.requires_grad for t in outs):
            node = len(self.order)
            name = getattr(func, "__name__", str(func))
            inner = self.stack[-1] if self.stack else ""
            first = next(t for t in outs if t.requires_grad)
            self.graph.add_node(node, op=name, module=inner, kind=self.kinds[inner] if inner else _kind(name),
                                params=any(self._weight(t) and t.requires_grad for t in ins),
                                weights=any(self._weight(t) for t in ins),  # frozen ones too (LoRA's base)
                                checkpointed=_in_checkpoint(),
                                value=f"{str(first.dtype).removeprefix('torch.')}{list(first.shape)}",
                                bytes=first.numel() * first.element_size())
            self.order.append(node)
            for t, (producer, _) in zip(ins, looked):
                if producer is not None and t.requires_grad:
                    self.graph.add_edge(producer, node)
            if not any(p is not None and t.requires_grad for t, (p, _) in zip(ins, looked)):
                self.graph.add_edge(SOURCE, node)
        for t in outs:
            self.values[id(t)] = (weakref.ref(t), node if t.requires_grad else None, from_data)
            if node is not None and t.grad_fn is not None:
                self.fn_nodes.setdefault(t.grad_fn, node)
        return out

    # -- module calls
    def _activations(self, values: Any) -> list[tuple[int, int]]:
        """(pytree leaf index, producing node) of each differentiable activation in ``values``."""
        out = []
        for n, t in enumerate(tree_flatten(values)[0]):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                producer, data = self._lookup(t)
                if data and producer is not None:
                    out.append((n, producer))
        return out

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        name = self.names.get(module, "?")
        self.stack.append(name)
        self.open.append((name, self.count[name], len(self.open), len(self.order), self._activations((args, kwargs))))
        self.count[name] += 1

    def post(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        self.stack.pop()
        name, occurrence, depth, start, inputs = self.open.pop()
        self.calls.append(CallRecord(Site(name, occurrence), depth, self._activations(out), start, inputs,
                                     len(self.order)))


def _in_checkpoint() -> bool:
    """Whether the op running now is in a region of the model's own (non-reentrant) activation
    checkpointing: ``torch.utils.checkpoint``'s saved-tensor hooks are the innermost."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return bool(top) and getattr(top[0], "__qualname__", "").startswith("_checkpoint_hook.")


def _add_openings(rec: _Recorder, best: dict[int, CallRecord], ancestors: set, blocks: set[str]) -> None:
    """Into ``best``, a candidate at the start of each block call (``Site.before``, on the input
    made last) whose input the model's own code made outside the calls that end candidates,
    with parameters on the way (an encoder's positions added and dropped out before its first
    layer: that code, which no module call holds, then ends the stage before, and the block can
    be re-run alone).  Not where a candidate already ends just before the call, or makes the
    block's input (SqueezeBERT's pooler runs after its encoder's output, inside the model's
    call that returns it, and no loss reads it: a cut at the head's start made a stage of no
    ops), nor where the code since the candidate before holds no parameters (a stage of its
    own it would join the block before, making that one end outside its calls)."""
    for call in sorted(rec.calls, key=lambda c: c.start):
        live = [(leaf, node) for leaf, node in call.inputs if node in ancestors]
        if call.site.module not in blocks or not live or call.start == 0:
            continue
        end = call.start - 1  # the node made last before the call (nodes are numbered in order)
        leaf, made = max(live, key=lambda out: out[1])  # the input made last
        since = max((n for n in best if n < made), default=-1)
        if end in best or made in best or not any(rec.graph.nodes[n]["params"] for n in rec.order[since + 1:made + 1]):
            continue
        best[end] = replace(call, site=Site(call.site.module, call.site.occurrence, leaf, before=True))


def _dominators(g: nx.DiGraph) -> list[int]:
    """Nodes on every SOURCE -> SINK path, in path order."""
    relevant = (nx.descendants(g, SOURCE) | {SOURCE}) & (nx.ancestors(g, SINK) | {SINK})
    if SINK not in relevant:
        raise CaptureError("the loss does not depend on any trainable activation of the model's inputs")
    idom = nx.immediate_dominators(g.subgraph(relevant), SOURCE)
    chain, node = [], idom[SINK]
    while node != SOURCE:
        chain.append(node)
        node = idom[node]
    return chain[::-1]


def _blocks(root: nn.Module, split: bool = False) -> set[str]:
    """The paths of the blocks (module docstring): modules with submodules, held in a
    ``ModuleList`` or ``Sequential`` and not inside another such block (and a ModuleList's
    single layers with parameters), or children of the model that hold no such block (a
    U-Net's middle block, beside its lists of down and up blocks); with ``split``, also each
    block's children that hold submodules and parameters (its attention, its MLP)."""
    found: set[str] = set()
    for name, container in root.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        if any(name == b or name.startswith(b + ".") for b in found):
            continue
        for key, child in container.named_children():
            # a ModuleList's layers are blocks too; a Sequential's single layers (a block's conv,
            # norm and activation) are not
            layer = isinstance(container, nn.ModuleList) and any(True for _ in child.parameters())
            if layer or any(True for _ in child.children()):
                found.add(f"{name}.{key}" if name else key)
    for key, child in root.named_children():
        if any(True for _ in child.children()) and not any(b == key or b.startswith(key + ".") for b in found):
            found.add(key)
    if split:
        modules = dict(root.named_modules())
        found |= {f"{b}.{key}" for b in found for key, child in modules[b].named_children()
                  if any(True for _ in child.children()) and any(True for _ in child.parameters())}
    return found


def capture(module: nn.Module, run: Callable[[], torch.Tensor], inputs: Any, split_blocks: bool = False) -> Capture:
    """Run ``run()`` (the forward and the loss of ``module`` on ``inputs``) once and find the
    cut candidates (module docstring).  ``run`` must return the scalar loss.  ``split_blocks``:
    the calls of each block's submodules that hold submodules and parameters (a transformer
    layer's attention and MLP) are candidates too, whatever crosses them (the residual)."""
    rec = _Recorder(module)
    rec.graph.add_node(SOURCE)
    handles = []
    for sub in module.modules():
        if sub is not module:
            handles.append(sub.register_forward_pre_hook(rec.pre, with_kwargs=True))
            handles.append(sub.register_forward_hook(rec.post, with_kwargs=True, always_call=True))
    try:
        rec.mark_inputs(inputs)
        with rec:
            loss = run()
    finally:
        for h in handles:
            h.remove()
    if not any(p.requires_grad for p in module.parameters()):
        raise CaptureError("the model has no parameters that require grad: there is nothing to train")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise CaptureError("the loss must be one number that requires grad")
    producer, _ = rec._lookup(loss)
    if producer is None:
        raise CaptureError("the loss does not depend on any trainable activation of the model's inputs")
    rec.graph.add_edge(producer, SINK)
    dominators = set(_dominators(rec.graph)) - {producer}
    ancestors = nx.ancestors(rec.graph, SINK)
    blocks = _blocks(module, split_blocks)
    best: dict[int, CallRecord] = {}  # cut value's node -> its outermost call site
    for call in rec.calls:
        live = [(leaf, node) for leaf, node in call.outputs if node in ancestors and node != producer]
        if not live:
            continue
        if len(live) == 1 and live[0][1] in dominators:
            leaf, node = live[0]
        elif call.site.module in blocks:
            leaf, node = max(live, key=lambda out: out[1])
        else:
            continue
        if node not in best or call.depth < best[node].depth:
            best[node] = replace(call, site=Site(call.site.module, call.site.occurrence, leaf))
    _add_openings(rec, best, ancestors, _blocks(module) if split_blocks else blocks)
    ends = {call.site: node for node, call in sorted(best.items())}
    idle = frozenset(call.site for call in best.values() if call.end == call.start)
    return Capture(graph=rec.graph, order=rec.order, candidates=list(ends), ends=ends, idle=idle)
