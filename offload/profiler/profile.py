"""``offload profile`` as a function: a model in, a measured ``Chain`` out.

resolve the MODEL -> place it on the device -> capture its cut sites (one real forward and
loss) -> stage the user's own module at them -> measure the step -> (if a stage count is
asked for: group the finest stages by measured time and measure again) -> find, size and
time the encodable storages -> platform -> ``Chain`` with its recipe, and the warnings a
user should read (a chain that collapsed, timings that disagree).
"""
from __future__ import annotations

import datetime
import functools
import platform as pyplatform
import statistics
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import nn

from offload.core.devices import DTYPES, OPTIMIZERS, pick_device, running
from offload.core.encoders import ENCODERS, usable_on
from offload.core.staging import Staging, compiled
from offload.errors import ModelError, OffloadError, first_line
from offload.executor.copy_cost import copy_host_seconds
from offload.executor.step_costs import step_costs
from offload.io.contention import BUSY_SHARE, CpuWait, busy_warning
from offload.io.text import format_bytes, printable
from offload.models import ModelSpec, resolve
from offload.models.resolve import file_reference, file_sha256
from offload.models.spec import cache_configs, cache_off, check_no_layer_drop, signature
from offload.step.chain import RECORDED_TIMES, Chain, Encoding, Platform, Recipe, Stage, StageOption
from offload.step.chainfile import make_chain
from offload.step.memory import floor_bound_memory, no_offload_peak, op_name, op_transients, smallest_feasible_budget
from offload.step.names import AUTOCAST, COMPILE_BACKENDS, WHOLE_GRAPH_BACKENDS, other_kernels

from .bandwidth import measure_platform
from .capture import Capture, capture
from .encodable import encodings_pass, stage_encodings
from .encoded_memory import measured_encodings
from .linearize import Stages, default_cuts, merge_to, stages_at
from .measure import Measurement, StepRunner, measure, spread
from . import replays
from .compiled import whole_graph_chain
from .selective import selective_pass

SPREAD_WARNING = 0.2  # timed repeats that disagree by more than this share of their median
FLOOR_WARNING = 0.9  # a smallest feasible budget above this share of the peak: offloading can barely help


@dataclass
class ProfileOptions:
    batch: int
    device: str | None = None  # None: cuda when available
    dtype: str = "float32"
    optimizer: str = "adam"
    repeats: int = 5
    warmup: int = 2
    stages: int | None = None  # target stage count (merged from the finest chain)
    options: dict[str, Any] = field(default_factory=dict)  # model builder options
    seed: int = 0
    platform: Platform | None = None  # given instead of measured
    name: str | None = None
    encodings: bool = True  # find and measure encodable storages (profiler.encodable)
    autocast: str | None = None  # "bfloat16" | "float16": forward and loss under torch.autocast
    set_to_none: bool = False  # zero_grad(set_to_none=True) between steps, as the training will
    keep_cache: bool = False  # keep a transformers model's key/value cache on (its config's use_cache=True)
    compile: str | None = None  # measure the model compiled (torch.compile backend), as the training will run it
    split_blocks: bool = False  # cut inside each block too, at its submodules' calls (attention | MLP)
    whole_graph: bool = False  # with compile: the model compiled as one graph (offload.profiler.compiled)
    recompute: bool = True  # measure what recomputing each stage costs (whole_graph: eight more compiles)


@dataclass
class Profiled:
    chain: Chain
    capture: Capture
    stages: Stages
    spec: ModelSpec
    warnings: list[str] = field(default_factory=list)


def _model_label(model: str) -> str:
    """The chain's default name's model part: a zoo or torchvision model's name; for a builder,
    its file's (or module's) name and the function's (``hf_models.build``: builders are often
    all called ``build``, and a sweep's plot titled ``build-b2`` said nothing)."""
    target, _, fn = model.rpartition(":")
    if not target or target == "torchvision":
        return fn
    stem = target.rsplit("/", 1)[-1].removesuffix(".py").rsplit(".", 1)[-1]
    return f"{stem}.{fn}"


