"""Which saved storages can be encoded, how small they get, and what it costs (docs/encodings.md).

One extra step of the staged model (after the warm-up, like the memory pass):

* a pack hook numbers each stage's storages in the order the forward first saves them,
  which is how the chain and the executor name them (``EncodedTensor.index``);
* after the forward, a walk of the autograd graph lists every node that saved each storage
  (``ReluBackward0._saved_result``, ``ConvolutionBackward0._saved_input``, ...), and is
  checked against the pack hook's count of the saves of each storage: a storage saved more
  often than the walk found readers has a reader nobody can vouch for, and takes no encoder
  that depends on who reads it (``sign-mask``, ``bf16``).  A storage whose every reader
  needs only its sign (ReLU's output, max-pool's input) may take
  ``sign-mask``; any storage may take ``sparse`` (kept where it saves at least 10%; not on a
  GPU, where reading its size back would stall the step: ``encoders.usable_on``); 32- and
  64-bit floats other than normalization statistics may take the lossy ``bf16``;
* each candidate is encoded and decoded on the real tensor, timed (median of 3, CUDA
  synchronized), sized by the blob it produced, and metered for the temporary memory the
  codec needs (its workspace, which the model adds where the codec runs); ``sparse`` must round-trip bit for bit
  (``sign-mask`` is exact only for its readers: the executor's tests compare gradients).

Each stage then offers ``lossless`` (per storage the smallest lossless encoding) and
``lossy`` (the smallest of all, only where it differs), the chain's ``encodings``.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from offload.core import casts
from offload.core.devices import persistent_tensors
from offload.core.encoders import ENCODERS, flat_storage, usable_on
from offload.core.meters import make_meter, timed
from offload.core.staging import StageListener
from offload.core.units import Saved, UnitTracker, plain, storage_key
from offload.models.spec import tensors_in
from offload.step.chain import EncodedTensor, Encoding

from .measure import StepRunner

SIGN_ONLY = {("ReluBackward0", "_saved_result"), ("MaxPool2DWithIndicesBackward0", "_saved_self")}
# normalization statistics (batch/layer norm's saved mean and inverse std, secondary outputs):
# tiny, and a lower precision there is amplified by every element they scale
STATISTICS = re.compile(r"_saved_result\d|mean|invstd|rstd|var")
SPARSE_WORTH = 0.9  # keep ``sparse`` only when the blob is at most this share of the storage


@dataclass
class Candidate:
    encoder: str
    nbytes: int  # the blob
    encode_s: float
    decode_s: float
    workspace_bytes: int  # temporaries of the encoder or decoder, beyond input and output


@dataclass
class SavedStorage:
    index: int  # among the stage's storages, in first-save order
    nbytes: int
    output: bool  # the stage's output (alive in the next stage's forward)
    readers: set[tuple[str, str]] = field(default_factory=set)
    readers_complete: bool = True  # the walk found a reader for every save (module docstring)
    candidates: list[Candidate] = field(default_factory=list)


class _Numbering(StageListener):
    """Boundary listener of the encodings pass: the tracker's current stage, the stage outputs."""

    def __init__(self, L: int, tracker: UnitTracker) -> None:
        self.L, self.tracker = L, tracker
        self.outputs: set[int] = set()
        self.roots: list[Any] = []  # each stage's last node: where the walk of its graph starts

    def stage_output(self, k: int, x: torch.Tensor, opening: bool) -> None:
        if plain(x):
            self.outputs.add(storage_key(x))
        if x.grad_fn is not None:
            self.roots.append(x.grad_fn)

    def forward_boundary(self, k: int) -> None:
        if k < self.L:
            self.tracker.stage = k + 1


def _readers(roots: list[Any]) -> tuple[dict[int, set[tuple[str, str]]], Counter[int]]:
    """Storage key -> the (node type, attribute) pairs that saved it, over the graph below
    ``roots``, and how many saves of each storage the walk found.  (The loss's node alone
    is not enough: on torch 2.11 the walk ended at the first stage boundary's node, so the
    walk starts from every stage's output too.)  The nodes visited are kept alive until the
    walk ends: a node's Python object is made on demand and may die once read, and another
    node's object may then be made at its address, so an ``id`` alone would skip it."""
    found: dict[int, set[tuple[str, str]]] = {}
    saves: Counter[int] = Counter()
    seen: dict[int, Any] = {}
    todo = list(roots)
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        kind = type(node).__name__
        names = [n for n in dir(node) if n.startswith("_saved_")] + (["saved_tensors"] if hasattr(node, "saved_tensors") else [])
        for name in names:
            try:
                value = getattr(node, name)
            except RuntimeError:  # freed or not a tensor
                continue
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and plain(t):  # the rest is never in a unit
                    found.setdefault(storage_key(t), set()).add((kind, name))
                    saves[storage_key(t)] += 1
        todo.extend(fn for fn, _ in getattr(node, "next_functions", ()))
    return found, saves


