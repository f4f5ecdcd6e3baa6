"""The executor runs in-stage options (docs/executor.md, "In-stage options") on a transformers
Llama in bf16 autocast with attention dropout: the kept ops' outputs are held from the
forward to the re-run, which reads them instead of running those ops, replaying the same
dropout masks; gradients bit for bit, no op above its prediction."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from offload.core.selective import KeptOutputs
from offload.errors import ScheduleRejected
from offload.executor import Offloaded
from offload.executor.train import TrainOptions, train
from offload.profiler.profile import ProfileOptions, profile
from offload.step.actions import Offload, Recompute, first_checkpoint_release
from offload.step.memory import no_offload_peak
from offload.step.recompute import moved_checkpoint_bytes
from offload.step.schedule import make_schedule
from tests.runs import check_run, options_paying


@pytest.fixture(scope="module")
def llama():
    """Measured, but for its re-runs in part timed as on a device where they pay (``options_paying``)."""
    with options_paying():
        return profile("llama", ProfileOptions(batch=2, repeats=1, warmup=1, autocast="bfloat16", options={
            "layers": 3, "width": 64, "heads": 4, "kv_heads": 2, "seq": 32, "vocab": 64, "dropout": 0.1})).chain


def test_a_swiglu_block_offers_an_option_between_keeping_and_recomputing(llama):
    """Each decoder block's menu has an option that keeps less than the whole unit and re-runs
    less than the whole re-run (the replay, timed: on a CPU it may take longer than the timed
    forward); re-running every other matmul too keeps less, re-runs more."""
    blocks = [i for i in range(1, llama.L) if llama.stage(i).options]
    assert len(blocks) >= 3
    for i in blocks:
        s, o, half = llama.stage(i), llama.stage(i).option("matmuls"), llama.stage(i).option("every-other-matmul")
        assert 0 < o.kept_bytes < s.saved_bytes and 0 < o.recompute_s < s.rerun
        assert 0 < half.kept_bytes < o.kept_bytes and o.recompute_s < half.recompute_s < s.rerun  # the Pareto front
        # the storages an offloaded checkpoint copies besides its input: the seven projections'
        # outputs (q, k, v, o, gate, up, down) and any matmul attention decomposes into (on the
        # CPU, with dropout, its two batched matmuls); every other projection drops three
        assert o.kept_storages >= 7 and o.kept_storages - half.kept_storages == 3


def test_a_blocks_checkpoint_holds_its_input_and_no_tensor_its_own_calls_made(llama):
    """A decoder layer is one recorded call; what its submodules read inside it (the residual
    sum its MLP's norm reads, the SwiGLU product the down projection reads) is made again by
    its re-run. Held, each checkpoint was 2.4x its input (and per-block checkpointing of a
    10-layer bf16 Llama held 25 MiB more than it must)."""
    hidden = 2 * 32 * 64 * 4  # batch, sequence, width, fp32 residual stream
    blocks = [llama.stage(i) for i in range(1, llama.L) if llama.stage(i).name.startswith("model.layers.")]
    assert blocks and all(s.input_own_bytes == hidden for s in blocks)
    assert all(s.input_bytes - s.input_own_bytes < hidden // 2 for s in blocks)  # position ids, the rotary table


@pytest.mark.parametrize("backend", [pytest.param("cpu-eager", marks=pytest.mark.slow), "cpu-lazy"])  # eager: make test-all
def test_options_train_bit_exact_and_as_predicted(llama, backend):
    """Every block re-run in part; then every other block keeping every other matmul, the rest
    offloaded: gradients bit for bit, each op's memory its prediction (tests/runs.py's
    allowance), bytes moved as predicted."""
    blocks = sorted({i for i, _ in llama.optional})
    every = make_schedule(llama, [], [Recompute(i, i, "matmuls") for i in blocks])
    report = check_run(llama, every, backend, "every block in part")
    assert report.measured.activation_peak_bytes < no_offload_peak(llama)
    mixed = make_schedule(llama, [Offload(i, i + 1, int(llama.need[i])) for i in blocks[1::2]],
                          [Recompute(i, i, "every-other-matmul") for i in blocks[::2]])
    check_run(llama, mixed, backend, "every other matmul kept, the rest offloaded")


def test_offloaded_checkpoints_train_bit_exact_and_as_predicted(llama):
    """Every other block re-run in part with its checkpoint (input and kept outputs) offloaded
    as early as it frees anything and fetched on demand; the other stages that can move their
    checkpoints re-run whole, released at the turn and fetched at once: gradients bit for
    bit, each op's memory and the bytes moved as predicted."""
    stages = [i for i in sorted(llama.recomputable) if llama.stage(i).input_own_bytes]
    in_part = sorted({i for i, _ in llama.optional})[::2]
    assert len(stages) >= 4 and in_part
    runs = [replace(Recompute(i, i, "matmuls"), release=first_checkpoint_release(llama, Recompute(i, i)),
                    prefetch=int(llama.need[i])) if i in in_part else
            Recompute(i, i, release=llama.L, prefetch=llama.L) for i in stages]
    assert all(moved_checkpoint_bytes(llama, r) > llama.stage(r.first).input_own_bytes for r in runs if r.option)
    check_run(llama, make_schedule(llama, [], runs), "cpu-lazy", "checkpoints moved")


def test_a_reordered_rerun_is_refused(llama, monkeypatch):
    """A re-run that does not call the kept ops the forward called fails loudly, never training
    on another op's output."""
    served = KeptOutputs.__torch_dispatch__
    swaps = []

    def swapped(self, func, types, args=(), kwargs=None):
        if self.served == 0 and self.outputs and not swaps:  # another op than the forward's (5.17's Llama: bmm)
            op = self.outputs[0][0]
            swaps.append(torch.ops.aten.mm.default if op is torch.ops.aten.bmm.default else torch.ops.aten.bmm.default)
            self.outputs[0] = (swaps[0], self.outputs[0][1])
        return served(self, func, types, args, kwargs)
    monkeypatch.setattr(KeptOutputs, "__torch_dispatch__", swapped)
    first = llama.optional[0][0]
    sched = make_schedule(llama, [], [Recompute(first, first, "matmuls")])
    _, error = train(None, llama, sched, TrainOptions(steps=1))
    assert "does not run the same way twice" in str(error), error


def test_a_stage_in_two_runs_is_refused_before_a_step(llama):
    """A schedule built in code, not loaded from a file, is checked as the file would be."""
    first = llama.optional[0][0]
    sched = make_schedule(llama, [], [Recompute(first, first, "matmuls"), Recompute(first, first, "every-other-matmul")])
    with pytest.raises(ScheduleRejected, match=f"stage {first} is in two recomputed runs"):
        Offloaded(torch.nn.Linear(2, 2), llama, sched)
