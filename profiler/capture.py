"""Capture a model's forward data-flow graph, and put stage boundaries back into the model.

Two ways, tried in order:

* ``fx``: ``torch.fx.symbolic_trace``; one graph node per op, exact data flow.  Boundaries
  are inserted as ``stage_boundary`` calls after the cut nodes of a copy of the traced graph.
* ``hooks``: for models fx cannot trace (data-dependent control flow, unsupported Python).
  One node per call made by the model's own ``forward``: module calls (``nn.Sequential``
  opened up), seen by forward hooks, and tensor functions (the residual ``+``), seen by a
  ``TorchFunctionMode``, during one real forward.  Boundaries are put on the same calls at
  run time, by the same hooks and mode.

Either way the graph holds a virtual ``SOURCE`` feeding the inputs and a ``SINK`` fed by
the outputs; a *cut candidate* is an op every ``SOURCE → SINK`` path passes through (a
dominator of ``SINK``) whose value is one floating tensor that requires grad, so that a
boundary on it splits the computation in two and fires in the backward.  The last op is
never a candidate: the last stage always holds some of the model, not just the loss.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import networkx as nx
import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .staged import stage_boundary

SOURCE, SINK = "__input__", "__output__"


@dataclass
class Capture:
    """The op graph of one model, its cut candidates, and how to instrument it."""

    graph: nx.DiGraph  # op nodes in execution order, attributes: label, kind, has_params
    order: list[str]  # op nodes in execution order (no SOURCE/SINK)
    candidates: list[str]  # cut candidates, in execution order
    method: str  # "fx" or "hooks"
    instrument: Callable[[Sequence[str]], nn.Module] = field(repr=False)
    notes: list[str] = field(default_factory=list)


class CaptureError(Exception):
    """The model could not be captured by this method (the caller may try another)."""


def _dominator_chain(g: nx.DiGraph) -> list[str]:
    """Ops on every SOURCE → SINK path, in path order."""
    relevant = (nx.descendants(g, SOURCE) | {SOURCE}) & (nx.ancestors(g, SINK) | {SINK})
    if SINK not in relevant:
        raise CaptureError("the model's output does not depend on its input")
    idom = nx.immediate_dominators(g.subgraph(relevant), SOURCE)
    chain, node = [], idom[SINK]
    while node != SOURCE:
        chain.append(node)
        node = idom[node]
    return chain[::-1]


def _kind_of_module(m: nn.Module) -> str:
    name = type(m).__name__.lower()
    for key, kind in (("conv", "conv"), ("linear", "linear"), ("norm", "norm"), ("embedding", "embedding"),
                      ("attention", "attention"), ("pool", "pool"), ("relu", "activation"), ("gelu", "activation"),
                      ("dropout", "dropout")):
        if key in name:
            return kind
    return name


def _kind_of_function(name: str) -> str:
    for key, kind in (("conv", "conv"), ("linear", "linear"), ("attention", "attention"), ("softmax", "attention"),
                      ("norm", "norm"), ("pool", "pool"), ("embedding", "embedding")):
        if key in name:
            return kind
    return "op"


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def _is_cut_value(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point()


# --------------------------------------------------------------------------- fx
def capture_fx(module: nn.Module, inputs: Sequence[torch.Tensor]) -> Capture:
    """Trace with torch.fx; raises ``CaptureError`` if fx cannot trace the model."""
    try:
        gm = fx.symbolic_trace(module)
    except Exception as exc:  # fx raises many types (TraceError, TypeError, NotImplementedError, …)
        raise CaptureError(f"torch.fx cannot trace it ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})") from exc
    cut_value: dict[str, bool] = {}

    class Probe(fx.Interpreter):  # one real forward: which values could carry a boundary
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            cut_value[n.name] = _is_cut_value(out)
            return out

    probe = Probe(gm)
    probe.extra_traceback = False
    probe.run(*inputs)
    submodules = dict(gm.named_modules())
    params = {name for name, _ in gm.named_parameters()}
    g = nx.DiGraph()
    g.add_node(SOURCE)
    order: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "output":
            g.add_node(SINK)
            for src in node.all_input_nodes:
                g.add_edge(src.name, SINK)
            continue
        if node.op == "placeholder":
            g.add_node(node.name, label=node.name, kind="input", has_params=False)
            g.add_edge(SOURCE, node.name)
            continue
        if node.op == "get_attr":
            g.add_node(node.name, label=str(node.target), kind="attr", has_params=node.target in params)
            continue
        if node.op == "call_module":
            sub = submodules[node.target]
            label, kind, has_p = str(node.target), _kind_of_module(sub), _has_params(sub)
        else:
            fname = getattr(node.target, "__name__", str(node.target))
            label, kind = fname, _kind_of_function(fname)
            has_p = any(src.op == "get_attr" and src.target in params for src in node.all_input_nodes)
        g.add_node(node.name, label=label, kind=kind, has_params=has_p)
        order.append(node.name)
        for src in node.all_input_nodes:
            g.add_edge(src.name, node.name)
    candidates = [n for n in _dominator_chain(g) if n in order[:-1] and cut_value[n]]

    def instrument(cuts: Sequence[str]) -> nn.Module:
        graph = copy.deepcopy(gm.graph)
        by_name = {n.name: n for n in graph.nodes}
        for k, name in enumerate(cuts, start=1):
            node = by_name[name]
            with graph.inserting_after(node):
                marked = graph.call_function(stage_boundary, (node, k))
            node.replace_all_uses_with(marked, delete_user_cb=lambda user: user is not marked)
        graph.lint()
        return fx.GraphModule(gm, graph, class_name=type(module).__name__ + "Staged")

    return Capture(graph=g, order=order, candidates=candidates, method="fx", instrument=instrument)


# ------------------------------------------------------------------------ hooks
class _TopLevel(TorchFunctionMode):
    """Follows one forward at the model's top level, as a sequence of numbered *events*.

    An event is a call of a module from the model's own ``forward`` (``nn.Sequential``
    containers are opened up, their children called in turn) or a torch function called
    there (``h + block(h)``, ``torch.flatten``).  Module calls are seen by forward hooks on
    every module, functions by this ``TorchFunctionMode``, entered while the root module
    runs.  With ``record`` the data flow between events is kept (``graph``); with ``cuts``
    (event index → stage) the output of those events is passed through ``stage_boundary``.
    The event sequence must be the same at every step: it is checked.
    """

    def __init__(self, root: nn.Module, record: bool = False, cuts: dict[int, int] | None = None) -> None:
        super().__init__()
        self.root, self.record, self.cuts = root, record, cuts or {}
        self.names = {m: n for n, m in root.named_modules()}
        self.expected: int | None = None
        self.graph = nx.DiGraph()
        self.outputs: dict[str, Any] = {}
        self.order: list[str] = []
        self._reset()

    def _reset(self) -> None:
        self.events, self.inside = 0, 0
        self.stack: list[int | None] = []
        self.keep: list[torch.Tensor] = []  # keeps ids valid while recording
        self.origin: dict[int, frozenset[str]] = {}

    # -- recording
    def _producers(self, obj: Any) -> frozenset[str]:
        found: set[str] = set()
        for t in tree_flatten(obj)[0]:
            if isinstance(t, torch.Tensor):
                found |= self.origin.get(id(t), frozenset())
        return frozenset(found)

    def _mark(self, obj: Any, producers: frozenset[str]) -> None:
        for t in tree_flatten(obj)[0]:
            if isinstance(t, torch.Tensor):
                self.keep.append(t)
                self.origin[id(t)] = producers

    def _event(self, label: str, kind: str, has_params: bool, inputs: Any) -> tuple[int, str]:
        e = self.events
        self.events += 1
        name = f"{e}:{label}"
        if self.record:
            self.graph.add_node(name, label=label, kind=kind, has_params=has_params)
            self.order.append(name)
            for src in self._producers(inputs):
                self.graph.add_edge(src, name)
        return e, name

    def _output(self, e: int, name: str, out: Any) -> Any:
        if self.record:
            self.outputs[name] = out
            self._mark(out, frozenset({name}))
        k = self.cuts.get(e)
        if k is not None:
            self.inside += 1  # whatever the listener runs is not a top-level event
            try:
                out = stage_boundary(out, k)
            finally:
                self.inside -= 1
        return out

    # -- module hooks
    def pre(self, m: nn.Module, args: tuple, kwargs: dict) -> None:
        if m is self.root:
            self._reset()
            self.__enter__()
            if self.record:
                self.graph.add_node(SOURCE)
                self._mark((args, kwargs), frozenset({SOURCE}))
            return
        if self.inside or isinstance(m, nn.Sequential):
            self.stack.append(None)
            return
        e, name = self._event(self.names.get(m, type(m).__name__), _kind_of_module(m), _has_params(m), (args, kwargs))
        self.stack.append(e)
        self.inside += 1

    def post(self, m: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        if m is self.root:
            self.__exit__(None, None, None)
            if self.record:
                self.graph.add_node(SINK)
                for src in self._producers(out):
                    self.graph.add_edge(src, SINK)
            if self.expected is not None and self.events != self.expected:
                raise RuntimeError(f"the model's top-level calls changed: {self.events} this step, {self.expected} "
                                   "when it was captured (control flow that depends on the data?)")
            self.keep, self.origin = [], {}
            return None
        e = self.stack.pop()
        if e is None:
            return None
        out = self._output(e, f"{e}:{self.names.get(m, type(m).__name__)}", out)
        self.inside -= 1
        return out

    # -- tensor functions at the top level
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.inside:
            return func(*args, **kwargs)
        label = getattr(func, "__name__", str(func))
        e, name = self._event(label, _kind_of_function(label), False, (args, kwargs))
        return self._output(e, name, func(*args, **kwargs))

    def attach(self) -> list[Any]:
        handles = []
        for m in self.root.modules():
            handles.append(m.register_forward_pre_hook(self.pre, with_kwargs=True))
            handles.append(m.register_forward_hook(self.post, with_kwargs=True, always_call=True))
        return handles


def capture_hooks(module: nn.Module, inputs: Sequence[torch.Tensor]) -> Capture:
    """Capture at the model's top level with hooks and a function mode (see ``_TopLevel``)."""
    tracer = _TopLevel(module, record=True)
    handles = tracer.attach()
    try:
        module(*inputs)
    finally:
        for h in handles:
            h.remove()
    g = tracer.graph
    candidates = [n for n in _dominator_chain(g) if n in tracer.order[:-1] and _is_cut_value(tracer.outputs[n])]
    index = {name: int(name.split(":", 1)[0]) for name in tracer.order}
    events = tracer.events

    def instrument(cuts: Sequence[str]) -> nn.Module:
        runtime = _TopLevel(module, cuts={index[name]: k for k, name in enumerate(cuts, start=1)})
        runtime.expected = events
        runtime.attach()
        return module

    return Capture(graph=g, order=list(tracer.order), candidates=candidates, method="hooks", instrument=instrument)


def capture(module: nn.Module, inputs: Sequence[torch.Tensor], method: str = "auto") -> Capture:
    """Capture with ``method`` (``fx``, ``hooks``, or ``auto``: fx, then hooks if fx fails)."""
    if method == "hooks":
        return capture_hooks(module, inputs)
    try:
        return capture_fx(module, inputs)
    except CaptureError as exc:
        if method == "fx":
            raise
        cap = capture_hooks(module, inputs)
        cap.notes.append(f"{exc}; captured module calls with hooks instead")
        return cap
