"""What an encoded unit's ops hold, measured with the encoding on (docs/encodings.md, "The model").

The encodings pass (``encodable``) sizes each blob and its codec's workspace, from which the
chain's first account of an encoding is an upper bound: ``Fi`` holds the encoded copies and
the workspace on top of its raw peak, ``F(i+1)`` the covered raw output, and ``Bi ..
B(need_i)`` the decoded storages and the workspace.  The executor does better: it encodes in
the pack hook, so a covered raw storage dies as soon as the forward drops it, and it frees a
decoded storage once its last reader has read it.  How much better depends on where in each
op its peak falls (on a 6-layer Llama a block's `lossless` held 357 KiB less than the bound in
``Fi`` and in ``Bi``), so it is measured:

* one training step of the profiled model under the executor with nothing encoded, and one
  with each group of stages encoded with one of their encodings (kept, not moved), every op's
  peak metered, the same random draws in every step (dropout's zeros size a ``sparse`` blob);
* a group's stages are far enough apart that no op is in two of their windows (``Fi``,
  ``F(i+1)``, ``Bi .. B(need_i)``): for most chains the odd and the even stages;
* an op's measured change between the two steps, less the change the chain predicts, corrects
  what the encoding's window holds there (``Encoding.fwd_held_bytes``, ``next_held_bytes``,
  ``bwd_held_bytes``), so the chain predicts each op of those steps as measured.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from offload.core.devices import persistent_tensors
from offload.core.meters import make_meter
from offload.core.rng import forked_rng
from offload.executor.api import Offloaded
from offload.models.spec import ModelSpec, tensors_in
from offload.step.chain import Chain, Encoding
from offload.step.chainfile import make_chain
from offload.step.schedule import Schedule, make_schedule

SEED = 0  # every metered step draws the same random numbers


def measured_encodings(chain: Chain, spec: ModelSpec, device: torch.device) -> Chain:
    """``chain`` with each encoding's op memory measured on ``spec`` (module docstring).

    Args:
        chain: the profiled chain, its encodings sized by the encodings pass.
        spec: the profiled model on ``device``, its batch and loss.
        device: where the steps run.

    Returns:
        The chain, every encoding carrying what its ops hold (unchanged without encodings).
    """
    names = sorted({e.name for s in chain.stages for e in s.encodings})
    if not names:
        return chain
    plain = _op_changes(chain, spec, device, {})
    measured: dict[tuple[int, str], Encoding] = {}
    for name in names:
        offered = [i for i, s in enumerate(chain.stages, 1) if any(e.name == name for e in s.encodings)]
        for group in _groups(chain, offered):
            changes = _op_changes(chain, spec, device, {i: name for i in group})
            for i in group:
                measured[i, name] = _corrected(chain, i, chain.stage(i).encoding(name),
                                               {op: changes[op] - plain[op] for op in changes})
    stages = [replace(s, encodings=tuple(measured.get((k, e.name), e) for e in s.encodings))
              for k, s in enumerate(chain.stages, 1)]
    return make_chain(chain.name, stages, chain.platform, chain.base_bytes, chain.source, chain.recipe,
                      chain.workspace_bytes)


def _window(chain: Chain, i: int) -> set[str]:
    """The ops whose memory an encoding of stage ``i`` changes beyond its unit's size."""
    ops = {f"F{i}", *(f"B{j}" for j in range(i, chain.stage(i).need_from + 1))}
    return ops | ({f"F{i + 1}"} if i < chain.L else set())


def _groups(chain: Chain, stages: list[int]) -> list[list[int]]:
    """``stages`` in groups whose windows do not meet (first fit, in order)."""
    groups: list[tuple[list[int], set[str]]] = []
    for i in stages:
        ops = _window(chain, i)
        group = next((g for g in groups if not g[1] & ops), None)
        if group is None:
            groups.append(([i], ops))
        else:
            group[0].append(i)
            group[1].update(ops)
    return [g[0] for g in groups]


def _corrected(chain: Chain, i: int, e: Encoding, error: dict[str, int]) -> Encoding:
    """``e`` holding in each op of its window what it held over the prediction (``error``: per op,
    measured less predicted, both as changes from the step with nothing encoded); an op frees at
    most the covered bytes (a reading below is the meter's noise: the larger value is kept)."""
    need = chain.stage(i).need_from

    def held(bound: int, op: str) -> int:
        return max(bound + error[op], -e.covered_bytes)
    return replace(e, fwd_held_bytes=held(e.fwd_extra_bytes, f"F{i}"),
                   next_held_bytes=held(e.next_extra_bytes, f"F{i + 1}") if i < chain.L else None,
                   bwd_held_bytes=tuple(held(e.bwd_extra(j - i), f"B{j}") for j in range(i, need + 1)))


def _op_changes(chain: Chain, spec: ModelSpec, device: torch.device, choice: dict[int, str]) -> dict[str, int]:
    """Per op, its measured peak less the simulator's, in one step with ``choice`` encoded: the
    part of an op's memory the chain does not predict."""
    schedule = make_schedule(chain, [], encode=choice)
    predicted = {o.name: o.mem_bytes for o in schedule.simulate(chain).ops}
    measured = _op_peaks(chain, spec, device, schedule)
    return {op: measured[op] - predicted[op] for op in predicted}


def _op_peaks(chain: Chain, spec: ModelSpec, device: torch.device, schedule: Schedule) -> dict[str, int]:
    """Each op's peak (bytes, from the meter's start) in a training step of ``schedule`` (the
    profile's steps warmed the model up: a first step of the executor measures as a later one)."""
    run = Offloaded(spec.module, chain, schedule)
    args, kwargs = spec.batch()
    meter = make_meter(device)
    try:
        with forked_rng(device), meter, \
                run.runtime.reading(meter) as peaks:
            torch.manual_seed(SEED)
            meter.track(persistent_tensors(spec.module, None, device) + tensors_in((args, kwargs)))
            meter.boundary()
            with spec.autocasting():
                loss = spec.loss(run(*args, **kwargs))
            loss.backward()
            del loss
            run.runtime.synchronize()
        spec.zero_grads(list(spec.module.parameters()))
        return dict(peaks)
    finally:
        meter.close()
        run.runtime.staging.remove()