def _check(opts: ProfileOptions) -> None:
    if opts.optimizer not in OPTIMIZERS:
        raise ModelError(f"unknown optimizer {opts.optimizer!r}", f"use one of {', '.join(OPTIMIZERS)}")
    if opts.dtype not in DTYPES:
        raise ModelError(f"unknown dtype {opts.dtype!r}", f"use one of {', '.join(DTYPES)}")
    if opts.repeats < 1 or opts.warmup < 0:
        raise ModelError(f"--repeats must be at least 1 and --warmup at least 0, got {opts.repeats} and {opts.warmup}")
    if opts.autocast is not None and opts.autocast not in AUTOCAST:
        raise ModelError(f"unknown autocast dtype {opts.autocast!r}", f"use one of {', '.join(AUTOCAST)}")
    if opts.stages is not None and opts.stages < 1:
        raise ModelError(f"--stages must be at least 1, got {opts.stages}")
    if opts.compile is not None and opts.compile not in COMPILE_BACKENDS:
        raise ModelError(f"unknown compile backend {opts.compile!r}", f"use one of {', '.join(COMPILE_BACKENDS)}")
    if opts.whole_graph and opts.compile not in WHOLE_GRAPH_BACKENDS:
        raise ModelError("--whole-graph profiles the model compiled as one graph, and needs --compile "
                         f"{' or '.join(WHOLE_GRAPH_BACKENDS)}" + (f", not {opts.compile}" if opts.compile else ""),
                         "add --compile inductor")


def _measured(cap: Capture, cuts: list, spec: ModelSpec, device: torch.device, opts: ProfileOptions,
              tick: Callable[[str], None]) -> tuple[Stages, StepRunner, Measurement]:
    stages = stages_at(cap, cuts)
    staging = Staging(spec.module, stages.cuts)
    staging.clear_casts = opts.autocast is not None  # unless measure finds a weight's cast read by two stages
    # and no cast cached at all (eager: a compiled graph holds its casts as its own), unless a weight is cast twice
    staging.uncache_casts = opts.autocast is not None and opts.compile is None
    runner = StepRunner(staging, spec, device, opts.optimizer)
    try:
        return stages, runner, measure(runner, opts.repeats, opts.warmup, tick)
    except BaseException as exc:
        staging.remove()
        # (with --whole-graph these passes run the eager model: its failure is the model's)
        if compiled(spec.module) and not isinstance(exc, (OffloadError, KeyboardInterrupt)) and _runs_unsplit(spec):
            raise ModelError(
                f"torch.compile's {opts.compile} backend fails on this model split at its {stages.L - 1} stage "
                f"boundaries ({type(exc).__name__}: {first_line(exc)}), though the model runs compiled as it is",
                _unsplit_hint(opts.compile)) from exc
        raise


def _unsplit_hint(backend: str) -> str:
    whole = "--whole-graph" if backend in WHOLE_GRAPH_BACKENDS else "--compile inductor --whole-graph"
    split = "" if backend == "inductor" else ", or split under --compile inductor"
    return f"profile the graph of the whole step instead ({whole}){split}"


def _runs_unsplit(spec: ModelSpec) -> bool:
    """Whether the compiled model (hooks removed) runs a forward and backward as it is: a
    failure that only its split at the stage boundaries brings is a compiler's, not the model's."""
    torch._dynamo.reset()
    try:
        args, kwargs = spec.batch()
        _forward_and_loss(spec, args, kwargs).backward()
        return True
    except Exception:
        return False
    finally:
        spec.zero_grads([p for p in spec.module.parameters() if p.requires_grad])


def _forward_and_loss(spec: ModelSpec, args: tuple, kwargs: dict) -> torch.Tensor:
    with spec.autocasting():
        return spec.loss(spec.module(*args, **kwargs))


def recompile_limit_hits() -> int:
    """How often this process's ``torch.compile`` gave up compiling a function again for its
    recompile limit (``torch._dynamo.config.recompile_limit``), running it uncompiled since."""
    from torch._dynamo.utils import counters
    return sum(n for why, n in counters["unimplemented"].items() if why.startswith("Dynamo recompile limit exceeded"))


def _recompile_warning(hits: int) -> list[str]:
    """What to do where the profile's compiles hit the recompile limit: the chain then measured
    some calls compiled and some not, and a training compiled otherwise saves other tensors
    (timm's PoolFormer: its drop-path rate differs from block to block, one compile each, and
    past the 8th the blocks ran uncompiled)."""
    if not hits:
        return []
    from torch._dynamo import config
    return [f"torch.compile hit its recompile limit ({config.recompile_limit}) {hits} time(s): past it a function runs "
            "uncompiled, so this chain measured some calls compiled and some not, and a training that compiles them "
            "otherwise saves other tensors (a value that differs between blocks, such as a per-block drop-path rate, "
            "makes one compile per block): set torch._dynamo.config.recompile_limit above the number of blocks "
            "where the model is built (the profiler imports that file too) and profile again"]


