"""The experiment scripts run end to end at tiny sizes (their real sizes need minutes or a GPU)."""
from __future__ import annotations

import csv
import json

from experiments import bench_executor


def test_bench_executor_writes_a_row_per_model(tmp_path, capsys):
    assert bench_executor.main(["--set", "tiny", "--models", "gpt", "--device", "cpu", "--steps", "2",
                                "--repeats", "1", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert [r["model"] for r in rows] == ["gpt"]
    row = rows[0]
    assert row["grads_match"] == "True" and row["solver_status"] == "optimal"
    assert int(row["d2h_bytes"]) == int(row["h2d_bytes"]) > 0
    assert float(row["vs_save_on_cpu"]) > 0 and float(row["vs_no_offload"]) > 0
    assert {p.name for p in tmp_path.iterdir()} >= {"gpt-chain.json", "gpt-schedule.json", "gpt-run.json",
                                                     "gpt-trace.json", "summary.csv"}
    assert "vs save_on_cpu" in capsys.readouterr().out


# ------------------------------------------------------------------ sweep, plot, trace


from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from experiments import demo  # noqa: E402
from experiments.sweep import parse_budgets, read_rows, sweep, write_rows  # noqa: E402
from experiments.synthetic import synthetic_chain  # noqa: E402
from offload.cli import main as offload  # noqa: E402
from solver.chain import load_chain, save_chain  # noqa: E402
from solver.memory import no_offload_peak, smallest_feasible_budget  # noqa: E402
from solver.methods import METHODS, Options, solve  # noqa: E402
from solver.schedule import save_schedule  # noqa: E402
from solver.simulate import simulate  # noqa: E402

CHAINS = Path(__file__).parent.parent / "experiments" / "chains"


@pytest.mark.parametrize("chain", [synthetic_chain(8, seed=3), synthetic_chain(12, seed=7),
                                   load_chain(CHAINS / "gpt-b2-cpu.json")], ids=lambda c: c.name)
def test_sweep_is_consistent(chain):
    """No method beats a proven-optimal ILP; infeasible exactly below the floor for the exact
    methods; every feasible row's numbers are the simulator's."""
    peak, floor = no_offload_peak(chain), smallest_feasible_budget(chain)
    budgets = parse_budgets("20%:100%:7", peak) + [floor]
    rows = sweep(chain, budgets, list(METHODS), Options(time_limit_s=30, heuristic_time_s=0.2), jobs=2)
    assert len(rows) == len(METHODS) * len(budgets)
    ilp = {r.budget_bytes: r for r in rows if r.method == "ilp"}
    for r in rows:
        assert r.status in ("optimal", "feasible", "infeasible"), r.detail
        if r.budget_bytes < floor:
            assert r.status == "infeasible"
        if r.method in ("ilp", "relax-lp", "relax-bw"):
            assert (r.status == "infeasible") == (r.budget_bytes < floor)
        if r.status == "infeasible":
            continue
        assert r.peak_bytes <= r.budget_bytes and r.slowdown >= 1 - 1e-9 and r.makespan_s >= r.bound_s * (1 - 1e-9)
        best = ilp[r.budget_bytes]
        if best.status == "optimal":
            assert r.makespan_s >= best.makespan_s * (1 - max(best.gap, 1e-4)) - 1e-12, (r.method, r.budget_bytes)
        assert r.gap == pytest.approx(max(0.0, (r.makespan_s - r.bound_s) / r.makespan_s), abs=1e-12)
        assert r.slowdown == pytest.approx(r.makespan_s / chain.ideal_makespan_s)
    assert ilp[peak].status == "optimal" and ilp[peak].slowdown == pytest.approx(1.0)


def test_sweep_csv_round_trip(tmp_path):
    chain = synthetic_chain(6, seed=1)
    rows = sweep(chain, parse_budgets("30%,60%,100%", no_offload_peak(chain)), ["ilp", "vdnn-all"], jobs=1)
    write_rows(tmp_path / "r.csv", rows)
    assert read_rows(tmp_path / "r.csv") == rows


def test_budget_ranges():
    assert parse_budgets("0%:100%:5", 1000) == [0, 250, 500, 750, 1000]
    assert parse_budgets("1KiB,50%", 1000) == [500, 1024]
    assert parse_budgets("2KiB:2KiB:1", 1000) == [2048]


def _is_png(path: Path) -> tuple[int, int]:
    import matplotlib.image
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image[..., :3].std() > 0.05  # not a blank canvas
    return image.shape[:2]


def test_cli_sweep_plot_timeline_trace(tmp_path, capsys):
    chain = synthetic_chain(10, seed=2)
    save_chain(chain, tmp_path / "c.json")
    c, csv_path = str(tmp_path / "c.json"), str(tmp_path / "r.csv")
    assert offload(["sweep", c, "--budgets", "20%:100%:5", "--methods", "ilp,relax-lp,vdnn-all,save-on-cpu",
                    "-j", "2", "-q", "-o", csv_path]) == 0
    out = capsys.readouterr().out
    assert "feasible from" in out and "wrote" in out
    assert offload(["plot", csv_path, "-o", str(tmp_path / "m.png"), "--title", "t"]) == 0
    h, w = _is_png(tmp_path / "m.png")
    assert w > 600 and h > 400
    budget = (smallest_feasible_budget(chain) + no_offload_peak(chain)) // 2
    save_schedule(solve(chain, budget, "ilp").schedule, chain, tmp_path / "s.json")
    assert offload(["plot", "--timeline", c, str(tmp_path / "s.json"), "-o", str(tmp_path / "t.png")]) == 0
    _is_png(tmp_path / "t.png")
    assert offload(["plot", "--timeline", c, str(tmp_path / "s.json"), "-o", str(tmp_path / "t.svg")]) == 0
    assert (tmp_path / "t.svg").read_text().lstrip().startswith("<?xml")
    assert offload(["trace", c, str(tmp_path / "s.json"), "-o", str(tmp_path / "t.json")]) == 0
    trace = json.loads((tmp_path / "t.json").read_text())
    events = trace["traceEvents"]
    assert all(e["ph"] in ("X", "C", "M") and isinstance(e["pid"], int) for e in events)
    spans = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["ts"], float) and e["dur"] >= 0 and isinstance(e["tid"], int) for e in spans)
    sim = simulate(chain, solve(chain, budget, "ilp").schedule.offloads)
    compute = sum(e["dur"] for e in spans if e["tid"] == 1)  # ops and stalls tile the step
    assert compute == pytest.approx(sim.makespan_s * 1e6)
    assert sum(e["args"].get("bytes", 0) for e in spans if e["tid"] == 2) == sim.d2h_bytes
    assert max(e["args"]["bytes"] for e in events if e["ph"] == "C") == sim.peak_bytes


