"""The whole pipeline in one command (``make demo``): profile, sweep, plot, solve, train.

Each step is the ``offload`` command a user would type, run in this process and printed
before it runs, so the demo's output is exactly what those commands print::

    offload profile resnet18 --batch 8 -O image=64 -o demo/chain.json
    offload sweep demo/chain.json --budgets 20%:100%:9 -o demo/results.csv
    offload plot demo/results.csv -o demo/makespan.png
    offload solve demo/chain.json --budget <B> -o demo/schedule.json
    offload plot --timeline demo/chain.json demo/schedule.json -o demo/timeline.png
    offload trace demo/chain.json demo/schedule.json -o demo/trace.json
    offload train --chain demo/chain.json --schedule demo/schedule.json --steps 3 --check-grads

The budget ``<B>`` is halfway between the smallest feasible budget and the no-offload peak
(printed), so that the schedule offloads something at every model size.  On a CPU it all
takes a few minutes; ``--device cuda`` runs it on a GPU.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from offload.cli import main as offload
from offload.step.chainfile import load_chain
from offload.step.memory import no_offload_peak, smallest_feasible_budget


def run(argv: list[str]) -> None:
    print(f"\n$ offload {shlex.join(argv)}", flush=True)
    t0 = time.perf_counter()
    rc = offload(argv)
    print(f"({time.perf_counter() - t0:.1f} s)", flush=True)
    if rc != 0:
        raise SystemExit(f"demo: `offload {argv[0]}` failed with exit code {rc}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet18", help="zoo model (default resnet18)")
    ap.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    ap.add_argument("-O", dest="option", action="append", default=None, metavar="KEY=VALUE",
                    help="model option (default for the zoo CNNs: image=64)")
    ap.add_argument("--budgets", default="20%:100%:9", help="sweep budgets (default 20%%:100%%:9)")
    ap.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--out", type=Path, default=Path("demo"), help="folder for every output (default demo/)")
    args = ap.parse_args(argv)
    options = args.option if args.option is not None else (["image=64"] if args.model != "gpt" else [])
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    chain_path, schedule = str(out / "chain.json"), str(out / "schedule.json")
    t0 = time.perf_counter()
    run(["profile", args.model, "--batch", str(args.batch), "--device", args.device, "--repeats", "3", "--quiet",
         *[a for o in options for a in ("-O", o)], "-o", chain_path])
    run(["show", chain_path])
    run(["sweep", chain_path, "--budgets", args.budgets, "--time-limit", "30", "--quiet",
         "-o", str(out / "results.csv")])
    run(["plot", str(out / "results.csv"), "-o", str(out / "makespan.png")])
    chain = load_chain(chain_path)
    budget = (smallest_feasible_budget(chain) + no_offload_peak(chain)) // 2
    print(f"\nbudget for the schedule: halfway between the smallest feasible budget and the no-offload peak, "
          f"{budget} B ({100 * budget / no_offload_peak(chain):.0f}% of the peak)")
    run(["solve", chain_path, "--budget", str(budget), "--time-limit", "30", "-o", schedule])
    run(["plot", "--timeline", chain_path, schedule, "-o", str(out / "timeline.png")])
    run(["trace", chain_path, schedule, "-o", str(out / "trace.json")])
    run(["train", args.model, "--chain", chain_path, "--schedule", schedule, "--steps", str(args.steps),
         "--device", args.device, "--check-grads", "--report", str(out / "run.json")])
    print(f"\ndemo done in {time.perf_counter() - t0:.0f} s; outputs in {out}/: chain.json results.csv makespan.png "
          "schedule.json timeline.png trace.json run.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
