"""Models as users write them (Hugging Face transformers, built from small configs, dropout on,
keyword inputs, the loss from ``output.loss``): profiled into a stage per block, solved,
trained with gradients bit for bit those of training without offloading and every op's
measured memory equal to the prediction, in both CPU backends; the same with half the
blocks frozen."""
from __future__ import annotations

import pytest

from offload.executor.train import TrainOptions, train
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.memory import no_offload_peak, smallest_feasible_budget
from offload.solver.methods import Options, solve

pytest.importorskip("transformers")

MODELS = {
    "gpt2": {"layers": 6, "width": 64, "heads": 2, "seq": 128, "vocab": 128},
    "llama": {"layers": 6, "width": 64, "heads": 4, "kv_heads": 2, "seq": 128, "vocab": 128},
    "bert": {"layers": 3, "width": 64, "heads": 2, "seq": 128, "vocab": 128},
    "vit": {"layers": 6, "width": 48, "heads": 2, "image": 32, "patch": 4},
}
TOLERANCE = 64 * 1024


@pytest.fixture(scope="module")
def profiled():
    """``profiled(model, frozen)``: the chain, profiled once per module."""
    cache = {}

    def chain(model, frozen=0):
        if (model, frozen) not in cache:
            options = {**MODELS[model], "frozen": frozen}
            cache[model, frozen] = profile(model, ProfileOptions(batch=2, repeats=1, warmup=1, options=options)).chain
        return cache[model, frozen]
    return chain


@pytest.mark.parametrize("model", list(MODELS))
def test_a_stage_per_block(profiled, model):
    chain = profiled(model)
    assert chain.L >= MODELS[model]["layers"] + 1
    assert smallest_feasible_budget(chain) < 0.5 * no_offload_peak(chain)


def _run(chain, share_of_range, backend):
    floor, peak = smallest_feasible_budget(chain), no_offload_peak(chain)
    budget = floor + int(share_of_range * (peak - floor)) if share_of_range is not None else int(0.5 * peak)
    sched = solve(chain, budget, "ilp", Options(time_limit_s=30, heuristic_time_s=0.1)).schedule
    assert sched.offloads, "the schedule moves nothing"
    report, error = train(None, chain, sched, TrainOptions(steps=3, backend=backend, check_grads=True, op_memory=True))
    assert error is None
    assert report["grads_match"] is True, report["grad_mismatches"]
    m, p = report["measured"], report["predicted"]
    assert m["peak_bytes"] <= budget and abs(m["peak_bytes"] - p["peak_bytes"]) <= TOLERANCE
    assert (m["d2h_bytes_per_step"], m["h2d_bytes_per_step"]) == (p["d2h_bytes"], p["h2d_bytes"])
    off = {op: p["op_bytes"][op] - b for op, b in m["op_peak_bytes"].items() if p["op_bytes"][op] != b}
    assert all(abs(d) <= TOLERANCE for d in off.values()), off


@pytest.mark.parametrize("backend", ["cpu-eager", "cpu-lazy"])
@pytest.mark.parametrize("model", list(MODELS))
def test_trains_bit_exact_at_half_the_peak(profiled, model, backend):
    _run(profiled(model), None, backend)


@pytest.mark.parametrize("model", list(MODELS))
def test_half_the_blocks_frozen(profiled, model):
    """Frozen blocks save nothing for backward (their floor is higher): halfway from the floor to the peak."""
    _run(profiled(model, MODELS[model]["layers"] // 2), 0.5, "cpu-lazy")
