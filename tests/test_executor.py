"""The executor on the CPU: bit-exact gradients (dropout on), measured memory equal to the
prediction op by op, with offloading and with recomputation, the lazy backend's missing-edge
detection, no leaks, a reused host arena, refusals, the Python API in a user's own loop, and
the runtime running the step's events (offload.step.events) in order."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
from types import SimpleNamespace

import pytest
import torch

from offload.cli import main
from offload.errors import BudgetExceeded, ChainMismatch, HostMemoryShortfall, OutOfMemory
from offload.executor import Offloaded
from offload.executor.backends import CpuLazyBackend
from offload.executor.checks import EAGER_REFERENCE, GradCheck
from offload.core.devices import deterministic_kernels
from offload.core.meters import make_meter
from offload.executor.plan import StepPlan
from offload.executor.runtime import _Step
from offload.executor.train import TrainOptions, train
from offload.executor.trainer import Trainer
from offload.io.text import format_bytes, format_seconds
from offload.models import resolve
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.methods import Options, solve
from offload.step.actions import Offload, Recompute
from offload.step.budget import Budget
from offload.step.chain import StageOption
from offload.step.chainfile import save_chain
from offload.step.events import BACKWARD, FORWARD, Event
from offload.step.memory import floor_offloads, no_offload_peak, smallest_feasible_budget
from offload.step.schedule import make_schedule
from offload.step.schedulefile import save_schedule
from offload.step.simulate import simulate
from tests.runs import ROOT, Profiled, check_run, recomputing

OPTIONS = {"resnet18": {"image": 16},
           "gpt": {"layers": 3, "width": 32, "heads": 4, "seq": 16, "vocab": 50, "dropout": 0.1},
           "mlp": {"layers": 3, "width": 256, "features": 64, "classes": 10}}
FAST = ["gpt", "mlp"]


@pytest.fixture(scope="module")
def chains():
    return Profiled(lambda m: profile(m, ProfileOptions(batch=2, repeats=1, warmup=1, options=OPTIONS[m])).chain)


def schedules(chain):
    budget = (smallest_feasible_budget(chain) + no_offload_peak(chain)) // 2
    solved = solve(chain, budget, "relax-lp", Options(heuristic_time_s=0.1)).schedule
    everything = make_schedule(chain, floor_offloads(chain))
    return {"none": make_schedule(chain, []), "all": everything, "solver": solved}


@pytest.mark.parametrize("model, backend", [("gpt", "cpu-eager"), pytest.param("gpt", "cpu-lazy", marks=pytest.mark.slow),  # the rest: make test-all
                                            *(pytest.param("mlp", b, marks=pytest.mark.slow) for b in ("cpu-eager", "cpu-lazy"))])
def test_gradients_bit_exact_and_memory_as_predicted(chains, model, backend):
    for name, sched in schedules(chains[model]).items():
        report = check_run(chains[model], sched, backend, name)
        if name == "all":
            assert report.measured.activation_peak_bytes < no_offload_peak(chains[model])


@pytest.mark.slow  # make test-all (time): make test keeps re-runs on the lazy backend in test_executor_options
@pytest.mark.parametrize("model, backend", [(m, b) for m in ("gpt", "mlp") for b in ("cpu-eager", "cpu-lazy")])
def test_recomputation_bit_exact_and_memory_as_predicted(chains, model, backend):
    """Re-run forwards replay the same dropout masks; measured memory never above the model."""
    for name, sched in recomputing(chains[model]).items():
        assert sched.recompute
        check_run(chains[model], sched, backend, name)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu-eager", "cpu-lazy"])
def test_resnet18_gradients_bit_exact_and_memory_as_predicted(chains, backend):
    for name, sched in {**schedules(chains["resnet18"]), **recomputing(chains["resnet18"])}.items():
        check_run(chains["resnet18"], sched, backend, name)


@pytest.mark.parametrize("skip", ["h2d", "d2h"])
def test_lazy_backend_catches_a_missing_wait(chains, monkeypatch, skip):
    """Drop one synchronization edge: the lazy backend turns it into wrong gradients, every time."""
    chain = chains["mlp"]
    original = CpuLazyBackend.wait
    monkeypatch.setattr(CpuLazyBackend, "wait", lambda self, copy: None if copy.direction == skip else original(self, copy))
    report, _ = train(None, chain, schedules(chain)["all"], TrainOptions(steps=1, backend="cpu-lazy", check_grads=True))
    assert report.grads_match is False and report.grad_reference == EAGER_REFERENCE


def test_budget_overrun_is_reported(chains):
    chain = chains["mlp"]
    sched = dataclasses.replace(schedules(chain)["solver"], budget=Budget(1000))
    report, error = train(None, chain, sched, TrainOptions(steps=1))
    assert isinstance(error, BudgetExceeded) and report.error and report.measured.activation_peak_bytes > 1000
    assert report.measured.cpu_wait_share >= 0  # the steps' wait for a CPU (tests/test_contention.py)


def test_cli_train_refuses_another_chains_schedule(chains, tmp_path, capsys):
    chain = chains["mlp"]
    save_chain(chain, tmp_path / "c.json")
    save_chain(chains["gpt"], tmp_path / "g.json")
    save_schedule(schedules(chain)["all"], chain, tmp_path / "s.json")
    assert main(["train", "--chain", str(tmp_path / "g.json"), "--schedule", str(tmp_path / "s.json")]) == 2
    assert "made for chain 'mlp-b2'" in capsys.readouterr().err
    assert main(["train", "gpt", "--chain", str(tmp_path / "c.json"), "--schedule", str(tmp_path / "s.json")]) == 2
    assert "profiled from 'mlp', not 'gpt'" in capsys.readouterr().err
    rc = main(["train", "--chain", str(tmp_path / "c.json"), "--schedule", str(tmp_path / "s.json"),
               "--steps", "2", "--check-grads", "--backend", "cpu-lazy", "--report", str(tmp_path / "run.json")])
    assert rc == 0 and (tmp_path / "run.json").exists()
    assert "grads_match   True" in capsys.readouterr().out


def test_host_memory_shortfall_is_reported_with_the_report(chains, tmp_path, monkeypatch, capsys):
    chain = chains["mlp"]
    save_chain(chain, tmp_path / "c.json")
    save_schedule(schedules(chain)["all"], chain, tmp_path / "s.json")
    monkeypatch.setattr("offload.executor.arena.available_host_bytes", lambda: 4096)
    report, error = train(None, chain, schedules(chain)["all"], TrainOptions(steps=1))
    assert isinstance(error, HostMemoryShortfall) and "only 4.00 KiB is available" in str(error)
    assert report.steps_done == 0 and report.error == str(error)
    rc = main(["train", "--chain", str(tmp_path / "c.json"), "--schedule", str(tmp_path / "s.json"),
               "--report", str(tmp_path / "run.json")])
    assert rc == 6 and (tmp_path / "run.json").exists()
    assert "free host memory, or solve with a larger budget" in capsys.readouterr().err


def test_out_of_memory_in_a_step_is_one_clear_error(chains, monkeypatch):
    def refuse(self, k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr("offload.executor.runtime._Step.forward_boundary", refuse)
    report, error = train(None, chains["mlp"], schedules(chains["mlp"])["all"], TrainOptions(steps=2))
    assert isinstance(error, OutOfMemory) and error.exit_code == 6
    assert "the warm-up step: out of GPU memory (CUDA out of memory" in str(error) and "lower budget" in error.hint
    assert report.steps_done == 0 and report.measured.step_s is None


def test_compare_and_trace(chains, tmp_path, capsys):
    """--compare times the same steps without offloading, under save_on_cpu and with selective
    checkpointing of the blocks, interleaved with ours (each ratio from the same rounds), and
    prints the run's pace: the no-offload step over the chain's prediction of it; --trace
    writes a Chrome trace (on the CPU it has no GPU copies, so no overlap figure)."""
    from offload.executor.cli import _print_report

    chain = chains["gpt"]
    trace = tmp_path / "trace.json"
    report, error = train(None, chain, schedules(chain)["solver"], TrainOptions(steps=1, compare=True, trace=str(trace)))
    assert error is None
    m, p = report.measured, report.predicted
    assert (m.d2h_bytes_per_step, m.h2d_bytes_per_step) == (p.d2h_bytes_per_step, p.h2d_bytes_per_step)  # traced step apart
    [ours] = report.compare_our_step_times_s  # a round's step, not our timed one
    for name in ("no_offload", "save_on_cpu", "selective_checkpoint"):
        other = report.compare[name]
        assert other.error is None and len(other.step_times_s) == 1
        assert other.our_step_ratio == ours / other.step_s  # the same round's
    plain = chain.source["plain_step_s"]  # the same no-offload step, timed by the profile beside its timed steps
    assert p.no_offload_profiled and p.no_offload_step_s == plain["median"] and plain["min"] <= plain["max"]
    assert report.pace == report.compare["no_offload"].step_s / plain["median"]
    _print_report(report)
    pace = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("pace"))
    assert f"{report.pace:.2f}x" in pace and f"predicted {format_seconds(report.pace * p.step_s)}" in pace
    assert f"the profile timed it at {format_seconds(plain['median'])}" in pace
    # how uncertain that pace is: the profile's plain steps' spread, said past 10% (and only then)
    assert p.no_offload_spread == pytest.approx((plain["max"] - plain["min"]) / plain["median"])
    for spread, said in ((0.4, True), (0.05, False)):
        report.predicted.no_offload_spread = spread
        _print_report(report)
        assert ("plain steps spread 40% of their median" in capsys.readouterr().out) is said
    assert report.compare["no_offload"].activation_peak_bytes >= report.measured.activation_peak_bytes
    # the matmul outputs kept, the rest rebuilt in the backward: less than without it, and not nothing
    assert 0 < report.compare["selective_checkpoint"].activation_peak_bytes < report.compare["no_offload"].activation_peak_bytes
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    assert report.trace == {"path": str(trace), "copy_overlap": None, "device_time": None}  # no GPU work
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_step_far_from_its_prediction_points_to_compare(chains, capsys):
    """Without --compare, a measured step more than 10% from its prediction says how to tell
    the machine's pace from the schedule's error; within 10%, nothing."""
    from offload.executor.cli import _print_report
    from offload.executor.report import Report

    chain = chains["gpt"]
    report = Report.start(chain, schedules(chain)["none"], "cpu-eager", "cpu")
    report.measured.activation_peak_bytes = 0
    for factor, said in ((1.3, True), (1.05, False)):
        report.measured.set_times([factor * report.predicted.step_s])
        _print_report(report)
        assert ("--compare times the no-offload step" in capsys.readouterr().out) is said


def test_copies_that_move_other_bytes_than_the_schedule_books_are_said(chains, capsys):
    """The report sets the bytes moved per step against the schedule's: equal, nothing; more (a
    chain that books its copies short), a line that says by how much each way and calls it a
    defect; less, a line that says the prediction is an upper bound; within what the encoded
    units' blobs may vary, nothing."""
    from offload.executor.cli import _print_report
    from offload.executor.report import Report

    chain = chains["mlp"]
    report = Report.start(chain, schedules(chain)["all"], "cpu-eager", "cpu")
    m, p = report.measured, report.predicted
    m.activation_peak_bytes, m.d2h_bytes_per_step, m.h2d_bytes_per_step = 0, p.d2h_bytes_per_step, p.h2d_bytes_per_step
    assert p.d2h_bytes_per_step > 0 and report.copies_off() == ""
    m.d2h_bytes_per_step = m.h2d_bytes_per_step = 2 * p.d2h_bytes_per_step
    _print_report(report)
    out = capsys.readouterr().out
    assert f"D2H a step {format_bytes(2 * p.d2h_bytes_per_step)} where it books {format_bytes(p.d2h_bytes_per_step)}" in out
    assert "H2D" in report.copies_off() and "moved more than the schedule" in out and "a defect of the chain" in out
    m.d2h_bytes_per_step = m.h2d_bytes_per_step = p.d2h_bytes_per_step - 128  # less: an upper bound, no defect
    assert "moved less than the schedule" in report.copies_off() and "defect" not in report.copies_off()
    m.d2h_bytes_per_step = m.h2d_bytes_per_step = 2 * p.d2h_bytes_per_step
    p.blob_slack_bytes = p.d2h_bytes_per_step
    assert report.copies_off() == ""


