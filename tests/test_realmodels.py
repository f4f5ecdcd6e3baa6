"""Models as users write them (Hugging Face transformers, built from small configs, dropout on,
keyword inputs, the loss from ``output.loss``): profiled into a stage per block, solved,
trained with gradients bit for bit those of training without offloading and every op's
measured memory equal to the prediction, in both CPU backends; the same with half the
blocks frozen, and with the decoder blocks recomputed; a key/value cache keeps them from
being recomputed."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from offload.core.devices import persistent_tensors
from offload.core.meters import make_meter
from offload.errors import ChainMismatch
from offload.executor import Offloaded
from offload.executor.train import TrainOptions, train
from offload.models import resolve
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.methods import Options, solve
from offload.step import encoding
from offload.step.actions import Offload, Recompute
from offload.step.memory import floor_offloads, no_offload_peak, smallest_feasible_budget
from offload.step.schedule import make_schedule
from tests.runs import ROOT, TOLERANCE, check_run, moved_as_predicted, ops_off_prediction, recomputing

pytest.importorskip("transformers")

MODELS = {
    "gpt2": {"layers": 6, "width": 64, "heads": 2, "seq": 128, "vocab": 128},
    "llama": {"layers": 6, "width": 64, "heads": 4, "kv_heads": 2, "seq": 64, "vocab": 128},
    "bert": {"layers": 3, "width": 64, "heads": 2, "seq": 128, "vocab": 128},
    "vit": {"layers": 6, "width": 48, "heads": 2, "image": 32, "patch": 4},
}


@pytest.fixture(scope="module")
def profiled():
    """``profiled(model, **options)``: the chain, profiled once per module."""
    cache = {}

    def chain(model, keep_cache=False, **options):
        key = (model, keep_cache, *sorted(options.items()))
        if key not in cache:
            options = {**MODELS[model], **options}
            cache[key] = profile(model, ProfileOptions(batch=2, repeats=1, warmup=1, options=options,
                                                       keep_cache=keep_cache)).chain
        return cache[key]
    return chain


@pytest.mark.parametrize("model", list(MODELS))
def test_a_stage_per_block(profiled, model):
    chain = profiled(model)
    assert chain.L >= MODELS[model]["layers"] + 1
    assert smallest_feasible_budget(chain) < 0.5 * no_offload_peak(chain)


def _run(chain, share_of_range, backend, encodings="lossless"):
    floor, peak = smallest_feasible_budget(chain), no_offload_peak(chain)
    budget = floor + int(share_of_range * (peak - floor)) if share_of_range is not None else int(0.5 * peak)
    sched = solve(chain, budget, "ilp", Options(time_limit_s=30, heuristic_time_s=0.1, encodings=encodings)).schedule
    assert sched.offloads, "the schedule moves nothing"
    report, error = train(None, chain, sched, TrainOptions(steps=3, backend=backend, check_grads=True, op_memory=True))
    assert error is None
    assert report.grads_match is True, report.grad_mismatches
    m, p = report.measured, report.predicted
    plan = [(o.stage, o.release, o.prefetch) for o in sched.offloads]  # for the failure message
    assert m.activation_peak_bytes <= budget and abs(m.activation_peak_bytes - p.activation_peak_bytes) <= TOLERANCE, (plan, m.op_peak_bytes, p.op_bytes)
    assert moved_as_predicted(chain, sched, (m.d2h_bytes_per_step, m.h2d_bytes_per_step),
                              (p.d2h_bytes_per_step, p.h2d_bytes_per_step))
    off = {op: p.op_bytes[op] - b for op, b in m.op_peak_bytes.items() if p.op_bytes[op] != b}
    assert all(abs(d) <= TOLERANCE for d in off.values()), off


SLOW = pytest.mark.slow  # the same path as the other models' in make test; make test-all runs them


def test_an_encoded_units_ops_hold_what_the_chain_predicts(profiled):
    """The profiler measures what an encoded unit's ops hold (``offload.profiler.encoded_memory``):
    the bound it replaces booked a Llama block kept ``lossless`` 357 KiB above what its forward
    and its backward held.  Every block encoded, kept or offloaded: each op at its prediction,
    within the tolerance below it and the variable blobs' eighth above it."""
    chain = profiled("llama")
    choice = encoding.smallest(chain, "lossless")
    assert len(choice) >= MODELS["llama"]["layers"]
    for sched in (make_schedule(chain, [], encode=choice), make_schedule(chain, floor_offloads(chain), encode=choice)):
        report, error = train(None, chain, sched, TrainOptions(steps=1, backend="cpu-eager", op_memory=True))
        assert error is None
        assert not ops_off_prediction(report), (sched.offloads, ops_off_prediction(report))