def profile(model: str, opts: ProfileOptions, tick: Callable[[str], None] = lambda _: None) -> Profiled:
    """Profile ``model`` and return its measured chain (``tick(phase)`` as each phase ends)."""
    _check(opts)
    waited = CpuWait()
    limit_hits = recompile_limit_hits()
    device = pick_device(opts.device)
    spec = resolve(model, opts.batch, opts.options, opts.seed)
    spec.autocast, spec.set_to_none = opts.autocast, opts.set_to_none
    check_no_layer_drop(spec.module, model)
    caching = {} if opts.keep_cache else cache_configs(spec.module)
    turned_off = bool(caching)
    if turned_off:
        cache_off(spec.module)

    with running(f"running {model}"):
        spec.place(device, DTYPES[opts.dtype])
        args, kwargs = spec.batch()
        cap = capture(spec.module, functools.partial(_forward_and_loss, spec, args, kwargs), (args, kwargs),
                      split_blocks=opts.split_blocks)
        del args, kwargs  # the batch is not kept through the measurements
        tick("capture")
        user_module = spec.module
        if opts.compile and not opts.whole_graph:  # cut where the eager model says (the capture), measured compiled
            torch._dynamo.reset()
            spec.module = torch.compile(spec.module, backend=opts.compile)
        cuts = cap.candidates if opts.stages else default_cuts(cap)
        if opts.whole_graph:  # one graph has no node at a call that makes none (PoolFormer's nn.Identity res_scale)
            cuts = [cut for cut in cuts if cut not in cap.idle]
        stages, runner, result = _measured(cap, cuts, spec, device, opts, tick)
        if opts.stages and opts.stages < stages.L:
            runner.staging.remove()
            ends = merge_to([s.fwd_s + s.bwd_s for s in result.stages], opts.stages)
            stages, runner, result = _measured(cap, [cuts[e] for e in ends], spec, device, opts, tick)
        elif opts.stages and opts.stages > stages.L:
            stages.notes.append(f"asked for {opts.stages} stages; the model has {stages.L} cut points' worth")
        own = own_checkpointing(cap, stages)
        if own:
            stages.notes.append(own)
        if turned_off:
            stages.notes.append("the model's config asks for a key/value cache (use_cache=True), which a training step "
                                "has no use for and which keeps every block from being recomputed: profiled with "
                                "use_cache=False; train with "
                                + "; ".join(f"model.{name}.use_cache = False" for name in caching)
                                + " (--keep-cache keeps it on)")
        encodings: list[tuple[Encoding, ...]] = [() for _ in range(stages.L)]
        options: list[tuple[StageOption, ...]] = [() for _ in range(stages.L)]
        rerun_host: dict[int, float] = {}
        recording_host: dict[int, float] = {}
        rerun_peak: dict[int, int] = {}
        recorded: dict[int, replays.Times] = {}  # stage -> its times recorded for a re-run, where not as timed
        eager = not opts.whole_graph  # a chain of the compiled graph offers neither encodings nor recomputation
        if opts.encodings and eager:
            encodings = [stage_encodings(s) for s in encodings_pass(runner)]
            left_out = [name for name in ENCODERS if name not in usable_on(gpu=device.type == "cuda")]
            if left_out:
                stages.notes.append(f"encoders not offered on a GPU: {', '.join(left_out)} (each reads its blob's size "
                                    "back from the device, which would stall every step)")
            tick("encodings")
        if not opts.recompute:
            stages.notes.append("recomputation not measured (--no-recompute): the chain offers none")
        elif eager:
            again = [k for k, s in enumerate(result.stages, 1) if k < stages.L and s.recomputable]
            recorded = replays.recorded_times(runner, again, [(s.fwd_s, s.bwd_s) for s in result.stages],
                                              opts.repeats, not other_kernels(opts.compile))
            tick("recorded stages' times")
            options = selective_pass(runner, result.stages, recorded)
            tick("in-stage options")
            rerun_peak = replays.rerun_peaks(runner, dict.fromkeys(again))
            tick("re-runs' memory")
            if device.type == "cuda":
                rerun_host, recording_host = replays.host_seconds(runner, again, min(replays.HOST_PASSES, opts.repeats))
            tick("re-runs' host time")
        runner.staging.remove()
    plat = opts.platform or measure_platform(device)
    tick("platform")
    chain = _to_chain(model, opts, device, stages, result, plat, spec, encodings, options, turned_off,
                      rerun_host, recording_host, rerun_peak, recorded)
    if not opts.recompute:
        chain = replace(chain, stages=tuple(replace(s, recomputable=False) for s in chain.stages))
    if any(s.encodings for s in chain.stages):  # what the executor's encoded units hold, op by op
        chain = _with_encoded_memory(chain, spec, device, model)
        tick("encoded units' memory")
    # the executor's own work, timed in its steps: on CUDA the host's (a given platform is another
    # machine's), on a CPU the ops'
    if eager and (device.type == "cpu" or (device.type == "cuda" and opts.platform is None)):
        chain = _with_step_costs(chain, spec, model, device, max(2, min(opts.repeats, 5)))
        tick("the executor's own work")
    if opts.whole_graph:  # the cuts are the eager profile's; the rest that graph's
        with running(f"running {model}"):
            chain = whole_graph_chain(chain, spec, device, opts.compile, opts.repeats, opts.warmup, tick,
                                      opts.recompute)
    share = waited.share()
    chain = replace(chain, source={**chain.source, "cpu_wait_share": share})
    said = (collapse_warnings(chain, cap, user_module) + busy_warning(share, "the profile")
            + _recompile_warning(recompile_limit_hits() - limit_hits))
    return Profiled(chain, cap, stages, spec, said if opts.whole_graph else said + timing_warnings(result, share))