def test_interleaved_rounds_rotate_and_share_a_slow_moment(monkeypatch):
    """--compare's rounds: one step of each way per round, the order rotated each round, so a
    slow moment of the machine (here round 2, every step three times as long, on a fake clock)
    falls on every way alike and each round's ratio stays the ways' own; a way that fails
    runs no more rounds, the others go on."""
    spec = resolve("mlp", 2, {"layers": 1, "width": 8, "features": 4, "classes": 2})
    now = [0.0]
    monkeypatch.setattr("offload.executor.trainer.time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr("offload.executor.trainer.gc", SimpleNamespace(collect=lambda: 0))  # a long session's heap
    order = []

    def way(name: str, cost: float):
        def forward(args, kwargs):
            if name == "c" and "c" in order:  # its second step: round 2
                raise torch.cuda.OutOfMemoryError("CUDA out of memory")
            order.append(name)
            now[0] += cost * (3 if len(order) in (4, 5) else 1)  # round 2: b, (c), a
            return spec.module(*args, **kwargs)
        return forward, contextlib.nullcontext
    trainer = Trainer(spec, [p for p in spec.module.parameters()], None, torch.device("cpu"))
    times, errors = trainer.interleaved({"a": way("a", 2.0), "b": way("b", 1.0), "c": way("c", 4.0)}, 3)
    assert order == ["a", "b", "c", "b", "a", "a", "b"]  # round 2 starts at b, round 3 at c (failed: skipped)
    assert times == {"a": [2.0, 6.0, 2.0], "b": [1.0, 3.0, 1.0], "c": [4.0]}
    assert [x / y for x, y in zip(times["a"], times["b"])] == [2.0, 2.0, 2.0]
    assert set(errors) == {"c"} and "c: interleaved round 2" in str(errors["c"])


def test_host_arena_is_never_device_memory_and_grows_a_slot_in_place():
    """A sparse blob may outgrow its slot in a later step: the slot moves to new host memory,
    which a CPU meter (the CPU being the device too) must not count."""
    from offload.core.meters import CpuMeter
    from offload.executor.arena import HostArena

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


def test_a_tensor_made_from_python_data_is_counted_while_it_lives():
    """``torch.tensor([...])`` (Falcon's ``fused_qkv[..., [-2], :]`` saves two such indices
    per layer) allocates outside the dispatcher and hands the tensor to it through
    ``lift_fresh``: new storage the meter counts, as the units that save it do (an offloaded
    Falcon layer read 16 B over its prediction when it did not: the unit's release lowered the
    prediction by bytes the meter never added); a view of a tensor from before the step stays
    uncounted."""
    from offload.core.meters import CpuMeter

    before = torch.zeros(4)
    meter = CpuMeter()
    with meter:
        index = torch.tensor([-2, 1])
        picked = before[..., index]
        view = before[1:]
        live = meter.live
        del index, picked
        after = meter.live
    meter.close()
    assert live == 2 * 8 + 2 * 4 and after == 0 and view.numel() == 3


def _files(chain, sched, tmp_path):
    save_chain(chain, tmp_path / "c.json")
    save_schedule(sched, chain, tmp_path / "s.json")
    return tmp_path / "c.json", tmp_path / "s.json"


@pytest.mark.parametrize("model", FAST)
def test_offloaded_in_a_users_own_loop(chains, model, tmp_path):
    """The Python API: the user's module, data, loss and optimizer; gradients bit for bit
    those of the plain module from the same weights, every step; bytes moved as predicted."""
    chain = chains[model]
    sched = schedules(chain)["all"]
    mine, plain = resolve(model, 2, OPTIONS[model]), resolve(model, 2, OPTIONS[model])
    run = Offloaded(mine.module, *_files(chain, sched, tmp_path), backend="cpu-lazy")
    assert dict(run.named_parameters()).keys() == {f"module.{n}" for n, _ in mine.module.named_parameters()}
    optimizer = torch.optim.SGD(run.parameters(), lr=0.1)
    for step in range(3):
        with torch.no_grad():
            for a, b in zip(mine.module.parameters(), plain.module.parameters()):
                b.copy_(a)
        torch.manual_seed(step)  # the same dropout masks
        mine.loss(run(*mine.args)).backward()
        torch.manual_seed(step)
        plain.loss(plain.module(*plain.args)).backward()
        for a, b in zip(mine.module.parameters(), plain.module.parameters()):
            assert torch.equal(a.grad, b.grad)
            b.grad = None
        optimizer.step()
        optimizer.zero_grad()
    sim = simulate(chain, sched.offloads)
    assert run.moved_bytes == (3 * sim.d2h_bytes, 3 * sim.h2d_bytes) and sim.d2h_bytes > 0
    with torch.no_grad():  # evaluation: the plain module, nothing moved
        run(*mine.args)
    assert run.moved_bytes == (3 * sim.d2h_bytes, 3 * sim.h2d_bytes)


def test_offloaded_guard_rails(chains, tmp_path):
    chain = chains["mlp"]
    spec = resolve("mlp", 2, OPTIONS["mlp"])
    run = Offloaded(spec.module, chain, schedules(chain)["all"], backend="cpu-eager")
    with pytest.raises(ChainMismatch, match="this batch is 0:float32\\[3,64\\]"):
        run(torch.randn(3, 64))
    first = spec.loss(run(*spec.args))
    with pytest.raises(RuntimeError, match="backward has not finished"):
        run(*spec.args)
    first.backward()
    spec.loss(run(*spec.args)).backward()  # accumulation: forward and backward in turn
    del first
    dropped = run(*spec.args)  # a forward whose graph is dropped does not block the next one
    del dropped
    spec.loss(run(*spec.args)).backward()


def test_offloaded_refuses_another_model_or_chain(chains):
    gpt, mlp = chains["gpt"], chains["mlp"]
    spec = resolve("gpt", 2, OPTIONS["gpt"])
    with pytest.raises(ChainMismatch, match="cannot be staged"):
        Offloaded(spec.module, mlp, schedules(mlp)["none"])
    with pytest.raises(ChainMismatch, match="made for chain"):
        Offloaded(spec.module, gpt, schedules(mlp)["none"])
    bare = dataclasses.replace(gpt, recipe=None)
    with pytest.raises(ChainMismatch, match="no recipe"):
        Offloaded(spec.module, bare, make_schedule(bare, []))


def test_the_host_arena_counts_what_the_host_really_gives(monkeypatch, tmp_path):
    """Pinned chunks at the power of two CUDA's host allocator takes; the container's cgroup
    limit; one arena per rank on the machine."""
    from offload.core import devices
    from offload.executor import arena
    assert arena.footprint(600 * 2**20, pin=True) == 2**30 and arena.footprint(600 * 2**20, pin=False) == 600 * 2**20
    assert arena.footprint(2**20, pin=True) == 2**20
    (tmp_path / "max").write_text("1073741824\n")
    (tmp_path / "current").write_text("1000000000\n")
    monkeypatch.setattr(devices, "CGROUP", (str(tmp_path / "max"), str(tmp_path / "current")))
    assert devices.available_host_bytes() == 73741824
    (tmp_path / "max").write_text("max\n")
    assert devices.available_host_bytes() > 73741824  # no limit: the machine's
    monkeypatch.setattr(arena, "available_host_bytes", lambda: 3 * 2**20)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(HostMemoryShortfall, match="for each of the 4 ranks on this machine"):
        arena.HostArena(2**20, pin=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert arena.HostArena(2**20, pin=False).nbytes < 3 * 2**20


def test_the_runtime_runs_every_event_of_the_table_in_order(chains, monkeypatch):
    """A real step of a real model: the runtime's boundaries run the plan's events, all of them,
    in the table's order (and gradients stay bit for bit those without offloading)."""
    gpt = chains["gpt"]
    L = gpt.L
    offloads = [Offload(i, i + 1, int(gpt.need[i])) for i in gpt.offloadable if i % 2 == 1]
    runs = [Recompute(i, i) for i in sorted(gpt.recomputable) if i % 2 == 0 and i < L - 1][:1]
    sched = make_schedule(gpt, offloads, runs)
    seen: list[Event] = []
    run = _Step._run
    monkeypatch.setattr(_Step, "_run", lambda self, e: (seen.append(e), run(self, e))[1])
    report, error = train(None, gpt, sched, TrainOptions(steps=1, check_grads=True))
    assert error is None and report.grads_match is True
    table = [e for e in StepPlan.from_schedule(gpt, sched).events.sequence if e.kind not in (FORWARD, BACKWARD)]
    assert runs and offloads and seen == table * 3  # on the CPU: the warm-up step, the metered one, the timed one


NOISY = str(ROOT / "tests" / "models" / "noisy.py") + ":build"


def test_the_gradient_check_tells_noise_from_a_defect(tmp_path, capsys, monkeypatch):
    """A kernel that is not deterministic (tests/models/noisy.py) makes the reference differ
    from itself: the check measures that floor and judges ours against it (exit 0, both
    numbers printed); a missing copy wait is a defect however noisy the kernels (exit 7)."""
    chain = profile(NOISY, ProfileOptions(batch=4, repeats=1, warmup=1)).chain
    sched = make_schedule(chain, floor_offloads(chain))
    report, error = train(None, chain, sched, TrainOptions(steps=2, check_grads=True))
    assert error is None and report.grads_match is False and report.grads_within_noise is True
    assert report.grads_reseeded is False  # its noise is a kernel's, not the seeds'
    assert all(0 < f < 1e-5 for f in report.grad_noise_floor) and max(report.grad_rel_diff) < 1e-5
    assert report.deterministic is False  # asked for on CUDA only: the CPU's kernels are
    save_chain(chain, tmp_path / "c.json")
    save_schedule(sched, chain, tmp_path / "s.json")
    files = ["--chain", str(tmp_path / "c.json"), "--schedule", str(tmp_path / "s.json"), "--steps", "1", "--check-grads"]
    assert main(["train", *files]) == 0
    assert "the reference differs from itself by up to" in capsys.readouterr().out
    original = CpuLazyBackend.wait  # a missing H2D wait: the backward reads poison
    monkeypatch.setattr(CpuLazyBackend, "wait", lambda self, copy: None if copy.direction == "h2d" else original(self, copy))
    assert main(["train", *files, "--backend", "cpu-lazy"]) == 7
    assert "beyond it" in capsys.readouterr().out


def test_a_model_that_seeds_from_the_operating_system_is_said_to(tmp_path, capsys):
    """A model that seeds its generators anew from the operating system at every step
    (``torch.seed()``, as Reformer's reversible layers do) draws other dropout masks in each
    run of one step, whatever the check replays: the reference differs from itself, and the
    check says why, not "kernels that are not deterministic"."""
    chain = profile(NOISY, ProfileOptions(batch=4, repeats=1, warmup=1, options={"reseeded": 1})).chain
    report, error = train(None, chain, make_schedule(chain, []), TrainOptions(steps=1, check_grads=True))
    assert error is None and report.grads_match is False and report.grads_reseeded is True
    save_chain(chain, tmp_path / "c.json")
    save_schedule(make_schedule(chain, []), chain, tmp_path / "s.json")
    main(["train", "--chain", str(tmp_path / "c.json"), "--schedule", str(tmp_path / "s.json"), "--steps", "1",
          "--check-grads"])
    assert "seeds its generators anew from the operating system" in capsys.readouterr().out


def test_what_a_reference_cycle_holds_is_measured_alike_whenever_the_collector_runs():
    """Each block leaves a cycle holding a tensor, freed whenever Python's collector next runs,
    a moment that follows every allocation of Python objects before it: profiled with the
    collector running at every allocation and trained with its default pace, the ops read
    the cycles' bytes over their prediction (a TimeSeriesTransformer: 16 B, from one run to
    the next).  While a meter runs the collector does not, so what a cycle holds lives to the
    step's end in both, and every op is as predicted."""
    import gc

    model = str(ROOT / "tests" / "models" / "cyclic.py") + ":build"
    thresholds = gc.get_threshold()
    gc.set_threshold(1)
    try:
        chain = profile(model, ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False))
    finally:
        gc.set_threshold(*thresholds)
    assert gc.isenabled()
    report, error = train(None, chain.chain, make_schedule(chain.chain, []), TrainOptions(steps=1, op_memory=True))
    assert error is None and report.measured.op_peak_bytes == report.predicted.op_bytes
    with make_meter(torch.device("cpu")):
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_saved_conjugate_view_is_read_back_conjugate():
    """Each block multiplies one spectrum by another's ``torch.conj`` (Autoformer's
    autocorrelation), and the product saves that conjugate view: offloaded, its bytes came
    back as a plain tensor, without the conjugate bit, and the gradients came out off (3e-8 of
    an Autoformer's, its bytes copied exactly).  Every unit offloaded, they are bit for bit."""
    chain = profile(str(ROOT / "tests" / "models" / "spectral.py") + ":build",
                    ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False)).chain
    report, error = train(None, chain, make_schedule(chain, floor_offloads(chain)), TrainOptions(steps=1, check_grads=True))
    assert error is None and report.grads_match is True, report.grad_rel_diff


