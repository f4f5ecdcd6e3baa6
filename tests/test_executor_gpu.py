"""The executor on CUDA streams (skipped without a GPU): bit-exact gradients, measured peak
within the predicted one plus allocator slack, nothing left behind."""
from __future__ import annotations

import pytest
import torch

from offload.executor import Offloaded
from offload.executor.train import TrainOptions, train
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.methods import Options, solve
from offload.step.memory import floor_offloads, no_offload_peak, smallest_feasible_budget
from offload.step.schedule import make_schedule
from offload.step.simulate import simulate
from tests.runs import data_parallel, train_on_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("model,options", [("resnet18", {"image": 64}),
                                           ("gpt", {"layers": 2, "width": 128, "heads": 4, "seq": 64, "vocab": 500})])
def test_cuda_streams_keep_gradients_bit_exact(model, options):
    chain = profile(model, ProfileOptions(batch=4, device="cuda", repeats=3, options=options)).chain
    budget = (smallest_feasible_budget(chain) + no_offload_peak(chain)) // 2
    sched = solve(chain, budget, "relax-lp", Options()).schedule
    report, error = train(None, chain, sched, TrainOptions(steps=4, device="cuda", check_grads=True, op_memory=True))
    m, p = report.measured, report.predicted
    # step 1's ops against their predictions, and what stays after each step, name the cause if it fails
    assert report.grads_match is True and error is None, (error, report.over_prediction, m.leaked_by_step)
    assert m.activation_peak_bytes <= p.activation_peak_bytes + 16 * 2**20  # allocator rounding and workspaces
    assert max(m.leaked_by_step) <= 2**20
    assert len(set(m.host_allocations)) == 1
    assert m.warmup_s > 0 and len(m.step_times_s) == 3  # step 1 left out of the step times
    assert m.reserved_peak_bytes >= m.activation_peak_bytes
    assert torch.cuda.max_memory_allocated() >= m.activation_peak_bytes  # the meters' resets undone


def test_cuda_copies_overlap_compute_as_the_simulator_says(tmp_path):
    """The D2H/H2D copies show up in a torch.profiler trace, hidden under kernels about as much
    as the simulator hides them.  (A model whose copies take long enough to need hiding, and
    whose kernels keep the GPU busy: on an H100 a ResNet-18 at batch 16, 64x64, copied
    everything before there was compute to hide it behind, 0% overlap; a ResNet-50 at batch
    32 left the GPU waiting for the host to issue its small kernels, 11.5% against the
    simulator's 72%.  A 4-layer Llama of width 1024 runs large matmuls.)"""
    chain = profile("llama", ProfileOptions(batch=8, device="cuda", repeats=3, options={
        "layers": 4, "width": 1024, "heads": 16, "kv_heads": 16, "seq": 1024, "vocab": 32000})).chain
    budget = (smallest_feasible_budget(chain) + no_offload_peak(chain)) // 2
    sched = solve(chain, budget, "ilp", Options(time_limit_s=30)).schedule
    options = TrainOptions(steps=4, device="cuda", compare=True, trace=str(tmp_path / "t.json"))
    report, error = train(None, chain, sched, options)
    assert error is None and report.measured.d2h_bytes_per_step > 0
    measured, predicted = report.trace["copy_overlap"], report.predicted.copy_overlap
    assert measured is not None and measured["copy_s"] > 0 and predicted is not None and predicted > 0.5
    assert measured["fraction"] >= predicted - 0.2, (measured, predicted)
    assert report.compare["save_on_cpu"].step_s is not None


def test_cuda_lossless_encodings_keep_gradients_bit_exact():
    """Keep-encoded and offload-encoded units on CUDA streams: encoders in pack, decoders in unpack."""
    from offload.step import encoding

    chain = profile("resnet18", ProfileOptions(batch=4, device="cuda", repeats=3, options={"image": 64})).chain
    choice = encoding.smallest(chain, "lossless")
    assert choice
    offloads = floor_offloads(chain)[::2]
    for sched in (make_schedule(chain, [], encode=choice), make_schedule(chain, offloads, encode=choice)):
        report, error = train(None, chain, sched, TrainOptions(steps=3, device="cuda", check_grads=True))
        assert error is None and report.grads_match is True
        m, p = report.measured, report.predicted
        assert m.activation_peak_bytes <= p.activation_peak_bytes + 16 * 2**20


