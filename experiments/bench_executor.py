"""Executor benchmark: our step against the prediction, against no offloading and against ``save_on_cpu``.

For ResNet-50 and the GPT decoder (the zoo's reference sizes on a GPU: ResNet-50 at batch
64, 224x224; GPT-2 small at batch 8, sequence 1024), in one command::

    python -m experiments.bench_executor                  # on a GPU
    python -m experiments.bench_executor --set small      # reduced sizes (a CPU finishes them)

each model is profiled, the ILP solves it at 50% of its no-offload activation peak, and
``offload train`` runs the schedule with ``--check-grads --compare --trace``: measured vs
predicted step time and peak, bytes moved, the share of copy time hidden under kernels (from
the ``torch.profiler`` trace, GPU only), and our median step time as a multiple of the same
steps without offloading and under ``torch.autograd.graph.save_on_cpu``.

Everything lands in ``--out`` (default ``experiments/results/executor-<device>/``): each
model's chain, schedule, run report and trace, and ``summary.csv`` with one row per model.
On a CPU the times include the exact memory accounting and the copies are memcpy, so only
the memory and byte columns mean anything there.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from offload.core.devices import pick_device
from offload.executor.train import TrainOptions, train
from offload.io.files import write_csv, write_json
from offload.io.text import format_bytes, format_seconds
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.methods import Options, solve
from offload.step.chainfile import save_chain
from offload.step.memory import no_offload_peak, smallest_feasible_budget
from offload.step.schedulefile import save_schedule

from .profile_zoo import SETS

RESULTS = Path(__file__).parent / "results"
MODELS = ("resnet50", "gpt")
FIELDS = ["model", "batch", "device", "stages", "budget_bytes", "budget_share", "solver_status", "predicted_step_s", "measured_step_s",
          "step_time_error", "predicted_peak_bytes", "measured_peak_bytes", "peak_within_budget", "d2h_bytes",
          "h2d_bytes", "copy_overlap", "no_offload_step_s", "save_on_cpu_step_s", "vs_no_offload", "vs_save_on_cpu",
          "no_offload_peak_bytes", "save_on_cpu_peak_bytes", "grads_match"]


def bench_model(model: str, batch: int, options: dict, device: str, out: Path, args: argparse.Namespace) -> dict:
    """Profile, solve at ``args.share`` of the no-offload peak, train; one summary row."""
    chain = profile(model, ProfileOptions(batch=batch, device=device, repeats=args.repeats, options=options)).chain
    save_chain(chain, out / f"{model}-chain.json")
    peak = no_offload_peak(chain)
    budget = int(args.share * peak)
    if budget < smallest_feasible_budget(chain):
        budget = smallest_feasible_budget(chain)
        print(f"{model}: {args.share:.0%} of the peak is infeasible; using the smallest feasible budget, "
              f"{budget / peak:.0%}", file=sys.stderr)
    res = solve(chain, budget, "ilp", Options(time_limit_s=args.time_limit))
    save_schedule(res.schedule, chain, out / f"{model}-schedule.json")
    report, error = train(None, chain, res.schedule, TrainOptions(
        steps=args.steps, device=device, check_grads=True, compare=True, trace=str(out / f"{model}-trace.json")))
    write_json(out / f"{model}-run.json", report.json())
    if error is not None:
        print(f"{model}: {error}", file=sys.stderr)
    m, p, c = report.measured, report.predicted, report.compare or {}
    overlap = (report.trace or {}).get("copy_overlap")
    return {
        "model": model, "batch": batch, "device": report.device, "stages": chain.L, "budget_bytes": budget,
        "budget_share": budget / peak,
        "solver_status": res.status, "predicted_step_s": p.step_s, "measured_step_s": m.step_s,
        "step_time_error": m.step_s / p.step_s - 1 if m.step_s else None,
        "predicted_peak_bytes": p.activation_peak_bytes, "measured_peak_bytes": m.activation_peak_bytes,
        "peak_within_budget": m.activation_peak_bytes is not None and m.activation_peak_bytes <= budget,
        "d2h_bytes": m.d2h_bytes_per_step, "h2d_bytes": m.h2d_bytes_per_step,
        "copy_overlap": overlap["fraction"] if overlap else None,
        **_baseline(c, "no_offload"), **_baseline(c, "save_on_cpu"),
        "grads_match": report.grads_match,
    }


def _baseline(compare: dict, way: str) -> dict:
    """The median step time, the peak and our step over its of one ``--compare`` baseline, as summary columns."""
    run = compare.get(way)
    return {f"{way}_step_s": run and run.step_s, f"{way}_peak_bytes": run and run.activation_peak_bytes,
            f"vs_{way}": run and run.our_step_ratio}


def _print(rows: list[dict]) -> None:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:+.1f}%"

    def times(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"
    print(f"{'model':<10}{'step meas/pred':>24}{'error':>9}{'peak meas/budget':>26}{'overlap':>9}"
          f"{'vs no-offload':>15}{'vs save_on_cpu':>16}{'grads':>7}")
    for r in rows:
        step = f"{format_seconds(r['measured_step_s']) if r['measured_step_s'] else '-'}/{format_seconds(r['predicted_step_s'])}"
        peak = f"{format_bytes(r['measured_peak_bytes']) if r['measured_peak_bytes'] else '-'}/{format_bytes(r['budget_bytes'])}"
        overlap = "-" if r["copy_overlap"] is None else f"{r['copy_overlap']:.0%}"
        print(f"{r['model']:<10}{step:>24}{pct(r['step_time_error']):>9}{peak:>26}{overlap:>9}"
              f"{times(r['vs_no_offload']):>15}{times(r['vs_save_on_cpu']):>16}{str(r['grads_match']):>7}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=list(SETS), default="reference", help="model sizes (profile_zoo's sets)")
    ap.add_argument("--models", nargs="*", default=list(MODELS), help="models of the set (default: resnet50 gpt)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--share", type=float, default=0.5, help="budget as a share of the no-offload peak (0.5)")
    ap.add_argument("--steps", type=int, default=20, help="measured training steps per way (20)")
    ap.add_argument("--repeats", type=int, default=10, help="profiling repeats (10)")
    ap.add_argument("--time-limit", type=float, default=120, help="ILP time limit in seconds (120)")
    ap.add_argument("--out", type=Path, help="results folder (default experiments/results/executor-<device>)")
    args = ap.parse_args(argv)
    device = pick_device(args.device).type
    out = args.out or RESULTS / f"executor-{device}"
    out.mkdir(parents=True, exist_ok=True)
    todo = [(m, b, o) for m, b, o in SETS[args.set] if m in args.models]
    if not todo:
        ap.error(f"none of {args.models} is in the {args.set!r} set")
    rows = [bench_model(m, b, o, device, out, args) for m, b, o in todo]
    write_csv(out / "summary.csv", rows, FIELDS)
    _print(rows)
    print(f"wrote {out / 'summary.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
