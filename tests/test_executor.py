"""The executor on the CPU: bit-exact gradients, the lazy backend's missing-edge detection,
no leaks, a reused host arena, measured vs predicted memory, refusals."""
from __future__ import annotations

import dataclasses

import pytest

from executor.backends import CpuLazyBackend
from executor.train import BudgetExceeded, TrainOptions, train
from offload.cli import main
from profiler.profile import ProfileOptions, profile
from solver.chain import save_chain
from solver.memory import no_offload_peak, smallest_feasible_budget
from solver.methods import Options, solve
from solver.schedule import Offload, make_schedule, save_schedule

OPTIONS = {"resnet18": {"image": 32}, "gpt": {"layers": 2, "width": 32, "heads": 4, "seq": 16, "vocab": 50}}


@pytest.fixture(scope="module")
def chains():
    return {m: profile(m, ProfileOptions(batch=2, repeats=1, warmup=1, options=OPTIONS[m])).chain for m in OPTIONS}


def schedules(chain):
    budget = (smallest_feasible_budget(chain) + no_offload_peak(chain)) // 2
    solved = solve(chain, budget, "relax-lp", Options()).schedule
    everything = make_schedule(chain, [Offload(i, i + 1, chain.stage(i).need_from) for i in chain.offloadable])
    return {"none": make_schedule(chain, []), "all": everything, "solver": solved}


@pytest.mark.parametrize("backend", ["cpu-eager", "cpu-lazy"])
@pytest.mark.parametrize("model", list(OPTIONS))
def test_gradients_equal_bit_for_bit(chains, model, backend):
    chain = chains[model]
    for name, sched in schedules(chain).items():
        report, error = train(model, chain, sched, TrainOptions(steps=3, backend=backend, check_grads=True))
        assert error is None
        assert report["grads_match"] is True, (name, report["grad_mismatches"])
        m, p = report["measured"], report["predicted"]
        assert m["leaked_bytes_after_step"] == 0  # device accounting back to its base after every step
        assert len(set(m["host_allocations"])) == 1  # the arena allocates nothing after the first step
        assert (m["d2h_bytes_per_step"], m["h2d_bytes_per_step"]) == (p["d2h_bytes"], p["h2d_bytes"])
        assert m["peak_bytes"] <= p["peak_bytes"] * 1.02 + 64 * 1024, name
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