def _with_encoded_memory(chain: Chain, spec: ModelSpec, device: torch.device, model: str) -> Chain:
    """``chain`` with its encodings' op memory measured (``encoded_memory``); where the executor
    cannot train the model so, their bounds, with a note."""
    return _by_the_executor(chain, model, lambda: measured_encodings(chain, spec, device),
                            "the encoded units' memory could not be measured on this model ({}): their bounds stand")


def _with_step_costs(chain: Chain, spec: ModelSpec, model: str, device: torch.device, steps: int) -> Chain:
    """``chain`` with the executor's own work timed in ``steps`` training steps of the model
    under each plan (``offload.executor.step_costs``): its time per handled saved tensor, the
    platform's ``handle_host_s`` on a GPU; on a CPU, whose host runs the ops, its
    ``handle_device_s``, its ``copy_device_s`` per storage copied (``offload.executor.copy_cost``)
    and each stage's times recorded for a re-run as they ran in those steps
    (``StepCosts.recorded``), at the profile's pace (its options, shares of them, alike).  Where
    the executor cannot train the model so, ``chain`` as it was (nothing charged), with a note."""
    def timed() -> Chain:
        costs = step_costs(spec, chain, steps)
        if device.type != "cpu":
            plat, recorded = replace(chain.platform, handle_host_s=costs.handled_seconds()), {}
        else:  # the copies' own memcpy is the chain's link: storages small enough to leave it out
            pace = costs.pace(chain)
            plat = replace(chain.platform, handle_device_s=pace * costs.handled_seconds(),
                           copy_device_s=pace * copy_host_seconds(device, nbytes=2 ** 10))
            recorded = costs.recorded(chain)
        stages = tuple(_recorded_in_steps(s, *recorded[k]) if k in recorded else s
                       for k, s in enumerate(chain.stages, 1))
        return make_chain(chain.name, stages, plat, chain.base_bytes, chain.source, chain.recipe,
                          chain.workspace_bytes)
    return _by_the_executor(chain, model, timed, "the executor's own work could not be timed on this model ({}): its "
                                                 "time per handled tensor is not charged")


def _recorded_in_steps(stage: Stage, forward: float, rerun: float, backward: float) -> Stage:
    """``stage`` with its times recorded for a re-run as the executor's steps ran them, and its
    options' re-runs and recorded forwards (shares of the stage's) scaled alike."""
    again, ahead = (rerun / stage.rerun if stage.rerun > 0 else 1.0), forward / stage.recorded_fwd
    return replace(stage, recorded_fwd_s=forward, rerun_s=rerun, recorded_bwd_s=backward,
                   options=tuple(replace(o, recompute_s=o.recompute_s * again,
                                         fwd_s=None if o.fwd_s is None else max(forward, o.fwd_s * ahead))
                                 for o in stage.options))


