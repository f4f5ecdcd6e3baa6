"""The executor in your own training loop: ``Offloaded`` wraps the module a chain was profiled from.

``offload train`` runs synthetic steps of a named model; a real job has its own data,
loss, optimizer, scheduler and logging.  ``Offloaded`` gives it the schedule and nothing
else to learn::

    model = build_model().cuda()                   # the module `offload profile` measured
    run = Offloaded(model, "chain.json", "schedule.json")
    for x, y in loader:
        loss = loss_fn(run(x), y)                  # the forward offloads as scheduled
        loss.backward()                            # the backward prefetches as scheduled
        optimizer.step(); optimizer.zero_grad(set_to_none=False)

``Offloaded`` is an ``nn.Module`` holding the user's module (``run.module``), so its
parameters are the model's: the optimizer, ``DDP(run)``, ``state_dict`` and ``.to()`` see
them.  Stage boundaries are forward hooks on the chain's cut sites of the module itself
(``offload.core.staging``): its forward, hooks and checkpointing run as written.  Nothing
runs at construction: the chain's recipe says where to cut, and the schedule is checked to
belong to the chain.  Every forward checks its batch against the profiled one.
"""
from __future__ import annotations

import contextlib
import os
import time
import warnings
from typing import Any, Iterator

import torch
from torch import nn

from offload.core.devices import persistent_tensors
from offload.core.meters import make_meter
from offload.core.staging import Site, Staging, compiled, unwrap
from offload.errors import ChainMismatch
from offload.models.spec import cache_configs, check_no_layer_drop, signature
from offload.step.chain import Chain
from offload.step.chainfile import load_chain
from offload.step.names import other_kernels
from offload.step.schedule import Schedule
from offload.step.schedulefile import load_schedule

from .backends import make_backend
from .distributed import buckets_rebuilt
from .plan import StepPlan
from .report import Report
from .runtime import OffloadRuntime

PathLike = str | os.PathLike


def cut_sites(chain: Chain) -> list[Site]:
    """Where ``chain``'s stages end in its model (its recipe's cut sites), or ``ChainMismatch``."""
    if chain.recipe is None:
        raise ChainMismatch(f"chain {chain.name!r} has no recipe (profiled by an older version, or not from a model): "
                            "it says where to cut the model", "profile the model again with `offload profile`")
    sites = [Site.parse(c) for c in chain.recipe.cuts]
    if len(sites) != chain.L - 1:
        raise ChainMismatch(f"chain {chain.name!r} has {chain.L} stages but {len(sites)} cut sites", "profile again")
    return sites


def stage_like_chain(module: nn.Module, chain: Chain) -> Staging:
    """Boundaries on ``module`` at ``chain``'s cut sites, or ``ChainMismatch`` saying why not."""
    sites = cut_sites(chain)
    try:
        staging = Staging(module, sites)
    except KeyError as exc:
        raise ChainMismatch(f"the model cannot be staged like chain {chain.name!r}: {exc.args[0]}",
                            "the chain was profiled from another model or version: profile it again") from None
    staging.clear_casts = chain.recipe.casts_cleared  # as profiled: the chain's memory counts on it
    staging.uncache_casts = chain.recipe.casts_uncached  # the same
    return staging


def chain_and_schedule(chain: Chain | PathLike, schedule: Schedule | PathLike) -> tuple[Chain, Schedule]:
    """The chain and the schedule, loaded where paths are given, and checked: the schedule is
    the chain's, and the simulator replays it (a schedule built in code is refused here if it
    is outside the class)."""
    chain = chain if isinstance(chain, Chain) else load_chain(chain)
    schedule = schedule if isinstance(schedule, Schedule) else load_schedule(schedule, chain)
    if schedule.chain_sha256 != chain.sha256:
        raise ChainMismatch(f"the schedule was made for chain {schedule.chain_name!r}, not for {chain.name!r} "
                            "(sha256 differs)", "solve again on this chain")
    schedule.simulate(chain)
    return chain, schedule


