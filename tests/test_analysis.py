"""Sweeps, figures and traces: the analysis commands as a user meets them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.synthetic import synthetic_chain
from offload.analysis.sweep import parse_budgets, read_rows, sweep, write_rows
from offload.cli import main as offload
from offload.solver.methods import METHODS, Options, solve
from offload.step.budget import Budget
from offload.step.chainfile import load_chain, save_chain
from offload.step.memory import no_offload_peak, smallest_feasible_budget
from offload.step.schedulefile import save_schedule

CHAINS = Path(__file__).parent.parent / "experiments" / "chains"

@pytest.mark.parametrize("chain", [pytest.param(synthetic_chain(8, seed=3), marks=pytest.mark.slow),  # make test-all
                                   pytest.param(synthetic_chain(12, seed=7), marks=pytest.mark.slow),
                                   load_chain(CHAINS / "gpt-b2-cpu.json")], ids=lambda c: c.name)
def test_sweep_is_consistent(chain):
    """No offload-only method beats a proven-optimal ILP (recomputing ones may: a larger
    class); infeasible exactly below the floor for the exact methods; every feasible row's
    numbers are the simulator's."""
    peak, floor = no_offload_peak(chain), smallest_feasible_budget(chain)
    budgets = parse_budgets("20%:100%:7", chain) + [Budget(floor)]
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
        if best.status == "optimal" and not r.recompute:
            assert r.makespan_s >= best.makespan_s * (1 - max(best.gap, 1e-4)) - 1e-12, (r.method, r.budget_bytes)
        assert r.gap == pytest.approx(max(0.0, (r.makespan_s - r.bound_s) / r.makespan_s), abs=1e-12)
        assert r.slowdown == pytest.approx(r.makespan_s / chain.ideal_makespan_s)
    assert ilp[peak].status == "optimal" and ilp[peak].slowdown == pytest.approx(1.0)


def test_sweep_csv_round_trip(tmp_path):
    chain = synthetic_chain(6, seed=1)
    rows = sweep(chain, parse_budgets("30%,60%,100%", chain), ["ilp", "vdnn-all"], jobs=1)
    write_rows(tmp_path / "r.csv", rows)
    assert read_rows(tmp_path / "r.csv") == rows


def test_budget_ranges():
    chain = synthetic_chain(4, seed=1)
    peak = no_offload_peak(chain)
    assert [b.nbytes for b in parse_budgets("0%:100%:5", chain)] == [round(peak * k / 4) for k in range(5)]
    assert [b.nbytes for b in parse_budgets("1KiB,50%", chain)] == sorted([1024, peak // 2])
    assert parse_budgets("2KiB:2KiB:1", chain, total=True) == [Budget(2048, "total")]
    from offload.errors import FormatError
    with pytest.raises(FormatError, match="from 1 to 1000"):
        parse_budgets("20%:100%:1000000", chain)
    with pytest.raises(FormatError, match="fraction of a byte"):
        parse_budgets("0.3:1.0:8", chain)


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
    assert offload(["sweep", c, "--budgets", "20%:100%:3", "--methods", "ilp,relax-lp,vdnn-all,save-on-cpu",
                    "-j", "1", "--heuristic-time", "0.1", "-q", "-o", csv_path]) == 0
    out = capsys.readouterr().out
    assert "feasible from" in out and "wrote" in out
    assert offload(["plot", csv_path, "-o", str(tmp_path / "m.png"), "--title", "t"]) == 0
    h, w = _is_png(tmp_path / "m.png")
    assert w > 600 and h > 400
    budget = (smallest_feasible_budget(chain) + no_offload_peak(chain)) // 2
    save_schedule(solve(chain, budget, "ilp", Options(heuristic_time_s=0.1)).schedule, chain, tmp_path / "s.json")
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
    sim = solve(chain, budget, "ilp", Options(heuristic_time_s=0.1)).schedule.simulate(chain)
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




def test_every_method_has_a_style_of_its_own():
    """Each method is told apart in a sweep plot (five once shared one dark-grey line), its
    markers filled: a point not proven optimal is drawn hollow (checkpointing's line-art
    markers were drawn white on white there)."""
    from matplotlib.lines import Line2D

    from offload.analysis.plots import _STYLE
    assert set(_STYLE) == set(METHODS)
    assert len({(color, str(ls), marker) for color, ls, marker in _STYLE.values()}) == len(_STYLE)
    assert all(marker in Line2D.filled_markers for _, _, marker in _STYLE.values())


def test_a_timelines_title_counts_the_runs_it_recomputes_too():
    """A joint schedule that recomputes and offloads nothing was titled "0 units offloaded"
    above its re-runs (a transformers Jamba at 75%)."""
    from offload.analysis.plots import timeline_title
    from offload.analysis.timeline import timeline
    from offload.step.actions import Recompute
    from offload.step.schedule import make_schedule

    chain = load_chain(CHAINS / "gpt-b2-cpu.json")
    k = min(chain.recomputable)
    title = timeline_title(timeline(chain, make_schedule(chain, [], recompute=[Recompute(k, k)])))
    assert title.endswith("0 units offloaded, 1 run recomputed") and title.startswith(chain.name)
    assert timeline_title(timeline(chain, make_schedule(chain, []))).endswith("0 units offloaded")