def _by_the_executor(chain: Chain, model: str, measured: Callable[[], Chain], note: str) -> Chain:
    """``measured()``, a chain the executor measured on the model; where it cannot train the
    model so (an ``OffloadError``), ``chain`` with ``note`` (formatted with the error)."""
    try:
        with running(f"running {model}"):
            return measured()
    except OffloadError as exc:
        source = {**chain.source, "notes": [*chain.source.get("notes", ()), note.format(exc)]}
        return make_chain(chain.name, chain.stages, chain.platform, chain.base_bytes, source, chain.recipe,
                          chain.workspace_bytes)


def _to_chain(model: str, opts: ProfileOptions, device: torch.device, stages: Stages, m: Measurement,
              plat: Platform, spec: ModelSpec, encodings: list[tuple[Encoding, ...]],
              options: list[tuple[StageOption, ...]], turned_off: bool, rerun_host: dict[int, float],
              recording_host: dict[int, float], rerun_peak: dict[int, int],
              recorded: dict[int, replays.Times]) -> Chain:
    steps = sorted(m.step_s)
    ref = file_reference(model)
    source: dict[str, Any] = {
        "description": spec.description,
        **({"model_file": str(ref[0].resolve()), "model_file_sha256": file_sha256(ref[0])} if ref else {}),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"cpu ({pyplatform.processor() or pyplatform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "repeats": opts.repeats,
        "warmup": opts.warmup,
        "step_s": {"median": statistics.median(steps), "min": steps[0], "max": steps[-1],
                   "spread": spread(steps)},
        "optimizer_step_s": m.optimizer_step_s,
        **({"plain_step_s": {"median": statistics.median(m.plain_step_s), "min": min(m.plain_step_s),
                             "max": max(m.plain_step_s)}} if m.plain_step_s else {}),
        "base": m.base_parts,
        "profiled_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "measured_by": "offload profile",
    }
    if stages.notes or m.notes:
        source["notes"] = stages.notes + m.notes
    if stages.crossing:  # boundaries that several values cross (offload show prints them)
        source["crossing"] = {str(k): values for k, values in stages.crossing.items()}
    recipe = Recipe(model=model, batch=opts.batch, options=dict(spec.options), dtype=opts.dtype, seed=opts.seed,
                    optimizer=opts.optimizer, cuts=tuple(c.text for c in stages.cuts),
                    inputs=signature(spec.args, spec.kwargs), autocast=opts.autocast,
                    set_to_none=opts.set_to_none, cache_off=turned_off, casts_cleared=m.casts_cleared,
                    casts_uncached=m.casts_uncached,
                    compile=opts.compile)
    rows = [Stage(name=info.name, kind=info.kind, fwd_s=s.fwd_s, bwd_s=s.bwd_s, saved_bytes=s.saved_bytes,
                  fwd_peak_bytes=s.fwd_peak_bytes, bwd_peak_bytes=s.bwd_peak_bytes, need_from=s.need_from, encodings=enc,
                  held_bytes=s.held_bytes, held_until=s.held_until, input_bytes=s.input_bytes,
                  recomputable=s.recomputable, rerun_output=s.rerun_output or not s.recomputable,
                  carry_bytes=s.carry_bytes, bwd_start_bytes=s.bwd_start_bytes,
                  recomputed_fwd_peak_bytes=s.recomputed_fwd_peak_bytes if s.recomputable else None,
                  rerun_peak_bytes=rerun_peak.get(k),
                  input_carried_bytes=s.input_carried_bytes, input_held_bytes=s.input_held_bytes,
                  rerun_held_bytes=s.rerun_held_bytes if s.recomputable else 0,
                  input_own_bytes=s.input_own_bytes if s.recomputable else 0,
                  input_prev_bytes=s.input_prev_bytes if s.recomputable else 0,
                  input_prev_held_bytes=s.input_prev_held_bytes if s.recomputable else 0,
                  fwd_host_s=s.fwd_host_s, bwd_host_s=s.bwd_host_s, rerun_host_s=rerun_host.get(k, 0.0),
                  recording_host_s=recording_host.get(k, 0.0),
                  **dict(zip(RECORDED_TIMES, recorded.get(k, (None, None, None)))),
                  cast_bytes=s.cast_bytes, recast_s=min(s.recast_s, s.bwd_s) if s.cast_bytes else 0.0, options=opt,
                  shared_saves=s.shared_saves, dropped_saves=s.dropped_saves,
                  held_saves=s.held_saves, held_read_at=s.held_read_at,
                  storages=s.storages, saves=s.saves, fwd_start_bytes=s.fwd_start_bytes,
                  carried_early_bytes=s.carried_early_bytes,
                  carried_late_bytes=s.carried_late_bytes, input_late_bytes=s.input_late_bytes,
                  held_late_bytes=s.held_late_bytes, input_held_late_bytes=s.input_held_late_bytes)
            for k, (info, s, enc, opt) in enumerate(zip(stages.stages, m.stages, encodings, options), 1)]
    return make_chain(opts.name or f"{_model_label(model)}-b{opts.batch}", rows, plat, m.base_bytes, source, recipe,
                      m.workspace_bytes)


