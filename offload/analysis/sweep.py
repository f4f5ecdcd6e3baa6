"""Every method at every budget of a range: the data behind the makespan-vs-budget plot.

A sweep is a grid of independent ``solve()`` calls, so it runs them in worker processes
(one MILP thread each, so that ``--jobs`` workers do not fight over cores) and writes one
CSV row per (method, budget).  A budget a method cannot meet is a row with status
``infeasible``, and a method that fails is a row with status ``error`` and its message:
the sweep itself never stops for either.
"""
from __future__ import annotations

import csv
import io
import math
import multiprocessing
import os
import re
import signal
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from offload.errors import FormatError, InfeasibleBudget, OffloadError
from offload.io.files import read_text, write_csv
from offload.solver.encoded_floor import floor
from offload.solver.methods import METHODS, RECOMPUTING, Options, solve
from offload.step.budget import Budget
from offload.step.chain import Chain
from offload.step.memory import no_offload_peak


@dataclass
class Row:
    """One (method, budget) of a sweep; the CSV's columns, in order."""

    chain: str
    method: str
    budget_bytes: int
    budget_share: float  # of the no-offload peak (activations) or of it plus base_bytes (total)
    scope: str
    status: str  # optimal (proven) | feasible | infeasible | error
    makespan_s: float | None
    ideal_makespan_s: float
    slowdown: float | None  # makespan / ideal
    bound_s: float | None  # best proven lower bound at this budget
    gap: float | None  # (makespan - bound) / makespan
    stall_s: float | None
    peak_bytes: int | None
    d2h_bytes: int | None
    h2d_bytes: int | None
    solve_s: float | None
    no_offload_peak_bytes: int
    smallest_feasible_bytes: int  # with the encodings the sweep allowed
    encodings: str = "none"  # which encodings the solver could choose (offload.step.encoding.MODES)
    encoded_units: int | None = None  # how many units the schedule stores encoded
    detail: str = ""
    recompute: bool = False  # whether the method could recompute (--recompute, or a recomputing method)
    recomputed_units: int | None = None  # how many units the schedule recomputes


COLUMNS = [f.name for f in fields(Row)]
ADDED_LATER = {"encodings": "none", "encoded_units": "",  # CSVs from before encodings lack these
               "recompute": "False", "recomputed_units": ""}  # ... and from before recomputation
STATUSES = ("optimal", "feasible", "infeasible", "error", "interrupted")


MAX_BUDGETS = 1000


def parse_budgets(text: str, chain: Chain, total: bool = False) -> list[Budget]:
    """``LO:HI:N`` (N evenly spaced budgets, both ends included, N <= 1000) or a comma list;
    each budget in bytes, a size (``6GiB``) or a share of the no-offload peak (``40%``)."""
    hint = "write LO:HI:N, e.g. 30%:100%:15, or a list, e.g. 40%,60%,2GiB"
    scope = "total" if total else "activations"
    parts = text.split(":")
    if len(parts) == 3:
        lo, hi = (Budget.parse(p, chain, total).nbytes for p in parts[:2])
        if not re.fullmatch(r"\s*\d+\s*", parts[2]) or not 1 <= int(parts[2]) <= MAX_BUDGETS:
            raise FormatError(f"the number of budgets {parts[2]!r} in {text!r} is not a whole number from 1 to "
                              f"{MAX_BUDGETS}", hint)
        n = int(parts[2])
        if hi < lo or (n == 1 and hi != lo):
            raise FormatError(f"budget range {text!r} is empty or ambiguous", hint)
        return [Budget(b, scope) for b in sorted({int(round(b)) for b in np.linspace(lo, hi, n)})]
    if len(parts) == 1:
        values = sorted({Budget.parse(p, chain, total).nbytes for p in text.split(",") if p.strip()})
        if len(values) > MAX_BUDGETS:
            raise FormatError(f"{len(values)} budgets, more than {MAX_BUDGETS}", hint)
        return [Budget(b, scope) for b in values]
    raise FormatError(f"cannot read budgets {text!r}", hint)


def parse_methods(text: str) -> list[str]:
    """``all`` or a comma list of method names, checked."""
    if text.strip() == "all":
        return list(METHODS)
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        raise FormatError(f"unknown method(s) {', '.join(unknown)}" if unknown else f"no method in {text!r}",
                          f"use all or a comma list of: {', '.join(METHODS)}")
    return names


def unsolved(chain: Chain, method: str, budget: Budget, options: Options, status: str) -> Row:
    """The row of a cell without a schedule: ``error`` until solved, ``interrupted`` if never."""
    peak = budget.counted(chain, no_offload_peak(chain))
    return Row(chain=chain.name, method=method, budget_bytes=budget.nbytes, budget_share=budget.nbytes / peak,
               scope=budget.scope,
               status=status, makespan_s=None, ideal_makespan_s=chain.ideal_makespan_s, slowdown=None, bound_s=None,
               gap=None, stall_s=None, peak_bytes=None, d2h_bytes=None, h2d_bytes=None, solve_s=None,
               no_offload_peak_bytes=peak, smallest_feasible_bytes=budget.counted(chain, floor(chain, options.encodings)[0]),
               encodings=options.encodings, recompute=options.recompute or method in RECOMPUTING)


