"""The executor on the CPU: bit-exact gradients, the lazy backend's missing-edge detection,
no leaks, a reused host arena, measured vs predicted memory, refusals."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from executor import Offloaded
from executor.backends import CpuLazyBackend
from executor.errors import BudgetExceeded, HostMemoryShortfall, OutOfMemory
from executor.train import TrainOptions, train
from offload.cli import main
from profiler.models import resolve
from profiler.profile import ProfileOptions, profile
from solver.chain import save_chain
from solver.errors import ChainMismatch
from solver.memory import no_offload_peak, smallest_feasible_budget
from solver.methods import Options, solve
from solver.schedule import Offload, make_schedule, save_schedule
from solver.simulate import simulate

OPTIONS = {"resnet18": {"image": 32}, "gpt": {"layers": 2, "width": 32, "heads": 4, "seq": 16, "vocab": 50}}


@pytest.fixture(scope="module")
def chains():
    return {m: profile(m, ProfileOptions(batch=2, repeats=1, warmup=1, options=OPTIONS[m])).chain for m in OPTIONS}


def schedules(chain):
    budget = (smallest_feasible_budget(chain) + no_offload_peak(chain)) // 2
    solved = solve(chain, budget, "relax-lp", Options()).schedule
    everything = make_schedule(chain, [Offload(i, i + 1, chain.stage(i).need_from) for i in chain.offloadable])
    return {"none": make_schedule(chain, []), "all": everything, "solver": solved}


def train_bit_exact(model, chain, sched, backend, name, slack=0):
    """Three steps checked against training without offloading: gradients bit for bit, no
    leak (device accounting back to its base after every step), peak within the prediction
    (exactly: the CPU meter is exact; ``slack`` for blobs whose size follows the data)."""
    report, error = train(model, chain, sched, TrainOptions(steps=3, backend=backend, check_grads=True))
    assert error is None
    assert report["grads_match"] is True, (name, report["grad_mismatches"])
    m, p = report["measured"], report["predicted"]
    assert m["leaked_bytes_after_step"] == 0
    assert p["peak_bytes"] * 0.9 <= m["peak_bytes"] <= p["peak_bytes"] + slack, name  # (the loss is in F_L)
    return report


@pytest.mark.parametrize("backend", ["cpu-eager", "cpu-lazy"])
@pytest.mark.parametrize("model", list(OPTIONS))
def test_gradients_equal_bit_for_bit(chains, model, backend):
    chain = chains[model]
    for name, sched in schedules(chain).items():
        report = train_bit_exact(model, chain, sched, backend, name)
        m, p = report["measured"], report["predicted"]
        assert len(set(m["host_allocations"])) == 1  # the arena allocates nothing after the first step
        assert (m["d2h_bytes_per_step"], m["h2d_bytes_per_step"]) == (p["d2h_bytes"], p["h2d_bytes"])
        if name == "all":
            assert m["peak_bytes"] < no_offload_peak(chain)


@pytest.mark.parametrize("skip", ["h2d", "d2h"])
def test_lazy_backend_catches_a_missing_wait(chains, monkeypatch, skip):
    """Drop one synchronization edge: the lazy backend turns it into wrong gradients, every time."""
    chain = chains["resnet18"]
    sched = schedules(chain)["all"]
    original = CpuLazyBackend.wait
    monkeypatch.setattr(CpuLazyBackend, "wait", lambda self, copy: None if copy.direction == skip else original(self, copy))
    report, _ = train("resnet18", chain, sched, TrainOptions(steps=1, backend="cpu-lazy", check_grads=True))
    assert report["grads_match"] is False


def test_budget_overrun_is_reported(chains):
    chain = chains["resnet18"]
    sched = dataclasses.replace(schedules(chain)["solver"], budget_bytes=1000)
    report, error = train("resnet18", chain, sched, TrainOptions(steps=1))
    assert isinstance(error, BudgetExceeded) and report["error"] and report["measured"]["peak_bytes"] > 1000


def test_cli_train_refuses_another_chains_schedule(chains, tmp_path, capsys):
    chain = chains["resnet18"]
    save_chain(chain, tmp_path / "c.json")
    save_chain(chains["gpt"], tmp_path / "g.json")
    save_schedule(schedules(chain)["all"], chain, tmp_path / "s.json")
    assert main(["train", "resnet18", "--chain", str(tmp_path / "g.json"), "--schedule", str(tmp_path / "s.json")]) == 2
    assert "made for chain 'resnet18-b2'" in capsys.readouterr().err
    assert main(["train", "gpt", "--chain", str(tmp_path / "c.json"), "--schedule", str(tmp_path / "s.json")]) == 2
    rc = main(["train", "resnet18", "--chain", str(tmp_path / "c.json"), "--schedule", str(tmp_path / "s.json"),
               "--steps", "2", "--check-grads", "--backend", "cpu-lazy", "--report", str(tmp_path / "run.json")])
    assert rc == 0 and (tmp_path / "run.json").exists()
    assert "grads_match   True" in capsys.readouterr().out


def test_host_memory_shortfall_is_reported_with_the_report(chains, tmp_path, monkeypatch, capsys):
    chain = chains["resnet18"]
    save_chain(chain, tmp_path / "c.json")
    save_schedule(schedules(chain)["all"], chain, tmp_path / "s.json")
    monkeypatch.setattr("executor.arena.available_host_bytes", lambda: 4096)
    report, error = train("resnet18", chain, schedules(chain)["all"], TrainOptions(steps=1))
    assert isinstance(error, HostMemoryShortfall) and "only 4.00 KiB is available" in str(error)
    assert report["steps_done"] == 0 and report["error"] == str(error)
    rc = main(["train", "resnet18", "--chain", str(tmp_path / "c.json"), "--schedule", str(tmp_path / "s.json"),
               "--report", str(tmp_path / "run.json")])
    assert rc == 6 and (tmp_path / "run.json").exists()
    assert "free host memory, or solve with a larger budget" in capsys.readouterr().err


def test_out_of_memory_in_a_step_is_one_clear_error(chains, monkeypatch):
    chain = chains["resnet18"]

    def refuse(self, k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr("executor.runtime.OffloadRuntime.forward_boundary", refuse)
    report, error = train("resnet18", chain, schedules(chain)["all"], TrainOptions(steps=2))
    assert isinstance(error, OutOfMemory) and error.exit_code == 6
    assert "training step 1: out of GPU memory (CUDA out of memory" in str(error) and "lower budget" in error.hint
    assert report["steps_done"] == 0 and report["measured"]["step_s"] is None


def test_compare_and_trace(chains, tmp_path):
    """--compare times the same steps without offloading and under save_on_cpu; --trace writes a
    Chrome trace (on the CPU it has no GPU copies, so no overlap figure)."""
    chain = chains["gpt"]
    trace = tmp_path / "trace.json"
    report, error = train("gpt", chain, schedules(chain)["solver"],
                          TrainOptions(steps=2, compare=True, trace=str(trace)))
    assert error is None
    m, p = report["measured"], report["predicted"]
    assert (m["d2h_bytes_per_step"], m["h2d_bytes_per_step"]) == (p["d2h_bytes"], p["h2d_bytes"])  # traced step apart
    for name in ("no_offload", "save_on_cpu"):
        other = report["compare"][name]
        assert other["error"] is None and len(other["step_s"]["all"]) == 2
        assert report["compare"][f"step_time_vs_{name}"] == pytest.approx(
            report["measured"]["step_s"]["median"] / other["step_s"]["median"])
    assert report["compare"]["no_offload"]["peak_activation_bytes"] >= report["measured"]["peak_activation_bytes"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    assert report["trace"] == {"path": str(trace), "copy_overlap": None}
    assert not list(tmp_path.glob(".*.tmp"))


def test_host_arena_is_never_device_memory_and_grows_a_slot_in_place():
    """A sparse blob may outgrow its slot in a later step: the slot moves to new host memory,
    which a CPU meter (the CPU being the device too) must not count."""
    from executor.arena import HostArena
    from profiler.meters import CpuMeter

    meter = CpuMeter()
    with meter:
        arena = HostArena(0, pin=False)
        arena.start_step()
        first, small = arena.slot(1000, spare=100)
        arena.start_step()
        again, same = arena.slot(1100)  # within the spare: the same place
        arena.start_step()
        moved, large = arena.slot(5000)
    meter.close()
    assert first == again == moved and same.data_ptr() == small.data_ptr() and large.numel() == 5000
    assert meter.peak == 0 and meter.live == 0


@pytest.mark.parametrize("backend", ["cpu-eager", "cpu-lazy"])
@pytest.mark.parametrize("model", list(OPTIONS))
def test_every_op_holds_exactly_the_predicted_memory(chains, model, backend):
    """With the CPU's exact accounting, each op of a step holds at most what the simulator
    says, and no more than 5% of the peak below it (ResNet-18: byte for byte).  F_L is apart:
    the profiler counts the loss's forward in it, the executor's reading falls in B_L."""
    chain = chains[model]
    for name, sched in schedules(chain).items():
        report, error = train(model, chain, sched, TrainOptions(steps=1, backend=backend, op_memory=True))
        assert error is None
        measured, predicted = report["measured"]["op_peak_bytes"], report["predicted"]["op_bytes"]
        assert list(measured) == list(predicted)
        assert all(measured[op] <= predicted[op] for op in measured), name
        slack = 0 if model == "resnet18" else max(predicted.values()) // 20
        assert all(predicted[op] - measured[op] <= slack for op in measured if op != f"F{chain.L}"), name


@pytest.mark.parametrize("model", list(OPTIONS))
def test_offloaded_in_a_users_own_loop(chains, model, tmp_path):
    """The Python API: the user's module, data, loss and optimizer; gradients bit for bit
    those of the plain module from the same weights, every step; bytes moved as predicted."""
    chain = chains[model]
    sched = schedules(chain)["all"]
    save_chain(chain, tmp_path / "c.json")
    save_schedule(sched, chain, tmp_path / "s.json")
    mine, plain = resolve(model, 2, OPTIONS[model]), resolve(model, 2, OPTIONS[model])
    run = Offloaded(mine.module, mine.inputs, tmp_path / "c.json", tmp_path / "s.json", backend="cpu-lazy")
    optimizer = torch.optim.SGD(mine.module.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="inside `with run.step"):
        run(*mine.inputs)
    for _ in range(3):
        with torch.no_grad():
            for a, b in zip(mine.module.parameters(), plain.module.parameters()):
                b.copy_(a)
        with run.step():
            loss = mine.loss(run(*mine.inputs))
            loss.backward()
        plain.loss(plain.module(*plain.inputs)).backward()
        for a, b in zip(mine.module.parameters(), plain.module.parameters()):
            assert torch.equal(a.grad, b.grad)
            b.grad = None
        optimizer.step()
        optimizer.zero_grad()
    sim = simulate(chain, sched.offloads)
    assert run.moved_bytes == (3 * sim.d2h_bytes, 3 * sim.h2d_bytes) and sim.d2h_bytes > 0


def test_offloaded_refuses_another_model_or_chain(chains):
    gpt, resnet = chains["gpt"], chains["resnet18"]
    spec = resolve("gpt", 2, OPTIONS["gpt"])
    with pytest.raises(ChainMismatch, match="cannot be staged|stages differ"):
        Offloaded(spec.module, spec.inputs, resnet, schedules(resnet)["none"])
    with pytest.raises(ChainMismatch, match="made for chain"):
        Offloaded(spec.module, spec.inputs, gpt, schedules(resnet)["none"])