def _block_lists(module: nn.Module) -> list[tuple[str, int]]:
    """Containers of repeated blocks (ModuleList/Sequential of at least 3 children of one class)."""
    out = []
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.ModuleList, nn.Sequential)) and len(sub) >= 3:
            kinds = Counter(type(c).__name__ for c in sub)
            kind, count = kinds.most_common(1)[0]
            if count >= 3 and any(True for _ in sub[0].parameters()):
                out.append((name, count))
    return out


def _block_spans(cap: Capture, container: str) -> dict[str, tuple[int, int]]:
    """Per block of ``container`` (its index) that has ops in the captured graph, the first
    and last of them in forward order.  The capture holds the differentiable ops alone: a block
    that computes without gradient (frozen, its input needing none) has none."""
    g, pos = cap.graph, {n: k for k, n in enumerate(cap.order)}
    prefix = f"{container}." if container else ""
    spans: dict[str, list[int]] = {}
    for node in cap.order:
        rest = g.nodes[node]["module"][len(prefix):] if g.nodes[node]["module"].startswith(prefix) else ""
        block = rest.split(".")[0]
        if block.isdigit():
            spans.setdefault(block, []).append(pos[node])
    return {block: (min(v), max(v)) for block, v in spans.items()}


def _bypass(cap: Capture, spans: dict[str, tuple[int, int]]) -> str | None:
    """The op whose value jumps over the most of these blocks (made before a block's first op,
    read after its last): the shared value that leaves no block's output a cut."""
    g, pos = cap.graph, {n: k for k, n in enumerate(cap.order)}
    bounds = list(spans.values())
    jumps: Counter[str] = Counter()
    for u, v in g.edges:
        if u in pos and v in pos:
            over = sum(pos[u] < lo and hi < pos[v] for lo, hi in bounds)
            if over:
                jumps[f"{g.nodes[u]['op']} in {g.nodes[u]['module'] or 'the model'}"] += over
    return jumps.most_common(1)[0][0] if jumps else None


def _floor_holder(chain: Chain) -> str:
    """Which op holds the smallest feasible budget, and how much of it is its own temporary memory."""
    mem = floor_bound_memory(chain, recompute=False)
    o = int(mem.argmax())
    own = int(op_transients(chain)[o])
    i = o + 1 if o < chain.L else 2 * chain.L - o
    return (f"{op_name(chain, o)} ({printable(chain.stage(i).name)}) holds it, {format_bytes(own)} of it the op's own "
            "temporary memory, which no schedule moves")


def _checkpointed(cap: Capture, ops: list[int]) -> bool:
    """Whether any of the captured ``ops`` ran under the model's own activation checkpointing."""
    return any(cap.graph.nodes[op].get("checkpointed") for op in ops)