def test_a_step_never_makes_the_host_wait():
    """No pack, unpack, copy, encoder or re-run blocks the thread that launches the step's
    kernels: steps with every encoder a GPU runs (kept, then offloaded) and with recomputed
    stages (their checkpoints kept, then offloaded), under ``torch.cuda.set_sync_debug_mode("error")``, which raises at any call that
    waits for the device (``nonzero``, ``.item()``, a copy to pageable memory, ...).  Step 1
    of each warms up outside it (the pinned arena, the kernels' choices)."""
    from offload.core.encoders import usable_on
    from offload.models import resolve
    from offload.step import encoding
    from offload.step.actions import Recompute, first_checkpoint_release
    from offload.step.recompute import moved_checkpoint_bytes, run_op

    chain = profile("resnet18", ProfileOptions(batch=4, device="cuda", repeats=1, options={"image": 64})).chain
    lossy = encoding.smallest(chain, "lossy")
    assert {t.encoder for i, name in lossy.items() for t in chain.stage(i).encoding(name).tensors} == set(usable_on(gpu=True))
    again = [Recompute(j, j) for j in sorted(chain.recomputable)[::2]]
    moved = [Recompute(r.first, r.last, release=first_checkpoint_release(chain, r), prefetch=run_op(chain, r))
             for r in again if moved_checkpoint_bytes(chain, r)]
    spec = resolve(chain.recipe.model, chain.recipe.batch, dict(chain.recipe.options))
    spec.place(torch.device("cuda"), torch.float32)
    for sched in (make_schedule(chain, [], encode=lossy), make_schedule(chain, floor_offloads(chain), encode=lossy),
                  make_schedule(chain, [], recompute=again), make_schedule(chain, [], recompute=moved)):
        run = Offloaded(spec.module, chain, sched)
        for step in range(3):
            args, kwargs = spec.batch()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if step else "default")
            try:
                spec.loss(run(*args, **kwargs)).backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            spec.zero_grads([p for p in spec.module.parameters()])
        assert run.moved_bytes != (0, 0) or not sched.offloads


@pytest.mark.parametrize("name", ["everything", "solved", "late-release", "recompute", "moved-checkpoints"])
def test_the_fake_cuda_schedules_on_real_cuda(name):
    """The schedules ``tests/test_cudashim.py`` runs on the fake CUDA, on the real one."""
    from test_cudashim import GPT, schedules

    chain = profile("gpt", ProfileOptions(batch=2, device="cuda", repeats=1, warmup=1, options=GPT)).chain
    report, error = train(None, chain, schedules(chain)[name], TrainOptions(steps=3, device="cuda", check_grads=True))
    assert error is None and report.grads_match is True


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_graphs_copies_on_cuda_streams(backend):
    """``compile_scheduled`` with our copy ops on the real CUDA backend: units offloaded and a
    recomputed block offloading its checkpoint, gradients bit for bit those of plain
    ``torch.compile`` (deterministic kernels), the bytes moved each way, and no step after the
    first makes the host wait (``set_sync_debug_mode("error")``)."""
    from dataclasses import replace

    from offload.core.devices import deterministic_kernels
    from offload.executor.compiled import compile_scheduled, plain_compile
    from offload.models import resolve
    from offload.step.actions import Recompute, first_checkpoint_release
    from offload.step.recompute import run_op

    options = {"layers": 3, "width": 128, "heads": 4, "seq": 64, "vocab": 500, "dropout": 0.1}
    chain = profile("gpt", ProfileOptions(batch=4, device="cuda", repeats=1, warmup=1, encodings=False,
                                          options=options)).chain
    i = sorted(chain.recomputable)[1]
    run = replace(Recompute(i, i), release=first_checkpoint_release(chain, Recompute(i, i)),
                  prefetch=run_op(chain, Recompute(i, i)))
    sched = make_schedule(chain, [o for o in floor_offloads(chain) if o.stage != i], recompute=[run])

    def steps(make, strict):
        torch._dynamo.reset()
        torch.manual_seed(1)
        spec = resolve("gpt", 4, options)
        spec.place(torch.device("cuda"), torch.float32)
        module = make(spec.module)
        for step in range(3):
            torch.manual_seed(step)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if step and strict else "default")
            try:
                spec.loss(module(*spec.args)).backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        return module, [p.grad.clone() for p in spec.module.parameters()]
    with deterministic_kernels(torch.device("cuda")):
        _, plain = steps(lambda m: plain_compile(m, backend), False)
        ours, grads = steps(lambda m: compile_scheduled(m, chain, sched, backend=backend), True)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    runtime = ours.partitioner.runtime
    assert runtime.backend.name == "cuda" and runtime.d2h_bytes == runtime.h2d_bytes == 3 * runtime.planned_bytes > 0