def test_a_rerun_rebuilds_a_view_in_another_dtype_with_its_conjugate_bit():
    """The model's code views each block's output as complex pairs and conjugates them before
    the next block: a re-run rebuilt that argument in the output's dtype without the bit (the
    profile failed: the stage did not run the same way twice).  Every other block re-run,
    gradients bit for bit."""
    chain = profile(str(ROOT / "tests" / "models" / "spectral.py") + ":build_rotating",
                    ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False)).chain
    assert len(chain.recomputable) >= 4
    for name, schedule in recomputing(chain).items():
        report, error = train(None, chain, schedule, TrainOptions(steps=1, check_grads=True))
        assert error is None and report.grads_match is True, (name, report.grad_rel_diff)


def test_a_storage_larger_than_profiled_is_named_as_the_cause_of_a_peak_over_the_prediction(chains):
    """A mixture of experts whose routing moves with the weights saves, in a later step, an
    expert's input larger than profiled (a DBRX: 3.54 KiB over its predicted peak, and the
    host arena took a new buffer): ``offload train`` printed the two numbers and no cause.
    The report says the arena took bytes beyond its plan, and why that happens."""
    chain = chains["mlp"]
    report, _ = train(None, chain, schedules(chain)["all"], TrainOptions(steps=1))
    assert report.over_prediction is None and not report.arena_grew()
    report.measured.activation_peak_bytes = report.predicted.activation_peak_bytes + 3626
    report.measured.host_arena_grown_bytes = 4096
    report.judge_peak(warn=False)
    assert "the host arena took 4.00 KiB beyond the plan" in report.over_prediction
    assert "mixture of experts" in report.over_prediction


