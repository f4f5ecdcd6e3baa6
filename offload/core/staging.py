"""Stage boundaries on the user's own module: the seam the profiler and the executor share.

A chain's stages end at *call sites*: a submodule's path in the model and which of its
calls in one forward (``Site``), chosen by the profiler's capture.  ``Staging`` puts a
forward hook on each such submodule of the user's module (a forward pre-hook where the
stage ends as the call starts, on its input: ``Site.before``); while a listener is attached
and the model's forward runs, the hook tells the listener of the stage's end in the forward
(``forward_boundary(k)``) and adds a hook to the value that crosses the boundary, which
tells it of the end of stage ``k+1``'s backward (``backward_boundary(k)``, just before
stage ``k``'s backward): the value itself goes on, and the graph is the model's own.  A
value that is a view or a leaf goes through an identity autograd function instead, whose
backward fires where a hook may not (an in-place op on a view later rewrites its history;
a leaf lives on from step to step).

The *turn* (the end of the last stage's forward, the start of the backward) is the model's
output: ``forward_boundary(L)`` when the forward returns, ``backward_boundary(L)`` once,
when the first of the output's differentiable values receives its gradient
(``register_multi_grad_hook``, mode ``any``): the loss may be computed inside the model
(``labels=``) or by the training loop from any part of the output.

Nothing else changes: the user's forward, its other hooks, checkpointing and compilation
run as written, and calls after the forward (a checkpoint's recomputation in the
backward) pass no boundary.  Without a listener the hooks return the output untouched.
The listener is held by this object and by the hook on each boundary's value, never in a
thread-local: the backward may run on another thread (CUDA's autograd device threads).
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from offload.errors import CallsDiffer

from .rerun import EAGER_WHILE_RECORDING, stage_hook


@dataclass(frozen=True, order=True)
class Site:
    """A submodule call in one forward: ``module`` (its path, ``""`` the root), ``occurrence``
    (0: its first call), ``leaf`` (which value of its output, in pytree order); ``before``:
    the boundary is at the call's start, on its input ``leaf`` (of its ``(args, kwargs)``, in
    pytree order), not at its end: a block whose input the model's own code makes outside
    any module call (an encoder's positions added and dropped out before its first layer)."""

    module: str
    occurrence: int = 0
    leaf: int = 0
    before: bool = False

    @property
    def text(self) -> str:
        """``h.3``, ``relu@2`` (third call), ``block@0[1]`` (second output value),
        ``layers.0:in`` (the start of the call, on its first input)."""
        out = self.module + (f"@{self.occurrence}" if self.occurrence or self.leaf else "")
        return out + (":in" if self.before else "") + (f"[{self.leaf}]" if self.leaf else "")

    @classmethod
    def parse(cls, text: str) -> "Site":
        """The inverse of ``text``; ``ValueError`` for anything else."""
        body, leaf = text, 0
        if body.endswith("]") and "[" in body:
            body, _, index = body[:-1].rpartition("[")
            leaf = int(index)
        before = body.endswith(":in")
        body = body.removesuffix(":in")
        name, at, occurrence = body.rpartition("@")
        if not at:
            return cls(body, 0, leaf, before)
        return cls(name, int(occurrence), leaf, before)


class StageListener:
    """Told where the computation is: subclass and override what you need.

    ``forward_boundary(k)`` runs when the forward of stage ``k`` has ended (``1 <= k <= L``,
    ``L``: the model returned), ``backward_boundary(k)`` when the backward of stage ``k+1``
    has ended, just before the backward of stage ``k`` (``k = L``: the backward starts).
    ``enclosing``: set by ``Staging.listening``: per stage ``k`` (index ``k - 1``), the modules
    whose calls may still run where the stage ends (its boundary's ancestors in the module
    tree), whose own torch calls a ``StageRecorder`` records; ``None`` under a compiled module
    (Dynamo would trace the recorder's mode, and compile the model again).
    """

    enclosing: list[frozenset[nn.Module]] | None = None

    def encloses(self, k: int) -> frozenset[nn.Module] | None:
        """The modules whose calls may still run where stage ``k`` ends (``enclosing``)."""
        return self.enclosing[k - 1] if self.enclosing is not None and k <= len(self.enclosing) else None

    def forward_start(self) -> None:
        """The model's forward begins (stage 1 starts)."""

    def forward_boundary(self, k: int) -> None:  # pragma: no cover - default no-op
        pass

    def backward_boundary(self, k: int) -> None:  # pragma: no cover - default no-op
        pass

    def stage_output(self, k: int, x: torch.Tensor, opening: bool) -> None:
        """The value stage ``k`` hands to stage ``k+1`` (called just before ``forward_boundary``);
        ``opening``: stage ``k+1`` begins with a module call that is starting now (a boundary at
        a call's start, ``Site.before``), whose start the module hooks added from here miss."""


def stage_boundary(x: torch.Tensor, k: int, listener: StageListener, opening: bool = False) -> torch.Tensor:
    """The end of stage ``k``'s forward on its output ``x`` (``opening``: at a call's start): the
    listener hears it now, and ``backward_boundary(k)`` once ``x``'s gradient is whole.
    Returns ``x`` itself, heard by a hook (``_BackwardBoundaries``); a view or a leaf, the
    value of an identity function (``_Boundary``)."""
    listener.stage_output(k, x, opening)
    listener.forward_boundary(k)
    if not x.requires_grad:  # nothing flows back through here (a frozen prefix)
        return x
    if x._is_view() or x.is_leaf:
        return _Boundary.apply(x, k, listener)
    _BackwardBoundaries.on(x, listener).ks.append(k)
    return x


class _Boundary(torch.autograd.Function):
    """An identity function whose backward is the boundary's, for a value that is a view or a
    leaf: an in-place op on a view later (Hubert masks its projected features, a view of a
    matmul's output, in place) rewrites its history, and the node a hook was on never runs; a
    leaf (a weight handed on as it is) lives on, and a hook on it would be added every step.
    It returns ``x.detach()``, which is no view, so such an op stays legal and runs through
    this node.  It adds a node: ``Staging`` takes every reference to ``x`` in the call's
    values through it, so that their gradients are summed as the model's were."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: int, listener: StageListener) -> torch.Tensor:
        ctx.k, ctx.listener = k, listener
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.listener.backward_boundary(ctx.k)
        return grad, None, None


class _BackwardBoundaries:
    """The boundaries a value crosses, heard in the backward by a hook on the value itself:
    it runs as the value's gradient is whole, just before the op that made it runs its
    backward.  No node is added to the graph, so the backward runs as the model's own would,
    the same ops in the same order: an identity autograd function at each boundary did not
    (a Funnel decoder layer called on one tensor as query, key and value, cut at its start,
    took one of the three through it and the others not, and the sums of their gradients
    came out in another order: 63 weights' gradients off by rounding, 1.2e-7), and the
    model's code may hold the value elsewhere too.  One hook per value: one that crosses
    several boundaries (a stage that hands its input on as it is) hears them in backward
    order, the latest first, where hooks run in the order they were added."""

    ATTRIBUTE = "_offload_backward_boundaries"

    def __init__(self, listener: StageListener) -> None:
        self.listener = listener  # held by the hook, as the graph holds it, until the backward
        self.ks: list[int] = []

    @classmethod
    def on(cls, x: torch.Tensor, listener: StageListener) -> "_BackwardBoundaries":
        """The boundaries ``x`` crosses for ``listener``: made, and its hook added, at the first."""
        found = getattr(x, cls.ATTRIBUTE, None)
        if found is None or found.listener is not listener:
            found = cls(listener)
            setattr(x, cls.ATTRIBUTE, found)
            x.register_hook(found)
        return found

    def __call__(self, grad: torch.Tensor) -> None:
        for k in reversed(self.ks):
            self.listener.backward_boundary(k)


def unwrap(module: nn.Module) -> nn.Module:
    """The user's module inside wrappers that hold it as an attribute and call it whole:
    ``torch.compile``'s ``OptimizedModule``, ``DistributedDataParallel``, ``DataParallel``.
    (FSDP2's ``fully_shard`` and ``module.compile()`` change the module in place.)"""
    while True:
        if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
            module = module._orig_mod
        elif isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            module = module.module
        else:
            return module


def compiled(module: nn.Module) -> bool:
    """Whether ``module`` runs compiled: ``torch.compile(m)`` (inside a data-parallel wrapper or
    not) or ``m.compile()``."""
    while isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        module = module.module
    return (isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
            or getattr(module, "_compiled_call_impl", None) is not None)


def is_staged(module: nn.Module) -> bool:
    """Whether ``module`` (or the module inside its wrapper) has a ``Staging``'s boundaries on it."""
    return any(isinstance(getattr(hook, "__self__", None), Staging) for hook in unwrap(module)._forward_pre_hooks.values())


def _ancestors(paths: dict[str, nn.Module], path: str) -> frozenset[nn.Module]:
    """The modules above ``path``'s module in the module tree (``paths``: every path to every
    module), the root included (not itself), along every path to it: a module registered
    twice (T5's shared embedding, the encoder's ``embed_tokens`` too) is called from below either."""
    target = paths[path]
    out = set()
    for p, m in paths.items():
        if m is target:
            parts = p.split(".") if p else []
            out.update(paths[".".join(parts[:n])] for n in range(len(parts)))
    return frozenset(out)


class Staging:
    """Boundaries at ``sites`` (stage ``k`` ends at ``sites[k-1]``) on ``module`` itself (on the
    module inside it when it is a wrapper, ``unwrap``; the wrapper is what runs)."""

    def __init__(self, module: nn.Module, sites: Sequence[Site]) -> None:
        self.module, self.sites = module, list(sites)
        self.L = len(self.sites) + 1
        root = unwrap(module)
        modules = dict(root.named_modules())
        missing = [s.text for s in self.sites if s.module not in modules]
        if missing:
            raise KeyError(f"no submodule {missing[0]!r} in {type(root).__name__}")
        paths = dict(root.named_modules(remove_duplicate=False))
        self._enclosing = [_ancestors(paths, s.module) for s in self.sites]
        # module -> occurrence -> (k, leaf): boundaries at calls' ends, and at their starts
        self.cuts: dict[str, dict[int, tuple[int, int]]] = {}
        self.openings: dict[str, dict[int, tuple[int, int]]] = {}
        for k, s in enumerate(self.sites, start=1):
            (self.openings if s.before else self.cuts).setdefault(s.module, {})[s.occurrence] = (k, s.leaf)
        self.listener: StageListener | None = None
        # Under autocast: forget the cached weight casts at each inner forward boundary, so that
        # a layer's casts die with its stage (offload.core.casts); only where no weight's cast is
        # read by two stages (a second cast would change its gradient's rounding)
        self.clear_casts = False
        # Under autocast: no cache of weight casts at all while the module's forward runs, so
        # that each cast dies with its reader; only where no weight is cast twice (read by two
        # ops: a second cast would change its gradient's rounding).  Restored as the forward ends
        self.uncache_casts = False
        self._cache_was: bool | None = None  # autocast's cache setting, while turned off
        self.calls: Counter[str] = Counter()  # calls ended in this forward, per module
        self.started: Counter[str] = Counter()  # calls started, per module with a boundary at its start
        self.seen = 0  # boundaries passed in the current forward
        self.forwarding = False
        self._handles = [root.register_forward_pre_hook(self._begin),
                         root.register_forward_hook(self._end)]
        for name in self.cuts:
            self._handles.append(modules[name].register_forward_hook(self._hook(name, opening=False)))
        for name in self.openings:
            self._handles.append(modules[name].register_forward_pre_hook(self._hook(name, opening=True),
                                                                         with_kwargs=True))

    @property
    def enclosing(self) -> list[frozenset[nn.Module]] | None:
        """``StageListener.enclosing``: ``None`` while any of the module's calls runs compiled
        (asked at each forward: ``module.compile()`` may come after the boundaries)."""
        root = unwrap(self.module)
        if compiled(self.module) or any(compiled(m) for m in root.modules()):
            return None
        return self._enclosing

    def remove(self) -> None:
        """Take the hooks off the module."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def listening(self, listener: StageListener) -> Iterator[None]:
        """Route the boundaries of the forwards (and their backwards) in this block to ``listener``."""
        previous, self.listener = self.listener, listener
        listener.enclosing = self.enclosing
        try:
            yield
        finally:
            self.listener = previous
            self._recache()  # a forward that raised

    def _uncache(self) -> None:
        if self.uncache_casts and self._cache_was is None:
            self._cache_was = torch.is_autocast_cache_enabled()
            torch.set_autocast_cache_enabled(False)

    def _recache(self) -> None:
        if self._cache_was is not None:
            torch.set_autocast_cache_enabled(self._cache_was)
            self._cache_was = None

    # -- hooks (under torch.compile each runs eagerly: a graph break at every boundary keeps
    # compiled regions inside stages, and the listener's copies out of the graph)
    @stage_hook
    def _begin(self, module: nn.Module, args: tuple) -> None:
        EAGER_WHILE_RECORDING.forward_begins()
        if self.listener is not None:
            self.calls.clear()
            self.started.clear()
            self.seen, self.forwarding = 0, True
            self._uncache()
            self.listener.forward_start()

    @stage_hook
    def _end(self, module: nn.Module, args: tuple, out: Any) -> Any:
        listener = self.listener
        if listener is None or not self.forwarding:
            return None
        self.forwarding = False
        self._recache()
        if self.seen != self.L - 1:
            passed = f"{self.seen} of the {self.L - 1} stage boundaries were passed in this forward"
            if self.seen or not compiled(self.module):
                raise CallsDiffer(f"{passed}: the model's calls differ from the profiled ones")
            raise RuntimeError(f"{passed}: if the model was compiled (torch.compile, .compile()), its compiled code does "
                               "not see hooks added after its first call: wrap it before its first compiled call, or "
                               "call torch._dynamo.reset() first")
        listener.forward_boundary(self.L)
        grads = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if grads:
            torch.autograd.graph.register_multi_grad_hook(grads, lambda _: listener.backward_boundary(self.L), mode="any")
        return None

    def _hook(self, name: str, opening: bool):
        """The hook on ``name``'s calls: at their start (``opening``: a forward pre-hook, the
        boundary on an input of its ``(args, kwargs)``) or at their end (on its output)."""
        counts, table = (self.started, self.openings) if opening else (self.calls, self.cuts)

        @stage_hook
        def hook(module: nn.Module, args: tuple, values: Any) -> Any:  # values: the kwargs, or the output
            if self.listener is None or not self.forwarding:
                return None
            n = counts[name]
            counts[name] += 1
            cut = table[name].get(n)
            if cut is None:
                return None
            return self._pass((args, values) if opening else values, cut, opening)
        return hook

    def _pass(self, values: Any, cut: tuple[int, int], opening: bool) -> Any:
        """``values`` (a call's output, or its ``(args, kwargs)``) with leaf ``cut[1]`` passed
        through boundary ``cut[0]``."""
        k, leaf = cut
        if k != self.seen + 1:
            raise CallsDiffer(f"stage boundary {k} came after {self.seen}: the model's calls differ from the profiled "
                              "ones")
        self.seen = k
        leaves, spec = tree_flatten(values)
        value = leaves[leaf]
        crossed = stage_boundary(value, k, self.listener, opening)
        if crossed is not value:  # every reference to it (a layer called with it as query, key and value)
            leaves = [crossed if v is value else v for v in leaves]
        if self.clear_casts:
            torch.clear_autocast_cache()
        return tree_unflatten(leaves, spec)