def solve_one(chain: Chain, method: str, budget: Budget, options: Options) -> Row:
    """One cell of the sweep; never raises for a solver's failure (it becomes the row's status)."""
    row = unsolved(chain, method, budget, options, "error")
    try:
        res = solve(chain, budget, method, options)
    except InfeasibleBudget as exc:
        return replace(row, status="infeasible", detail=str(exc))
    except OffloadError as exc:
        return replace(row, detail=str(exc))
    except Exception as exc:  # a bug in one method must not cost the other cells
        return replace(row, detail=f"{type(exc).__name__}: {exc}")
    sim = res.simulation
    return replace(row, status="optimal" if res.status == "optimal" else "feasible", makespan_s=sim.makespan_s,
                   slowdown=sim.makespan_s / chain.ideal_makespan_s, bound_s=res.bound_s, gap=res.gap,
                   stall_s=sim.stall_s, peak_bytes=budget.counted(chain, sim.peak_bytes), d2h_bytes=sim.d2h_bytes,
                   h2d_bytes=sim.h2d_bytes, solve_s=res.seconds, encoded_units=len(res.schedule.encode),
                   recomputed_units=sum(len(r.stages) for r in res.schedule.recompute), detail=_detail(res.info))


def _detail(info: dict) -> str:
    """The solver's note, and the lower bounds left out as broken (``solve`` warns of them,
    but a sweep's warnings scroll away: the CSV keeps them)."""
    broken = info.get("broken_bounds")
    parts = [info.get("note", "")] + ([f"left out, above the replayed makespan (a defect, please report): "
                                        f"{', '.join(sorted(broken))}"] if broken else [])
    return "; ".join(p for p in parts if p)


def sweep(chain: Chain, budgets: Iterable[Budget | int], methods: Iterable[str], options: Options | None = None,
          jobs: int | None = None,
          progress: Callable[[Row], None] = lambda _: None) -> list[Row]:
    """Every method at every budget, in ``jobs`` processes (default: all cores); rows sorted by
    method (registry order) then budget.  ``progress(row)`` is called as each cell finishes."""
    options = options or Options()
    cells = [(m, Budget.of(b)) for m in methods for b in budgets]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(cells)))
    rows: list[Row] = []
    if jobs == 1:
        for m, b in cells:
            rows.append(solve_one(chain, m, b, options))
            progress(rows[-1])
    else:
        single = replace(options, threads=1)  # jobs processes, one solver thread each
        pool = multiprocessing.Pool(jobs, initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN))
        try:  # workers ignore Ctrl-C; the parent stops them all at once (queued cells are dropped)
            for row in pool.imap_unordered(_solve_cell, [(chain, m, b, single) for m, b in cells]):
                rows.append(row)
                progress(row)
            pool.close()
        except BaseException:
            pool.terminate()
            raise
        finally:
            pool.join()
    return ordered(rows)


def ordered(rows: Iterable[Row]) -> list[Row]:
    """Rows by method (registry order), then budget."""
    order = {m: k for k, m in enumerate(METHODS)}
    return sorted(rows, key=lambda r: (order.get(r.method, len(order)), r.budget_bytes))


def _solve_cell(cell: tuple) -> Row:
    return solve_one(*cell)


def write_rows(path: str | os.PathLike, rows: list[Row]) -> None:
    write_csv(path, [asdict(r) for r in rows], COLUMNS)


def read_rows(path: str | os.PathLike) -> list[Row]:
    """The rows of a sweep CSV, typed; a clear error for anything else."""
    p = Path(path)
    text = read_text(p, "sweep CSV")
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or []) and c not in ADDED_LATER]
        if missing:
            raise FormatError(f"{p} is not a sweep CSV: missing column(s) {', '.join(missing[:5])}",
                              "make it with `offload sweep CHAIN -o results.csv`")
        records = list(reader)
    except csv.Error as exc:
        raise FormatError(f"{p} is not a readable CSV: {exc}", "make it with `offload sweep CHAIN -o results.csv`") from None
    types = {f.name: f.type for f in fields(Row)}
    rows = []
    for n, rec in enumerate(records, 2):
        try:
            rows.append(Row(**{k: _typed(types[k], rec.get(k, ADDED_LATER.get(k))) for k in COLUMNS}))
        except ValueError as exc:
            raise FormatError(f"{p}, line {n}: {exc}", "the file was edited or truncated: run the sweep again") from None
        if rows[-1].status not in STATUSES:
            raise FormatError(f"{p}, line {n}: unknown status {rows[-1].status!r}", f"expected one of {', '.join(STATUSES)}")
    if not rows:
        raise FormatError(f"{p} holds no rows", "run the sweep again")
    return rows


def _typed(kind: str, text: str | None) -> object:
    """One CSV cell as its column's type; ValueError names what is wrong with it."""
    if text is None:  # csv.DictReader's filler for a row cut short
        raise ValueError("the row is cut short")
    if "None" in kind and text == "":
        return None
    if kind == "bool":
        if text not in ("True", "False"):
            raise ValueError(f"{text!r} is not True or False")
        return text == "True"
    if kind.startswith("int") or kind.startswith("float"):
        value = int(text) if kind.startswith("int") else float(text)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{text!r} is not a finite non-negative number")
        return value
    return text