@pytest.mark.parametrize("model, backend", [("llama", "cpu-eager")]  # cpu-lazy: the frozen and recomputed llama
                         # a decoder as llama, encoders as T5's (tests/test_non_chains.py): make test-all
                         + [pytest.param(m, "cpu-eager", marks=SLOW) for m in ("gpt2", "bert", "vit")]
                         + [pytest.param(m, "cpu-lazy", marks=SLOW) for m in MODELS])
def test_trains_bit_exact_at_half_the_peak(profiled, model, backend):
    _run(profiled(model), None, backend)


@pytest.mark.parametrize("model", ["llama", *(pytest.param(m, marks=SLOW) for m in ("gpt2", "bert", "vit"))])
def test_half_the_blocks_frozen(profiled, model):
    """Frozen blocks save nothing for backward (their floor is higher): halfway from the floor to the peak.
    Offloading alone: under load the time-limited solve may return a schedule that keeps a
    unit encoded, whose forward the model books with the blobs on top of the raw storages it
    measured (docs/encodings.md, "The model"): safe, but the executor's raw storages are gone
    by the peak, so not within this test's tolerance, and not what this test is about."""
    _run(profiled(model, frozen=MODELS[model]["layers"] // 2), 0.5, "cpu-lazy", encodings="none")


@pytest.mark.parametrize("dropout, backend", [pytest.param(0.1, "cpu-eager", marks=SLOW),  # time: make test keeps
                                              pytest.param(0.1, "cpu-lazy", marks=SLOW),  # T5's blocks re-run with
                                              pytest.param(0.0, "cpu-lazy", marks=SLOW)])  # dropout (test_non_chains)
def test_llama_blocks_recomputed_bit_exact(profiled, dropout, backend):
    """Re-run decoder blocks (rotary tables and masks held, keyword calls) replay their
    attention-dropout masks; without dropout SDPA takes its fused kernel, which saves its own
    statistics, and the replay saves the same."""
    chain = profiled("llama", dropout=dropout)
    assert len(chain.recomputable) >= MODELS["llama"]["layers"]
    ways = recomputing(chain)
    for name in ways if backend == "cpu-lazy" else ["blocks+offload"]:  # its runs of sqrt(L) stages: make test-all
        check_run(chain, ways[name], backend, name)


@SLOW  # make test-all (time)
def test_a_key_value_cache_is_turned_off_for_training(profiled):
    """transformers configs default to ``use_cache=True``: the profiler turns the cache off (one
    note, ``cache_off`` in the recipe), so every block is recomputable; offload train does the
    same and trains a recomputing schedule bit for bit; Offloaded refuses the model as built,
    its cache still on, with the line to add."""
    chain = profiled("llama", cache=True)
    assert chain.recipe.cache_off and chain.recipe != profiled("llama").recipe
    assert len(chain.recomputable) >= MODELS["llama"]["layers"]
    assert any("profiled with use_cache=False" in note for note in chain.source["notes"])
    check_run(chain, recomputing(chain)["blocks+offload"], "cpu-eager", "cache turned off")
    spec = resolve("llama", 2, {**MODELS["llama"], "cache": True})
    with pytest.raises(ChainMismatch, match="model.config.use_cache = False"):
        Offloaded(spec.module, chain, make_schedule(chain, []))
    spec.module.config.use_cache = False
    Offloaded(spec.module, chain, make_schedule(chain, []))


def test_a_stacks_own_copy_of_the_config_has_its_cache_turned_off_too():
    """Switch Transformers' decoder stack keeps a copy of the config and reads its ``use_cache``:
    with only the model's turned off, it still built a cache and handed it to every block, so
    no decoder block could be re-run ("a call takes a EncoderDecoderCache argument"); every
    config the model holds is turned off, the note names each, and Offloaded names each that
    is still on."""
    chain = profile(str(ROOT / "tests" / "models" / "switch.py:build"),
                    ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False)).chain
    decoder = [k for k, cut in enumerate(chain.recipe.cuts, 1) if cut.startswith("decoder.block.")]
    assert decoder and set(decoder) <= chain.recomputable
    assert any("model.decoder.config.use_cache = False" in note for note in chain.source["notes"])
    spec = resolve(str(ROOT / "tests" / "models" / "switch.py:build"), 2, {})
    spec.module.config.use_cache = False
    with pytest.raises(ChainMismatch, match=r"set model\.decoder\.config\.use_cache = False before"):
        Offloaded(spec.module, chain, make_schedule(chain, []))


def test_a_key_value_cache_kept_keeps_blocks_from_being_recomputed(profiled):
    """``--keep-cache``: every attention call appends to the cache, so a re-run would see another
    cache; the profiler says so and the executor refuses."""
    chain = profiled("llama", keep_cache=True, cache=True)
    assert not chain.recipe.cache_off
    assert len(chain.recomputable) < MODELS["llama"]["layers"]
    assert any("use_cache=False" in note for note in chain.source["notes"])
    block = min(set(range(1, chain.L)) - chain.recomputable)
    forced = dataclasses.replace(chain, stages=[dataclasses.replace(s, recomputable=True) for s in chain.stages])
    _, error = train(None, forced, make_schedule(forced, [], recompute=[Recompute(block, block)]), TrainOptions(steps=1))
    assert isinstance(error, ChainMismatch) and "use_cache=False" in str(error), error


@pytest.mark.slow  # the cache test below recomputes and offloads a llama in make test; this one adds bf16 autocast
def test_llama_in_bf16_autocast_recomputed_and_offloaded_bit_exact():
    """The setup that reported differing gradients on an H100 (shared/gpu: a 16-layer Llama,
    SDPA, bf16 autocast, joint schedule): attention dropout on, every block re-run under the
    autocast and random state recorded at its forward, the rest offloaded.  On the CPU the
    replay is exact: gradients bit for bit, and no op above its prediction.  (Not as close as
    in fp32, where every op is within 36 KiB: under autocast the rebuilt blocks' backward ops
    are predicted 0.25-0.5 MB above the measure, 4-7.5% of the peak: the memory model of a
    re-run under autocast over-counts, a gap recorded for issue #36.)"""
    chain = profile("llama", ProfileOptions(batch=2, repeats=1, warmup=1, autocast="bfloat16",
                                            options={**MODELS["llama"], "dropout": 0.1})).chain
    assert chain.recipe.autocast == "bfloat16" and len(chain.recomputable) >= MODELS["llama"]["layers"]
    runs = [Recompute(i, i) for i in sorted(chain.recomputable) if i % 2 == 0]
    offloads = [Offload(i, i + 1, chain.stage(i).need_from) for i in chain.offloadable if i % 2 == 1]
    sched = make_schedule(chain, offloads, recompute=runs)
    report, error = train(None, chain, sched, TrainOptions(steps=2, check_grads=True, op_memory=True))
    assert error is None and report.grads_match is True, report.grad_mismatches
    m, p = report.measured, report.predicted
    assert all(b <= p.op_bytes[op] for op, b in m.op_peak_bytes.items())


def test_a_mixture_of_experts_routed_otherwise_stays_within_its_prediction():
    """transformers' Mixtral, profiled on random tokens, every unit offloaded at once: batches
    that the router sends elsewhere (every token to the same two experts) save the same
    bytes and hold no op above its prediction (its experts' work is shaped by the batch, not
    by the routing), and the same holds for the batch profiled (docs/profiling.md, "Mixtures
    of experts")."""
    model = str(ROOT / "tests" / "models" / "moe.py")
    chain = profile(f"{model}:build", ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False)).chain
    sched = make_schedule(chain, floor_offloads(chain))
    predicted = {o.name: o.mem_bytes for o in sched.simulate(chain).ops}
    spec = resolve(f"{model}:build", 2)
    run = Offloaded(spec.module, chain, sched, backend="cpu-lazy")
    optimizer = torch.optim.SGD(run.parameters(), lr=0.0)

    def step(batch):
        run(**batch).loss.backward()
        optimizer.step(), optimizer.zero_grad(set_to_none=False)
    step(spec.kwargs)
    for token in (-1, 0, 17):
        batch = spec.kwargs if token < 0 else resolve(f"{model}:build", 2, {"token": token}).kwargs
        meter = make_meter(run.runtime.device)
        meter.track(persistent_tensors(spec.module, optimizer, run.runtime.device))
        with meter, run.runtime.reading(meter) as peaks:
            start = meter.live
            step(batch)
        assert len(peaks) == 2 * chain.L
        assert {op: b - start for op, b in peaks.items() if b - start > predicted[op]} == {}, token


def test_a_run_from_the_embedding_holds_what_its_layers_re_runs_read():
    """A run recomputed from the embedding through the layers (transformers' Mixtral): the
    rotary table the model makes after its embedding is read by every layer's re-run, so the
    executor holds it with the run's checkpoint until the rebuild (``rerun_held_bytes``);
    every op within its prediction, gradients bit for bit."""
    model = str(ROOT / "tests" / "models" / "moe.py")
    chain = profile(f"{model}:build", ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False)).chain
    assert chain.stage(3).rerun_held_bytes > 0
    run = Recompute(1, 3)
    assert run.last < chain.L and all(i in chain.recomputable for i in run.stages)
    check_run(chain, make_schedule(chain, [], recompute=[run]), "cpu-eager", "mixtral/1..3")
