"""The executor on CUDA streams (skipped without a GPU): bit-exact gradients, measured peak
within the predicted one plus allocator slack, nothing left behind."""
from __future__ import annotations

import pytest
import torch

from executor.train import TrainOptions, train
from profiler.profile import ProfileOptions, profile
from solver.memory import no_offload_peak, smallest_feasible_budget
from solver.methods import Options, solve

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("model,options", [("resnet18", {"image": 64}),
                                           ("gpt", {"layers": 2, "width": 128, "heads": 4, "seq": 64, "vocab": 500})])
def test_cuda_streams_keep_gradients_bit_exact(model, options):
    chain = profile(model, ProfileOptions(batch=4, device="cuda", repeats=3, options=options)).chain
    budget = (smallest_feasible_budget(chain) + no_offload_peak(chain)) // 2
    sched = solve(chain, budget, "relax-lp", Options()).schedule
    report, error = train(model, chain, sched, TrainOptions(steps=4, device="cuda", check_grads=True))
    assert report["grads_match"] is True and error is None
    m, p = report["measured"], report["predicted"]
    assert m["peak_activation_bytes"] <= p["peak_bytes"] + 16 * 2**20  # allocator rounding and workspaces
    assert m["leaked_bytes_after_step"] <= 2**20
    assert len(set(m["host_allocations"])) == 1
