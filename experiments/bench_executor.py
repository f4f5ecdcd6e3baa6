"""Executor benchmark (``make gpu-bench``): every promise measured, on the models people train.

A conv net, an fp32 transformer and a bf16-autocast transformer, each profiled on the
device, then solved and trained at 30%, 50% and 70% of its no-offload activation peak in
five ways: offloading only (``ilp``), recomputation and offloading jointly (``ilp
--recompute``), per-block activation checkpointing (``checkpoint-blocks``), the same with
each block's input offloaded as torchtune's ``OffloadActivations`` does
(``checkpoint-blocks-offload``) and our op-level checkpointing (``checkpoint-matmuls``: each
block keeps its matmul outputs where the profile measured that option to pay); and once per
model the same steps without offloading, under ``torch.autograd.graph.save_on_cpu`` and
with op-level selective checkpointing of the blocks (matmul outputs saved, the rest
recomputed: ``offload.core.selective``) (the user's alternatives: no budget, their peak is
what it is).  Every cell is trained
twice: timed as users train (their kernels, the ones profiled), with a ``torch.profiler``
trace from which the share of copy time hidden under kernels is read; and for
``--check-steps`` steps checking its gradients against training without offloading
(deterministic kernels on CUDA: other algorithms, other times and workspaces, so not the
timed run), both held to the budget::

    python -m experiments.bench_executor                  # on a GPU (make gpu-bench)
    python -m experiments.bench_executor --set smoke      # tiny sizes, seconds a cell on a CPU
    python -m experiments.bench_executor --models llama --resume   # the cells a stopped run did not reach

Each row: predicted and measured step time and activation peak, whether the peak stayed
within the budget, the copy overlap measured and the one the simulator implies (the share
of copy time during which the device runs an op, read the same way), how long the compute
stream waited for the host and for copies in the traced step beside the simulator's host
waits and stalls (``offload.executor.traces``: which part of the model a step that missed
its prediction missed), whether gradients matched (bit for bit, or within
the reference's own noise), and the exit code ``offload train`` would have given (0, 6 over
budget or out of memory, 7 gradients beyond the noise).  Everything lands in ``--out``
(default ``experiments/results/executor-<device>/``): ``summary.csv``, ``summary.md`` (the
table, with the machine named) and each run's report.  On a CPU the copies are memcpy and
the times include exact memory accounting: only the memory, byte and gradient columns mean
anything there.
"""
from __future__ import annotations

import argparse
import csv
import gc
import platform as pyplatform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from offload.core.devices import pick_device
from offload.errors import InfeasibleBudget, OffloadError
from offload.executor.report import Report
from offload.executor.train import TrainOptions, train
from offload.io.files import write_atomic, write_csv, write_json
from offload.io.text import format_bytes, format_seconds
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.methods import Options, solve
from offload.step.chain import Chain
from offload.step.chainfile import load_chain, save_chain
from offload.step.memory import no_offload_peak
from offload.step.schedule import make_schedule

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Model:
    name: str  # the zoo's
    batch: int
    options: dict = field(default_factory=dict)
    autocast: str | None = None

    @property
    def tag(self) -> str:
        return self.name + ("-" + self.autocast if self.autocast else "")


SETS = {
    "gpu": [  # the sizes of shared/gpu's first measurements: tens of GiB of activations on an 80 GB card
        Model("resnet50", 64, {"image": 224}),
        Model("llama", 8, {"layers": 12, "width": 1024, "heads": 16, "kv_heads": 16, "seq": 1024, "vocab": 32000,
                           "dropout": 0.1}),
        Model("llama", 4, {"layers": 16, "width": 2048, "heads": 32, "kv_heads": 8, "seq": 2048, "vocab": 32000},
              "bfloat16"),
    ],
    "smoke": [  # seconds a cell on a CPU: the tests, and make gpu-bench where there is no GPU
        Model("resnet18", 2, {"image": 32}),
        Model("llama", 2, {"layers": 3, "width": 32, "heads": 4, "kv_heads": 2, "seq": 16, "vocab": 64, "dropout": 0.1}),
        Model("llama", 2, {"layers": 3, "width": 32, "heads": 4, "kv_heads": 2, "seq": 16, "vocab": 64}, "bfloat16"),
    ],
}
SHARES = (0.3, 0.5, 0.7)
WAYS = {"offload": ("ilp", False), "joint": ("ilp", True), "checkpoint": ("checkpoint-blocks", False),
        "checkpoint_offload": ("checkpoint-blocks-offload", False), "matmuls": ("checkpoint-matmuls", False)}
FIELDS = ["model", "share", "way", "solver_status", "budget_bytes", "predicted_step_s", "measured_step_s", "step_error",
          "predicted_peak_bytes", "measured_peak_bytes", "within_budget", "copy_overlap", "predicted_overlap",
          "grads_match", "grads_within_noise", "exit", "d2h_bytes_per_step", "busy_s", "host_wait_s",
          "predicted_host_wait_s", "copy_wait_s", "predicted_stall_s", "blocking", "detail"]