def _workspace(name: str, flat: torch.Tensor) -> int:
    """The most temporary memory encoding or decoding ``flat`` takes beyond input and output."""
    enc = ENCODERS[name]
    meter = make_meter(flat.device)
    with meter:
        meter.track([flat])
        meter.boundary()
        blob = enc.encode(flat)
        peak, live = meter.boundary()
        enc_ws = peak - live
        back = enc.decode(blob, flat.dtype, flat.numel())
        peak, live = meter.boundary()
        del back, blob
    meter.close()
    return max(enc_ws, peak - live, 0)


def _try(name: str, flat: torch.Tensor, sync: Callable[[], None]) -> Candidate:
    enc = ENCODERS[name]
    blob, enc_s = timed(lambda: enc.encode(flat), sync)
    back, dec_s = timed(lambda: enc.decode(blob, flat.dtype, flat.numel()), sync)
    if enc.round_trips and not torch.equal(back.view(torch.uint8), flat.view(torch.uint8)):
        raise RuntimeError(f"the {name} encoder did not round-trip bit for bit")  # a bug, never data
    return Candidate(name, blob.numel(), enc_s, dec_s, _workspace(name, flat))


def encodings_pass(runner: StepRunner) -> list[list[SavedStorage]]:
    """Per stage, its saved storages with their encoding candidates (module docstring)."""
    persistent = persistent_tensors(runner.spec.module, runner.optimizer, runner.device)
    tracker = runner.tracker(persistent)
    numbering = _Numbering(runner.L, tracker)
    tensors: dict[int, tuple[Saved, torch.Tensor]] = {}
    packed: Counter[int] = Counter()  # saves of each storage, as the pack hook saw them

    def pack(t: torch.Tensor) -> torch.Tensor:
        if plain(t):
            packed[storage_key(t)] += 1
        saved = tracker.saw(t)
        if saved is not None and saved.new:
            tensors[saved.key] = (saved, t)
        return casts.kept(t)

    stages: list[list[SavedStorage]] = [[] for _ in range(runner.L)]
    usable = usable_on(gpu=runner.device.type == "cuda")
    with runner.batch() as (args, kwargs):
        tracker.exclude(tensors_in((args, kwargs)))
        loss = runner.forward(args, kwargs, numbering, pack)
        readers, walked = _readers([loss.grad_fn, *numbering.roots])
        numbering.roots.clear()
        for key, (saved, t) in tensors.items():
            flat = flat_storage(t)
            stored = SavedStorage(saved.index, saved.nbytes, key in numbering.outputs, readers.get(key, set()),
                                  walked[key] >= packed[key])
            known = stored.readers_complete and stored.readers
            names = []
            if t.is_floating_point() and known and stored.readers <= SIGN_ONLY:
                names.append("sign-mask")
            if ENCODERS["sparse"].applies(t.dtype) and ENCODERS["sparse"].size(flat) <= SPARSE_WORTH * stored.nbytes:
                names.append("sparse")
            if ENCODERS["bf16"].applies(t.dtype) and known and not all(STATISTICS.search(a) for _, a in stored.readers):
                names.append("bf16")
            stored.candidates = [_try(n, flat, runner.sync) for n in names if n in usable]
            stages[saved.unit - 1].append(stored)
        tensors.clear()  # the saved tensors' references go before the backward frees them
        loss.backward()
        del loss
    runner.zero_grads()
    return [sorted(s, key=lambda x: x.index) for s in stages]


def stage_encodings(storages: list[SavedStorage]) -> tuple[Encoding, ...]:
    """The ``encodings`` of one stage: ``lossless``, then ``lossy`` where it differs (module docstring)."""
    out: list[Encoding] = []
    for name, lossless in (("lossless", True), ("lossy", False)):
        tensors, enc_s, dec_s = [], 0.0, 0.0
        for s in storages:
            usable = [c for c in s.candidates if ENCODERS[c.encoder].lossless or not lossless]
            if not usable:
                continue
            best = min(usable, key=lambda c: (c.nbytes, c.encode_s + c.decode_s))
            if best.nbytes >= s.nbytes:
                continue
            tensors.append(EncodedTensor(s.index, best.encoder, s.nbytes, best.nbytes, s.output, best.workspace_bytes))
            enc_s += best.encode_s
            dec_s += best.decode_s
        if tensors and not (out and out[0].tensors == tuple(tensors)):
            out.append(Encoding(name, lossless, enc_s, dec_s, tuple(tensors)))
    return tuple(out)