def test_cli_refuses_bad_input_without_output(tmp_path, capsys):
    chain = synthetic_chain(5, seed=0)
    save_chain(chain, tmp_path / "c.json")
    c, out = str(tmp_path / "c.json"), tmp_path / "r.csv"
    assert offload(["sweep", c, "--budgets", "10%:5%:3", "-o", str(out)]) == 2
    assert offload(["sweep", c, "--methods", "ilp,magic", "-o", str(out)]) == 2
    assert "unknown method(s) magic" in capsys.readouterr().err
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    assert offload(["plot", str(tmp_path / "x.csv"), "-o", str(tmp_path / "p.png")]) == 2
    assert "is not a sweep CSV" in capsys.readouterr().err
    assert offload(["plot", "--timeline", c, "-o", str(tmp_path / "p.png")]) == 2
    assert not out.exists() and not (tmp_path / "p.png").exists()
    assert not list(tmp_path.glob(".*.tmp"))


def test_demo_pipeline_at_a_small_size(tmp_path, capsys):
    assert demo.main(["--model", "gpt", "--batch", "2", "-O", "layers=2", "-O", "width=32", "-O", "heads=4",
                      "-O", "seq=16", "-O", "vocab=50", "--budgets", "40%:100%:3", "--steps", "2",
                      "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for step in ("profile", "sweep", "plot", "solve", "train"):
        assert f"$ offload {step}" in out
    assert "grads_match   True" in out and "measured" in out and "predicted" in out
    _is_png(tmp_path / "makespan.png")
    _is_png(tmp_path / "timeline.png")
    assert json.loads((tmp_path / "run.json").read_text())["grads_match"] is True


def test_encodings_experiment_compares_modes(tmp_path, capsys):
    from experiments import encodings
    from profiler.profile import ProfileOptions, profile
    from solver.chain import save_chain

    folder = tmp_path / "chains"
    folder.mkdir()
    save_chain(profile("resnet18", ProfileOptions(batch=2, repeats=1, warmup=1, options={"image": 32})).chain,
               folder / "resnet18-b2-32px-cpu.json")
    assert encodings.main(["--chains", str(folder), "--out", str(tmp_path / "out"), "--time-limit", "20",
                           "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "smallest feasible activation budget" in out and "link-bound platform" in out
    smallest = list(csv.DictReader((tmp_path / "out" / "smallest.csv").open()))
    s = smallest[0]
    assert int(s["offload+lossy"]) <= int(s["offload+lossless"]) <= int(s["offload"])
    assert int(s["gist-lossless"]) <= int(s["no_offload_peak"])
    rows = list(csv.DictReader((tmp_path / "out" / "at_budgets_by_platform.csv").open()))
    assert len(rows) == 2 * 3 * 2  # platforms x modes x budgets
    for platform in ("measured", "link-bound"):
        for share in (0.5, 0.3):
            cell = {r["encodings"]: r for r in rows
                    if r["platform"] == platform and abs(float(r["budget_share"]) - share) < 1e-3}
            assert len(cell) == 3
            done = {m: float(r["makespan_s"]) for m, r in cell.items() if r["status"] == "optimal"}
            if "none" in done and "lossless" in done:  # more choices never hurt a proven optimum
                assert done["lossless"] <= done["none"] * (1 + 1e-6)
    assert (tmp_path / "out" / "encodings.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