def _check_compiled(module: nn.Module, chain: Chain) -> None:
    """A chain profiled compiled is refused for a module that is not (its eager stages save more
    than the compiled ones the chain counts); the other way round, a warning: the chain's
    memory and times are the eager model's (the runtime still stops a stage that saves other
    bytes than profiled)."""
    backend = chain.recipe.compile if chain.recipe is not None else None
    if backend and chain.recipe.whole_graph:
        raise ChainMismatch(f"chain {chain.name!r} was profiled from the model compiled as one graph (--whole-graph): "
                            "its units are that graph's, which Offloaded's stage boundaries would break",
                            "run it with offload.executor.compile_scheduled(model, chain, schedule), or profile "
                            "without --whole-graph")
    if backend and not compiled(module):
        raise ChainMismatch(f"chain {chain.name!r} was profiled compiled (torch.compile, backend {backend!r}); this "
                            "module is not", f"wrap torch.compile(model, backend={backend!r}) (before its first call), "
                            "or profile without --compile")
    if not backend and compiled(module):
        warnings.warn(f"this module is compiled; chain {chain.name!r} was profiled from the eager model, so its "
                      "memory and times are the eager model's: profile with --compile BACKEND to predict this run",
                      stacklevel=3)


def _warn_eager_reruns(module: nn.Module, chain: Chain, schedule: Schedule) -> None:
    """A stage recomputed under ``torch.compile`` runs eagerly while it is recorded (the
    recorder's hooks see no compiled code: ``rerun._EagerWhileRecording``), and so do its
    re-run and its backward: under a backend whose kernels are not the eager ones, a chain
    profiled now times them so (``recorded_bwd_s``); one profiled before does not, and the
    user hears of it once, with what to do."""
    backend = chain.recipe.compile if chain.recipe is not None else None
    untimed = sorted({k for r in schedule.recompute for k in r.stages if chain.stage(k).recorded_bwd_s is None})
    if compiled(module) and untimed and other_kernels(backend):
        warnings.warn(f"the schedule recomputes stage(s) {', '.join(map(str, untimed))}: under torch.compile each runs "
                      "eagerly (recorded for its re-run by hooks, which compiled code does not run), not with "
                      f"{backend}'s kernels, and the chain does not time them so (profiled before it did): the step "
                      "may take longer than predicted; profile again, or recompute inside the compiled graph with "
                      "compile_scheduled (a chain profiled with --whole-graph)", stacklevel=3)


def _device_of(module: nn.Module) -> torch.device:
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