def test_deterministic_kernels_are_asked_for_on_cuda_and_put_back():
    cudnn = torch.backends.cudnn
    before = (torch.are_deterministic_algorithms_enabled(), cudnn.deterministic, cudnn.benchmark)
    with deterministic_kernels(torch.device("cpu")) as changed:
        assert not changed and not torch.are_deterministic_algorithms_enabled()
    with deterministic_kernels(torch.device("cuda")) as changed:  # flags only: no GPU needed to set them
        assert changed and torch.are_deterministic_algorithms_enabled() and cudnn.deterministic and not cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert (torch.are_deterministic_algorithms_enabled(), cudnn.deterministic, cudnn.benchmark) == before


class _Rare(torch.autograd.Function):
    """A backward that jitters in one call of six (from the first): nondeterminism that few runs show."""
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _Rare.calls += 1
        return grad * (1 + 1e-6) if _Rare.calls % 6 == 1 else grad


def test_a_rare_nondeterminism_is_sampled_until_it_shows():
    """Ours jitters, the reference's first four runs do not: three re-runs see a floor of 0,
    which would call the step a defect; the check runs the reference again until it
    differs from itself (up to ``NOISE_SAMPLES_MAX``), and judges ours against that."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    spec = SimpleNamespace(module=reference, batch=lambda: ((x,), {}), autocasting=contextlib.nullcontext,
                           loss=lambda out: _Rare.apply(out).square().sum())
    check = GradCheck(spec, list(model.parameters()), torch.device("cpu"))
    _Rare.calls = 0
    check.before_step()
    spec.loss(model(x)).backward()  # call 1: ours jitters
    check.after_step()  # 2: the reference; 3-5: its re-runs, alike; 6 alike, 7 jitters
    assert check.mismatches[0] and check.noise_floors[0] > 0 and check.within_noise
    assert _Rare.calls == 7


def test_a_weight_without_a_gradient_matches_only_one_without():
    """A weight the loss does not read has no gradient in either run: the same (it raised a
    ``TypeError``).  Where ours has none and the reference zeros, the gradients differ by
    nothing measurable, and that is no kernel's noise: a mismatch beyond it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    for reads_second in (False, True):
        spec = SimpleNamespace(module=reference, batch=lambda: ((x,), {}), autocasting=contextlib.nullcontext,
                               loss=lambda out: out.square().sum())
        reference[1].forward = (lambda h: 0 * reference[1].weight.sum() + h) if reads_second else (lambda h: h)
        check = GradCheck(spec, list(model.parameters()), torch.device("cpu"))
        check.before_step()
        model.zero_grad(set_to_none=True)
        model[0](x).square().sum().backward()  # ours: the second layer gets no gradient
        check.after_step()
        assert check.mismatches == [int(reads_second)] and check.within_noise is (not reads_second)