def exit_code(report: Report, error: OffloadError | None) -> int:
    """What ``offload train`` would have exited with."""
    if error is not None:
        return error.exit_code
    return 7 if report.grads_within_noise is False and not report.lossy else 0


def within_budget(report: Report) -> bool | None:
    m = report.measured
    return None if report.budget is None or m.activation_peak_bytes is None else report.in_scope(m) <= report.budget.nbytes


def row(model: Model, share: float | str, way: str, report: Report | None, error: OffloadError | None,
        checked: Report | None, check_error: OffloadError | None, **extra) -> dict:
    """One line of the summary: ``report`` timed, ``checked`` (the same schedule under
    ``--check-grads``) for the gradients; the peak and the exit code are the worse of the two."""
    if report is None:
        return {"model": model.tag, "share": share, "way": way, **extra}
    m, p = report.measured, report.predicted
    overlap = (report.trace or {}).get("copy_overlap")
    device = (report.trace or {}).get("device_time") or {}
    peaks = [r.measured.activation_peak_bytes for r in (report, checked) if r.measured.activation_peak_bytes is not None]
    fits = [within_budget(r) for r in (report, checked)]
    return {"model": model.tag, "share": share, "way": way, **extra,
            "predicted_step_s": p.step_s, "measured_step_s": m.step_s,
            "step_error": m.step_s / p.step_s - 1 if m.step_s and p.step_s else None,
            "predicted_peak_bytes": p.activation_peak_bytes, "measured_peak_bytes": max(peaks, default=None),
            "within_budget": None if None in fits else all(fits),
            "copy_overlap": overlap["fraction"] if overlap else None, "predicted_overlap": p.copy_overlap,
            "grads_match": checked.grads_match,
            "grads_within_noise": checked.grads_within_noise,
            "exit": exit_code(report, error) or exit_code(checked, check_error),
            "d2h_bytes_per_step": m.d2h_bytes_per_step, "busy_s": device.get("busy_s"),
            "host_wait_s": device.get("host_wait_s"), "predicted_host_wait_s": p.host_wait_s,
            "copy_wait_s": device.get("copy_wait_s"), "predicted_stall_s": p.stall_s,
            "blocking": " ".join(f"{k}x{n}" for k, (n, _) in sorted(device.get("blocking", {}).items())),
            "detail": str(error or check_error or "")}


def bench_model(model: Model, device: str, out: Path, args: argparse.Namespace,
                done: set[tuple[str, str, str]] = frozenset()) -> Iterator[dict]:
    """Profile once (or, resuming, take the chain profiled before); every share and way; the
    baselines once; the cells in ``done`` (model, share, way) left out.  Rows of the summary,
    each as soon as it is measured (a run stopped at a time limit keeps what it measured)."""
    path = out / f"{model.tag}-chain.json"
    if args.resume and path.exists():
        chain = load_chain(path)
    else:
        chain = profile(model.name, ProfileOptions(batch=model.batch, device=device, repeats=args.repeats,
                                                   options=model.options, autocast=model.autocast)).chain
        save_chain(chain, path)
    peak = no_offload_peak(chain)
    for share in args.shares:
        for way in args.ways:
            if (model.tag, str(share), way) not in done:
                yield _cell(model, chain, share, way, int(share * peak), device, out, args)
                release(device)
    if (model.tag, "-", "no_offload") not in done:
        yield from _baselines(model, chain, device, out, args)
        release(device)


def earlier_rows(path: Path) -> list[dict]:
    """The rows of a summary written before (``--resume``), typed as the bench made them."""
    def typed(v: str) -> Any:
        return None if v == "" else v == "True" if v in ("True", "False") else v
    if not path.exists():
        return []
    with path.open(newline="") as fh:
        return [{k: typed(v) for k, v in r.items()} for r in csv.DictReader(fh)]