class Offloaded(nn.Module):
    """``module`` with ``schedule`` applied at every forward and its backward.

    ``chain`` and ``schedule``: objects or JSON paths.  ``backend``: ``cuda`` (side streams;
    the default on a GPU), ``cpu-eager`` (the default on the CPU) or ``cpu-lazy`` (the
    checking backend of the tests).  Under ``torch.no_grad()`` the module runs plainly."""

    def __init__(self, module: nn.Module, chain: Chain | PathLike, schedule: Schedule | PathLike,
                 backend: str | None = None) -> None:
        super().__init__()
        if isinstance(unwrap(module), Offloaded):
            raise ValueError("this module is already offloaded: wrap the user's module once")
        self.chain, self.schedule = chain_and_schedule(chain, schedule)
        caching = cache_configs(unwrap(module)) if self.chain.recipe is not None and self.chain.recipe.cache_off else {}
        if caching:
            lines = "; ".join(f"model.{name}.use_cache = False" for name in caching)
            raise ChainMismatch("the model's config asks for a key/value cache (use_cache=True); the chain was "
                                f"profiled with it off: set {lines} before training",
                                "a training step has no use for the cache, and it keeps every block from being "
                                "recomputed (transformers turns it off under gradient checkpointing too)")
        check_no_layer_drop(unwrap(module), "this model")
        _check_compiled(module, self.chain)
        _warn_eager_reruns(module, self.chain, self.schedule)
        self.module = module
        self.freed_grads = 0  # forwards that found the gradients freed where the chain counts them allocated
        device = _device_of(module)
        self.runtime = OffloadRuntime(stage_like_chain(module, self.chain),
                                      StepPlan.from_schedule(self.chain, self.schedule), make_backend(backend, device),
                                      device)

    @torch.compiler.disable(recursive=False)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward, offloading as scheduled (plainly under ``torch.no_grad()``).

        Under ``torch.compile(run)`` this frame runs eagerly and the module's frames compile,
        with a graph break at each stage boundary."""
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        self._check_batch(args, kwargs)
        return self.runtime.forward(args, kwargs)

    @torch.compiler.disable
    def _check_batch(self, args: tuple, kwargs: dict) -> None:
        """The batch's names, dtypes and shapes, the autocast state and (for a chain profiled
        with freed gradients) the gradients, as profiled."""
        expected = self.chain.recipe.inputs
        got = signature(args, kwargs)
        if expected and got != expected:
            raise ChainMismatch(f"this batch is {', '.join(got)}; the chain was profiled with {', '.join(expected)}",
                                "a schedule is made for one batch shape: profile and solve again for this one, or pad "
                                "the batch")
        kind = self.runtime.device.type
        autocast = str(torch.get_autocast_dtype(kind)).removeprefix("torch.") if torch.is_autocast_enabled(kind) else None
        if autocast != self.chain.recipe.autocast:
            def say(dtype: str | None) -> str:
                return f"under autocast to {dtype}" if dtype else "without autocast"
            raise ChainMismatch(f"this forward runs {say(autocast)}; the chain was profiled {say(self.chain.recipe.autocast)}",
                                "profile with the autocast the training uses (offload profile --autocast DTYPE)")
        # Gradients kept allocated while the chain counts them only from the backward on would
        # put the whole step over its prediction.
        if not self.chain.recipe.set_to_none:  # the other way round it holds more than predicted: said by measured()
            trained = next((p for p in self.module.parameters() if p.requires_grad), None)
            self.freed_grads += trained is not None and trained.grad is None
        elif any(p.grad is not None for p in self.module.parameters()):
            raise ChainMismatch("the gradients are allocated at this forward; the chain was profiled with them freed "
                                "between steps (set_to_none), so it does not count them before the backward",
                                "call optimizer.zero_grad() (set_to_none=True) before each forward, or profile "
                                "without --set-to-none")

    @contextlib.contextmanager
    def measured(self, optimizer: torch.optim.Optimizer | None = None) -> Iterator[Report]:
        """Measure the training steps run in this block, next to the chain's prediction::

            with run.measured(optimizer) as report:
                for x, y in batches: ...           # forward, backward, optimizer step
            print(report.measured.activation_peak_bytes, report.predicted.activation_peak_bytes)

        On exit the ``Report`` (``offload.executor.report``, the one ``offload train`` writes)
        holds ``steps_done``, ``measured`` (the activation peak: the most bytes live on the
        device during any forward or backward op, above what was live as that op's forward
        began, as the profile measured it: the batch, made before the block or in it, and
        the optimizer's state, made by its first step, are not activations, which the chain
        counts beside the batch and in its base; the optimizer step is left out, as in the
        chain; with ``base_bytes`` the total peak; the bytes moved and the seconds, per step,
        the optimizer step included) and ``predicted`` (the simulator's), and, when the
        measured activation peak is above the predicted one, ``over_prediction``: by how much
        and why when known (also a warning: plain ``zero_grad()`` on a chain that counts the
        gradients as allocated, say; DDP inside laying its buckets out anew in its second
        step: warm up two steps under DDP).  On a GPU the
        allocator's counters measure (each op boundary synchronizes the device;
        ``reserved_peak_bytes`` is what the allocator held, its slack included; the steps'
        time includes the first, so warm up before the block; the device's peak counter
        ``torch.cuda.max_memory_allocated()`` is restored after it); on the CPU exact tensor
        accounting does, which slows the steps."""
        runtime = self.runtime
        meter = make_meter(runtime.device)
        meter.ignore(runtime.arena.chunks)  # host memory, even when the device is the CPU
        meter.track(persistent_tensors(self.module, optimizer, runtime.device))
        steps, moved = runtime.steps, (runtime.d2h_bytes, runtime.h2d_bytes, runtime.encoded_bytes)
        freed, rebuilt = self.freed_grads, buckets_rebuilt(self.module)
        report = Report.start(self.chain, self.schedule, runtime.backend.name, runtime.device)
        try:  # every op read at its end, the optimizer step left out
            with meter, runtime.reading(meter, lambda: meter.live - start) as op_peaks:
                start = meter.live
                t0 = time.perf_counter()
                yield report
                seconds = time.perf_counter() - t0
        finally:
            meter.close()
        done = runtime.steps - steps
        per = max(done, 1)
        report.steps = report.steps_done = done
        m = report.measured
        m.step_s = seconds / per
        m.set_peak(max(op_peaks.values(), default=start) - start, self.chain)
        m.reserved_peak_bytes, m.host_arena_bytes = meter.reserved_peak, runtime.arena.nbytes
        m.host_arena_grown_bytes = runtime.arena.grown
        report.judge_peak(freed_grads=self.freed_grads - freed, rebuilt_buckets=buckets_rebuilt(self.module) - rebuilt)
        m.d2h_bytes_per_step, m.h2d_bytes_per_step, m.encoded_bytes_per_step = (
            (now - before) // per for now, before in zip((runtime.d2h_bytes, runtime.h2d_bytes, runtime.encoded_bytes),
                                                         moved))

    @property
    def moved_bytes(self) -> tuple[int, int]:
        """Bytes copied so far: (device to host, host to device)."""
        return self.runtime.d2h_bytes, self.runtime.h2d_bytes
