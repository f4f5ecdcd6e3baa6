"""``offload profile`` as a function: a model in, a measured ``Chain`` out.

resolve the MODEL → place it on the device → capture its graph → cut it into stages →
measure the step → (if a stage count is asked for: group the finest stages by measured
time and measure again) → find, size and time the encodable storages → platform → ``Chain``.
"""
from __future__ import annotations

import contextlib
import datetime
import platform as pyplatform
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from solver.chain import Chain, Platform, chain_from_dict
from solver.errors import OffloadError

from .bandwidth import measure_platform
from .capture import capture
from .encodable import encodings_pass, stage_encodings
from .linearize import default_cuts, merge_to, stage_model
from .measure import OPTIMIZERS, Measurement, StepRunner, measure
from .models import ModelError, resolve
from .staged import StagedModel
from .zoo import ModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ProfileOptions:
    batch: int
    device: str | None = None  # None: cuda when available
    dtype: str = "float32"
    optimizer: str = "adam"
    repeats: int = 5
    warmup: int = 2
    stages: int | None = None  # target stage count (merged from the finest chain)
    capture: str = "auto"  # auto | fx | hooks
    options: dict[str, Any] = field(default_factory=dict)  # model builder options
    seed: int = 0
    platform: Platform | None = None  # given instead of measured
    name: str | None = None
    encodings: bool = True  # find and measure encodable storages (profiler.encodable)


@dataclass
class Profiled:
    chain: Chain
    staged: StagedModel
    spec: ModelSpec


def pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ModelError(f"unknown device {name!r}: {exc}", "use cpu or cuda (cuda:1 for a second GPU)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda, but this PyTorch sees no CUDA GPU",
                         f"use --device cpu (torch {torch.__version__}, CUDA build: {torch.version.cuda is not None})")
    if device.type not in ("cpu", "cuda"):
        raise ModelError(f"device type {device.type!r} is not supported", "use cpu or cuda")
    return device


@contextlib.contextmanager
def running(what: str) -> Iterator[None]:
    """Turn a failure of the user's model into one clear ``ModelError``."""
    try:
        yield
    except OffloadError:
        raise
    except torch.cuda.OutOfMemoryError as exc:
        raise ModelError(f"{what}: out of GPU memory ({str(exc).splitlines()[0][:200]})",
                         "profiling runs one step without offloading, so it must fit once: use a smaller --batch "
                         "(times and bytes scale about linearly with it) or --dtype bfloat16") from None
    except Exception as exc:
        raise ModelError(f"{what} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
                         "check that the model runs forward and backward on this input; run it by hand for the traceback") from exc


def place(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> None:
    """Move the model and its floating inputs to ``device`` and ``dtype``, in training mode."""
    spec.module.to(device=device, dtype=dtype)
    spec.module.train()
    spec.inputs = tuple(t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) for t in spec.inputs)


def _model_label(model: str) -> str:
    return model.rsplit(":", 1)[-1].rsplit("/", 1)[-1].removesuffix(".py")


def profile(model: str, opts: ProfileOptions, tick: Callable[[str], None] = lambda _: None) -> Profiled:
    """Profile ``model`` and return its measured chain (``tick(phase)`` as each phase ends)."""
    if opts.optimizer not in OPTIMIZERS:
        raise ModelError(f"unknown optimizer {opts.optimizer!r}", f"use one of {', '.join(OPTIMIZERS)}")
    if opts.dtype not in DTYPES:
        raise ModelError(f"unknown dtype {opts.dtype!r}", f"use one of {', '.join(DTYPES)}")
    if opts.repeats < 1:
        raise ModelError(f"--repeats must be at least 1, got {opts.repeats}")
    device = pick_device(opts.device)
    spec = resolve(model, opts.batch, opts.options, opts.seed)
    with running(f"running {model}"):
        place(spec, device, DTYPES[opts.dtype])
        cap = capture(spec.module, spec.inputs, opts.capture)
        tick("capture")
        cuts = cap.candidates if opts.stages else default_cuts(cap)
        staged = stage_model(cap, cuts)
        runner = StepRunner(staged, spec, device, opts.optimizer)
        result = measure(runner, opts.repeats, opts.warmup, tick)
        if opts.stages and opts.stages < staged.L:
            ends = merge_to([s.fwd_s + s.bwd_s for s in result.stages], opts.stages)
            staged = stage_model(cap, [cuts[e] for e in ends])
            runner = StepRunner(staged, spec, device, opts.optimizer)
            result = measure(runner, opts.repeats, opts.warmup, tick)
        elif opts.stages and opts.stages > staged.L:
            staged.notes.append(f"asked for {opts.stages} stages; the model has {staged.L} cut points' worth")
        encodings = [[] for _ in range(staged.L)]
        if opts.encodings:
            encodings = [stage_encodings(s) for s in encodings_pass(runner, staged.L)]
            tick("encodings")
    plat = opts.platform or measure_platform(device)
    tick("platform")
    chain = _to_chain(model, opts, device, staged, result, plat, spec, encodings)
    return Profiled(chain, staged, spec)


def _to_chain(model: str, opts: ProfileOptions, device: torch.device, staged: StagedModel, m: Measurement,
              plat: Platform, spec: ModelSpec, encodings: list[list[dict]]) -> Chain:
    steps = sorted(m.step_s)
    source: dict[str, Any] = {
        "model": model,
        "description": spec.description,
        "options": dict(spec.options),
        "batch": opts.batch,
        "dtype": opts.dtype,
        "optimizer": opts.optimizer,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({pyplatform.processor() or pyplatform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "capture": staged.capture,
        "cuts": staged.cuts,
        "seed": opts.seed,
        "repeats": opts.repeats,
        "warmup": opts.warmup,
        "step_s": {"median": steps[len(steps) // 2], "min": steps[0], "max": steps[-1]},
        "optimizer_step_s": m.optimizer_step_s,
        "base": m.base_parts,
        "profiled_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "measured_by": "offload profile",
    }
    if staged.notes:
        source["notes"] = staged.notes
    doc = {
        "format": "offload-chain/1",
        "name": opts.name or f"{_model_label(model)}-b{opts.batch}",
        "source": source,
        "platform": {"d2h_bytes_per_s": plat.d2h_bytes_per_s, "h2d_bytes_per_s": plat.h2d_bytes_per_s,
                     "latency_s": plat.latency_s, "channels": plat.channels, "note": plat.note},
        "base_bytes": m.base_bytes,
        "stages": [{"name": info.name, "kind": info.kind, "fwd_s": s.fwd_s, "bwd_s": s.bwd_s,
                    "saved_bytes": s.saved_bytes, "fwd_peak_bytes": s.fwd_peak_bytes,
                    "bwd_peak_bytes": s.bwd_peak_bytes, "need_from": s.need_from, "encodings": enc}
                   for info, s, enc in zip(staged.stages, m.stages, encodings)],
    }
    return chain_from_dict(doc)