def release(device: str) -> None:
    """What a finished run left behind, freed before the next one is measured in this process."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _cell(model: Model, chain: Chain, share: float, way: str, budget: int, device: str, out: Path,
          args: argparse.Namespace) -> dict:
    method, recompute = WAYS[way]
    try:
        res = solve(chain, budget, method, Options(time_limit_s=args.time_limit, recompute=recompute))
    except InfeasibleBudget as exc:
        return row(model, share, way, None, None, None, None, solver_status="infeasible", budget_bytes=budget,
                   detail=str(exc))
    name = f"{model.tag}-{int(share * 100)}-{way}"
    # timed as users train (their kernels, as profiled; each op's memory read in step 1, the warm-up);
    # the gradients checked in a run of their own
    # (deterministic kernels on CUDA: other algorithms, other workspaces), held to the same budget
    report, error = train(None, chain, res.schedule, TrainOptions(steps=args.steps, device=device, op_memory=True,
                                                                  trace=str(out / f"{name}-trace.json")))
    write_json(out / f"{name}-run.json", report.json())
    checked, check_error = train(None, chain, res.schedule, TrainOptions(steps=args.check_steps, device=device,
                                                                         check_grads=True))
    write_json(out / f"{name}-check.json", checked.json())
    return row(model, share, way, report, error, checked, check_error, solver_status=res.status, budget_bytes=budget)


def _baselines(model: Model, chain: Chain, device: str, out: Path, args: argparse.Namespace) -> list[dict]:
    """No offloading, ``save_on_cpu`` and op-level selective checkpointing: the same steps, measured beside an
    empty schedule."""
    report, error = train(None, chain, make_schedule(chain, []),
                          TrainOptions(steps=args.steps, device=device, compare=True))
    write_json(out / f"{model.tag}-baselines-run.json", report.json())
    rows = []
    for way, other in (report.compare or {}).items():
        rows.append({"model": model.tag, "share": "-", "way": way, "measured_step_s": other.step_s,
                     "measured_peak_bytes": other.activation_peak_bytes, "exit": 6 if other.error else 0,
                     "detail": other.error or ""})
    return rows


def markdown(rows: list[dict], machine: str) -> str:
    """The summary as a markdown table, the machine named."""
    def cell(v, kind="") -> str:
        if v is None or v == "":
            return "-"
        if kind == "s":
            return format_seconds(float(v))
        if kind == "B":
            return format_bytes(int(v))
        if kind == "%":
            return f"{100 * float(v):+.1f}%"
        if kind == "share":
            return f"{float(v):.0%}"
        return str(v)
    lines = [f"Measured on {machine}.", "",
             "| model | budget | way | solver | predicted | measured | error | peak pred / meas | in budget "
             "| overlap meas / sim | waits for host, copies: meas / pred | grads | exit |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = cell(r.get("share"), "share") if r.get("share") not in ("-", None) else "-"
        overlap = "/".join(f"{float(x):.0%}" if x is not None else "-" for x in (r.get("copy_overlap"), r.get("predicted_overlap")))
        grads = "-" if r.get("grads_match") is None else ("bit-exact" if r["grads_match"] else
                                                         "within noise" if r.get("grads_within_noise") else "DIFFER")
        waits = (f"{cell(r.get('host_wait_s'), 's')}, {cell(r.get('copy_wait_s'), 's')} / "
                 f"{cell(r.get('predicted_host_wait_s'), 's')}, {cell(r.get('predicted_stall_s'), 's')}"
                 if r.get("busy_s") is not None else "-")
        lines.append(f"| {r['model']} | {share} | {r['way']} | {cell(r.get('solver_status'))} | "
                     f"{cell(r.get('predicted_step_s'), 's')} | "
                     f"{cell(r.get('measured_step_s'), 's')} | {cell(r.get('step_error'), '%')} | "
                     f"{cell(r.get('predicted_peak_bytes'), 'B')} / {cell(r.get('measured_peak_bytes'), 'B')} | "
                     f"{cell(r.get('within_budget'))} | {overlap} | {waits} | {grads} | {cell(r.get('exit'))} |")
    return "\n".join(lines) + "\n"


def machine_name(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"a CPU ({pyplatform.processor() or pyplatform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=list(SETS), default=None, help="model sizes (default: gpu on a GPU, else smoke)")
    ap.add_argument("--models", nargs="*", help="only these models of the set (tags: resnet50, llama, llama-bfloat16)")
    ap.add_argument("--shares", nargs="*", type=float, default=list(SHARES), help="budgets as shares of the peak")
    ap.add_argument("--ways", nargs="*", choices=list(WAYS), default=list(WAYS), help="schedules to train")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--steps", type=int, default=6, help="timed training steps per run (6; on a GPU the first is a warm-up)")
    ap.add_argument("--check-steps", type=int, default=2, help="steps of the gradient-checking run of each cell (2)")
    ap.add_argument("--repeats", type=int, default=5, help="profiling repeats (5)")
    ap.add_argument("--time-limit", type=float, default=30, help="solve time limit in seconds (30)")
    ap.add_argument("--out", type=Path, help="results folder (default experiments/results/executor-<device>)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows already in --out's summary.csv and run only the missing cells, on the chains "
                         "profiled there (a bench spread over several short windows of a GPU)")
    args = ap.parse_args(argv)
    device = pick_device(args.device).type
    todo = [m for m in SETS[args.set or ("gpu" if device == "cuda" else "smoke")]
            if not args.models or m.tag in args.models]
    if not todo:
        ap.error(f"no model of the set is in {args.models}")
    out = args.out or RESULTS / f"executor-{device}"
    out.mkdir(parents=True, exist_ok=True)
    rows = earlier_rows(out / "summary.csv") if args.resume else []
    done = {(str(r["model"]), str(r["share"]), str(r["way"])) for r in rows}
    for model in todo:
        print(f"{model.tag}: profiling, then {len(args.shares) * len(args.ways)} runs and the baselines",
              file=sys.stderr, flush=True)
        for r in bench_model(model, device, out, args, done):
            rows.append(r)
            print(f"  {r['model']} {r['share']} {r['way']}: exit {r.get('exit', '-')}", file=sys.stderr, flush=True)
            write_csv(out / "summary.csv", rows, FIELDS)
            table = markdown(rows, machine_name(device))
            write_atomic(out / "summary.md", lambda fh: fh.write(table))
    print(markdown(rows, machine_name(device)))
    print(f"wrote {out / 'summary.csv'} and {out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