def test_a_compiled_llama_with_attention_dropout_keeps_its_random_state_on_the_host():
    """A transformers Llama with attention dropout under Inductor: SDPA saves its random seed
    and offset on the host, where its backward reads them.  Our copies once moved them with
    their unit, and the backward read a device pointer on the host (a segfault of the whole
    process on an H200).  Now they stay: steps run, no host wait after the first, the planned
    bytes move each way, and the loss is finite."""
    from offload.executor.compiled import compile_scheduled
    from offload.models import resolve

    options = {"layers": 2, "width": 256, "heads": 4, "kv_heads": 2, "seq": 128, "vocab": 500, "dropout": 0.1}
    chain = profile("llama", ProfileOptions(batch=2, device="cuda", repeats=1, warmup=1, encodings=False,
                                            options=options)).chain
    torch._dynamo.reset()
    spec = resolve("llama", 2, options)
    spec.place(torch.device("cuda"), torch.float32)
    module = compile_scheduled(spec.module, chain, make_schedule(chain, floor_offloads(chain)))
    for step in range(3):
        args, kwargs = spec.batch()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if step else "default")
        try:
            loss = spec.loss(module(*args, **kwargs))
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        spec.zero_grads(list(spec.module.parameters()))
    assert torch.isfinite(loss).item()
    runtime = module.partitioner.runtime
    assert runtime.backend.name == "cuda" and runtime.d2h_bytes == runtime.h2d_bytes == 3 * runtime.planned_bytes > 0


def test_data_parallel_on_nccl(tmp_path):
    """DDP on either side of ``Offloaded`` and FSDP2 on NCCL, a rank per GPU (one rank where the
    machine has one GPU): gradients and weights bit for bit those without offloading, the
    predicted bytes moved; and ``offload train --nproc`` on the same GPUs."""
    ranks = min(2, torch.cuda.device_count())
    chain = profile("gpt", ProfileOptions(batch=2, device="cuda", repeats=1, options={"layers": 2, "width": 64, "heads": 4,
                                                                                        "seq": 32, "vocab": 100})).chain
    sched = make_schedule(chain, floor_offloads(chain))
    sim = simulate(chain, sched.offloads)
    summary = data_parallel(chain, sched, tmp_path, ["ddp", "ddp-inside", "fsdp2"], nproc=ranks, device="cuda")
    for mode, out in summary.items():
        assert out["ranks"] == ranks and out["mismatches"] == 0 and out["ranks_disagree"] == 0, mode
        assert (out["d2h_bytes"], out["h2d_bytes"]) == (3 * sim.d2h_bytes, 3 * sim.h2d_bytes) != (0, 0), mode
    _, report = train_on_ranks(chain, sched, tmp_path, ranks, "--steps", "3", "--device", "cuda")
    assert report["ranks"] == ranks and report["grads_match"] is True


def test_a_schedule_solved_on_a_chain_of_the_compiled_graph_keeps_its_budget_on_cuda():
    """``--whole-graph`` on CUDA: the marks read the caching allocator's counters on the host
    and time the ops with events; a schedule solved on that chain, run by ``compile_scheduled``,
    peaks at most at its budget (the allocator's own peak), with no host wait in a step."""
    from offload.executor.compiled import compile_scheduled
    from offload.models import resolve
    from offload.core.meters import allocated_peak

    options = {"layers": 4, "width": 256, "heads": 4, "seq": 256, "vocab": 500, "dropout": 0.1}
    chain = profile("gpt", ProfileOptions(batch=8, device="cuda", repeats=3, warmup=1, encodings=False,
                                          options=options, compile="inductor", whole_graph=True,
                                          recompute=False)).chain
    peak, floor = no_offload_peak(chain), smallest_feasible_budget(chain)
    budget = floor + (peak - floor) // 2
    sched = solve(chain, budget, "ilp", Options(time_limit_s=20)).schedule
    assert sched.offloads and all(s.fwd_s > 0 and s.bwd_s > 0 for s in chain.stages)
    torch._dynamo.reset()
    spec = resolve("gpt", 8, options)
    spec.place(torch.device("cuda"), torch.float32)
    module = compile_scheduled(spec.module, chain, sched)
    params = list(spec.module.parameters())
    batch = spec.batch()

    def step():
        spec.zero_grads(params)
        spec.loss(module(*batch[0], **batch[1])).backward()
    step(), step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        measured = allocated_peak(step, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert measured <= budget, (measured, sched.simulate(chain).peak_bytes, budget)