@pytest.mark.parametrize("model", ["gpt", pytest.param("resnet18", marks=pytest.mark.slow)])  # resnet18: make test-all
def test_the_saves_a_profile_counts_are_the_tensors_the_runtime_handles(chains, model):
    """``Stage.saves`` is what ``handle_host_s`` is charged per: each is a tensor the runtime's
    pack hook hands a handle for, and its unpack reads back, in every step where its unit is
    offloaded (the floor's units) or rebuilt (every block re-run); with nothing moved, none.
    The same steps time each block's rebuild, which on a CPU is the chain's ``rerun_s``."""
    from offload.executor.step_costs import schedules as timed_schedules
    from offload.executor.step_costs import step_costs
    from offload.profiler.profile import _with_step_costs

    chain = chains[model]
    spec = resolve(model, 2, OPTIONS[model])
    costs = step_costs(spec, chain, steps=2)
    for name, schedule in timed_schedules(chain).items():
        handled = {o.stage for o in schedule.offloads} | {j for r in schedule.recompute for j in r.stages}
        calls = costs.calls[name]
        expected = 2 * sum(chain.stage(i).saves for i in handled)
        assert len(calls["pack handled"]) == len(calls["unpack handled"]) == expected, name
        assert expected > 0 or name == "nothing moved"
    assert {k: len(t) for k, t in costs.rebuilds.items()} == dict.fromkeys(chain.recomputable, 2)
    for name in costs.calls:  # each stage's forward (the last's holds the loss: not timed) and backward, each step
        assert {k: len(t) for k, t in costs.forwards[name].items()} == dict.fromkeys(range(1, chain.L), 2)
        assert {k: len(t) for k, t in costs.backwards[name].items()} == dict.fromkeys(range(1, chain.L + 1), 2)
    assert costs.handled_seconds() >= 0.0
    # the profile (on this CPU) charged it to the ops, not to a host lane: a handled tensor's
    # pack and unpack take several times a kept one's here
    assert chain.platform.handle_device_s > 0 and chain.platform.handle_host_s == 0
    bare = dataclasses.replace(chain, platform=dataclasses.replace(chain.platform, handle_device_s=0.0))
    on_cuda = _with_step_costs(bare, spec, model, torch.device("cuda"), 1)  # what the profiler does with it there
    assert on_cuda.stages == chain.stages and on_cuda.platform.handle_host_s >= 0.0 == on_cuda.platform.handle_device_s
    assert (on_cuda.platform.handle_host_s > 0) == (on_cuda.sha256 != bare.sha256)  # 0 is written as absent
    on_cpu = _with_step_costs(bare, spec, model, torch.device("cpu"), 1)  # the re-runs as timed in the steps
    assert on_cpu.platform.handle_host_s == 0.0 <= on_cpu.platform.handle_device_s
    for k in chain.recomputable:
        before, after = chain.stage(k), on_cpu.stage(k)
        assert after.rerun_s > 0 and after.rerun_s != before.rerun_s
        assert after.recorded_fwd_s >= after.fwd_s == before.fwd_s and after.recorded_bwd_s >= after.bwd_s
    from offload.profiler.profile import _recorded_in_steps  # an option's re-run: a share of the stage's, kept
    stage = dataclasses.replace(chain.stage(2), fwd_s=0.002, recorded_fwd_s=0.003, rerun_s=0.004,
                                options=(StageOption("matmuls", 10, 0.001, fwd_s=0.0035),))
    option = _recorded_in_steps(stage, 0.0032, 0.006, stage.bwd_s).options[0]
    assert (option.recompute_s, option.fwd_s) == pytest.approx((0.0015, 0.0035 * 0.0032 / 0.003))


def test_the_host_time_per_storage_copied_is_timed_on_the_runtimes_own_steps(monkeypatch):
    """``copy_host_s`` is what the runtime's own copy steps cost the host: each unit of the
    round goes through ``_Step._offload``, ``_release``, ``_prefetch`` and ``_wait``."""
    from offload.executor.copy_cost import copy_host_seconds
    calls = []
    for name in ("_offload", "_release", "_prefetch", "_wait"):
        real = getattr(_Step, name)
        monkeypatch.setattr(_Step, name, lambda step, sids, real=real, name=name: (calls.append(name), real(step, sids)))
    seconds = copy_host_seconds(torch.device("cpu"), units=2, storages=3, nbytes=64, repeats=1)
    assert 0 < seconds < 0.01
    assert calls == 2 * (["_offload"] * 2 + ["_release"] * 2 + ["_prefetch", "_wait"] * 2)  # warm-up, one round