def own_checkpointing(cap: Capture, stages: Stages) -> str:
    """Where stages run under the model's own activation checkpointing (``torch.utils.checkpoint``,
    transformers' ``gradient_checkpointing_enable()``), the note that says what that fixes
    and how to let the solver choose instead; else ''.  Such a stage keeps only what enters
    its checkpoint and runs it again in its backward, at every budget: its unit is small, its
    backward's peak holds the whole region, and the profile of a transformers Qwen2 so had
    its smallest budget at 90% of that model's peak."""
    fixed = [k for k, st in enumerate(stages.stages, 1) if _checkpointed(cap, st.ops)]
    if not fixed:
        return ""
    names = stages.stages[fixed[0] - 1].name + (f" .. {stages.stages[fixed[-1] - 1].name}" if len(fixed) > 1 else "")
    return (f"{len(fixed)} of {stages.L} stages ({names}) run under the model's own activation checkpointing "
            "(torch.utils.checkpoint): each keeps only its checkpoint's input and runs its forward again in its "
            "backward, whatever the budget; the solver weighs that choice per stage beside offloading (recomputing "
            "every block is one of its schedules): profile the model with its checkpointing off (transformers: "
            "model.gradient_checkpointing_disable(), activation_checkpointing_disable() in recent versions) and "
            "solve with --recompute")


def collapse_warnings(chain: Chain, cap: Capture, module: nn.Module) -> list[str]:
    """Say so when the chain has far fewer stages than the model has blocks, or when offloading
    can barely lower the peak, naming what blocks the cuts (a value read past them, or blocks
    that compute without gradient) and what to do."""
    out: list[str] = []
    collapsed = inert = False
    for name, count in _block_lists(module):
        spans = _block_spans(cap, name)
        if len(spans) < count and not inert:
            inert = True
            unseen = [block for i, block in enumerate(module.get_submodule(name)) if str(i) not in spans]
            why = ("(frozen, with an input that needs none)" if not any(
                p.requires_grad for block in unseen for p in block.parameters()) else
                   "though their weights train (they run where autograd records nothing: under torch.no_grad, or "
                   "inside a custom autograd Function that runs them again in its backward, as a reversible network "
                   "such as Reformer's does)")
            out.append(f"{count - len(spans)} of the {count} blocks of {name or 'the model'} compute without gradient "
                       f"{why}: they save nothing for the backward, so there is nothing "
                       "in them to offload or recompute, and no stage ends among them; their forward's temporary memory "
                       "counts in the stage that runs them, whatever the schedule")
        if not collapsed and len(spans) >= 2 and chain.L < len(spans) // 2 + 1:
            collapsed = True
            cause = _bypass(cap, spans)
            trained = f"{len(spans)} blocks" + (" that compute with gradient" if len(spans) < count else "")
            out.append(f"the chain has {chain.L} stages but {name or 'the model'} has {trained}: no cut was found "
                       "between them" + (f"; the value of {cause} is read past them" if cause else "")
                       + ". Inside a block, a cut needs one value that every later computation reads; inputs without "
                       "gradient (masks, positions) do not block it, a differentiable value shared by the layers does. "
                       "Blocks (modules held in a ModuleList or Sequential, not inside another block) are cut whatever "
                       "crosses them, the layers inside one only there")
    peak, floor = no_offload_peak(chain), smallest_feasible_budget(chain)
    if peak and floor > FLOOR_WARNING * peak:
        own = _checkpointed(cap, cap.order)
        out.append(f"the smallest feasible budget is {100 * floor / peak:.0f}% of the no-offload peak: "
                   f"{_floor_holder(chain)}; offloading can barely help with these stages "
                   + ("(the model checkpoints its own layers, each backward running its forward again: profile it "
                      "with its checkpointing off and solve with --recompute; `offload show` names them)" if own else
                      "(a smaller batch lowers it)" if inert else
                      "(too few cuts, or one op holds most of the memory); try --stages with more stages, or a smaller batch"))
    return out


def timing_warnings(m: Measurement, cpu_wait_share: float | None = None) -> list[str]:
    """Say so when the timed repeats disagree: the chain's times are medians.  Where the profile's
    threads hardly waited for a CPU (``cpu_wait_share``, ``offload.io.contention``), other
    processes are not why, and the warning says so rather than blame a busy machine."""
    s = spread(m.step_s)
    if len(m.step_s) < 2 or s <= SPREAD_WARNING:
        return []
    if cpu_wait_share is not None and cpu_wait_share <= BUSY_SHARE:
        why = (f"not other processes (its threads waited for a CPU {cpu_wait_share:.0%} of the time they ran): the "
               "machine's own pace varies (its clock, caches, memory), or the steps were still warming up")
    else:
        why = "the machine is busy or warming up"
    return [f"the {len(m.step_s)} timed steps disagree by {100 * s:.0f}% of their median "
            f"({min(m.step_s):.3g}-{max(m.step_s):.3g} s): {why}; stage times are medians, more --repeats "
            "make them trustworthy"]
