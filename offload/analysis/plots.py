"""The two pictures: makespan vs budget for every method, and one schedule's timeline.

matplotlib with the Agg backend (files only, no display needed).  Budgets and memory are
drawn in binary units chosen by magnitude, times in ms or s, so axes read at a glance.
"""
from __future__ import annotations

import os
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from offload.io.files import write_atomic  # noqa: E402

from .sweep import Row  # noqa: E402
from .timeline import Timeline  # noqa: E402

# one style per method, stable across figures: the exact and heuristic methods solid, offloading
# baselines dashed, encodings dash-dotted, recomputation dotted (a test checks every method has one);
# filled markers only: a point not proven optimal is drawn hollow (white inside its edge)
_STYLE = {
    "ilp": ("black", "-", "o"), "relax-lp": ("tab:blue", "-", "s"), "relax-bw": ("tab:cyan", "-", "^"),
    "none": ("tab:gray", ":", "h"), "vdnn-all": ("tab:red", "--", "v"), "vdnn-conv": ("tab:orange", "--", "<"),
    "vdnn-dyn": ("tab:brown", "--", ">"), "layrub": ("tab:purple", "--", "D"), "swap-idle": ("tab:green", "-.", "P"),
    "swap-size-idle": ("olive", "-.", "X"), "save-on-cpu": ("tab:pink", ":", "*"),
    "torch-offload": ("deeppink", "--", "s"),
    "gist": ("teal", (0, (5, 1, 1, 1)), "d"), "gist-swap": ("darkslateblue", (0, (5, 1, 1, 1)), "p"),
    "recompute-only": ("darkgoldenrod", (0, (1, 1)), "8"), "checkpoint-sqrt": ("firebrick", (0, (1, 2)), "v"),
    "checkpoint-blocks": ("darkgreen", (0, (1, 2)), "^"), "checkpoint-matmuls": ("limegreen", (0, (1, 2)), "H"),
    "checkpoint-every-other-matmul": ("yellowgreen", (0, (1, 2)), "<"),
    "checkpoint-blocks-offload": ("seagreen", (0, (3, 1, 1, 1)), ">"),
    "checkpoint-matmuls-offload": ("mediumseagreen", (0, (3, 1, 1, 1)), "D"),
}


def _byte_unit(n: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= 2 * scale:
            return scale, name
    return 1, "B"


def _time_unit(s: float) -> tuple[float, str]:
    return (1.0, "s") if s >= 1 else (1e-3, "ms") if s >= 1e-3 else (1e-6, "µs")


def _save(fig: plt.Figure, path: str | os.PathLike) -> None:
    fmt = os.path.splitext(str(path))[1].lstrip(".").lower() or "png"
    write_atomic(path, lambda fh: fig.savefig(fh, format=fmt, dpi=110, bbox_inches="tight"), binary=True)
    plt.close(fig)


def plot_sweep(rows: list[Row], path: str | os.PathLike, title: str | None = None) -> None:
    """Makespan relative to the ideal vs budget, one line per method, one panel per chain.

    Filled markers are proven optimal, hollow ones feasible; the grey band is below the
    smallest budget any schedule meets, and a method's line starts at its own smallest
    feasible budget of the sweep (named in the legend)."""
    by_chain: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by_chain[r.chain].append(r)
    n = len(by_chain)
    cols = min(n, 2)
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(7.5 * cols, 4.6 * ((n + cols - 1) // cols)),
                             squeeze=False)
    for ax, (chain, chain_rows) in zip(axes.flat, by_chain.items()):
        _sweep_panel(ax, chain, chain_rows, legend=n == 1)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if n > 1:  # one legend for all panels (a method has the same style everywhere), below them
        handles, labels = _legend_entries(axes.flat[0], short=True)
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0), ncol=6, fontsize=8)
    _save(fig, path)


def _legend_entries(ax: plt.Axes, short: bool = False) -> tuple[list, list[str]]:
    handles, labels = ax.get_legend_handles_labels()
    if short:
        labels = [label.split(" (")[0] for label in labels]
    handles.append(Patch(facecolor="white", edgecolor="0.3"))
    labels.append("filled: proven optimal, hollow: feasible")
    return handles, labels


def _sweep_panel(ax: plt.Axes, chain: str, rows: list[Row], legend: bool) -> None:
    scale, unit = _byte_unit(max(r.budget_bytes for r in rows))
    floor, peak = rows[0].smallest_feasible_bytes, rows[0].no_offload_peak_bytes
    lo, hi = min(r.budget_bytes for r in rows), max(r.budget_bytes for r in rows)
    if lo < floor:
        ax.axvspan(lo / scale, floor / scale, color="0.88", zorder=0)
        recomputing = any(r.recompute for r in rows)
        ax.text((lo + min(floor, hi)) / 2 / scale, 0.98, "no offloading schedule fits" if recomputing else
                "no offloading schedule fits\n(recomputation may: sweep --recompute)",
                transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=8, color="0.35")
    ax.axvline(peak / scale, color="0.6", lw=0.8, ls=":")
    by_method: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by_method[r.method].append(r)
    for method, mrows in by_method.items():
        color, ls, marker = _STYLE.get(method, ("0.3", "-", "."))
        ok = [r for r in mrows if r.status in ("optimal", "feasible")]
        if not ok:
            ax.plot([], [], color=color, ls=ls, marker=marker, label=f"{method} (infeasible throughout)")
            continue
        xs = [r.budget_bytes / scale for r in ok]
        ax.plot(xs, [r.slowdown for r in ok], color=color, ls=ls, lw=1.3,
                label=f"{method} (from {min(r.budget_bytes for r in ok) / scale:.3g} {unit})")
        for filled in (True, False):
            pts = [r for r in ok if (r.status == "optimal") == filled]
            ax.scatter([r.budget_bytes / scale for r in pts], [r.slowdown for r in pts], marker=marker, s=22,
                       color=color if filled else "white", edgecolors=color, linewidths=1, zorder=3)
        errors = [r for r in mrows if r.status == "error"]
        if errors:
            ax.scatter([r.budget_bytes / scale for r in errors], [1.0] * len(errors), marker="$!$", color=color, s=40)
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.set_xlabel(f"memory budget ({rows[0].scope}, {unit}); dotted: no-offload peak {peak / scale:.3g} {unit}")
    ax.set_ylabel("step time / ideal (no stall)")
    ax.set_title(f"{chain}: ideal step {_fmt_time(rows[0].ideal_makespan_s)}", fontsize=10)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(*_legend_entries(ax), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), framealpha=0.9)


def _fmt_time(s: float) -> str:
    scale, unit = _time_unit(s)
    return f"{s / scale:.3g} {unit}"


def timeline_title(t: Timeline) -> str:
    """The timeline's title: chain, method, predicted step against the ideal, and what the
    schedule does (the runs it recomputes too: a joint schedule that offloads nothing read
    "0 units offloaded" above its re-runs)."""
    sim, runs = t.simulation, len(t.schedule.recompute)
    return (f"{t.chain.name}, {t.schedule.method or 'schedule'}: step {_fmt_time(sim.makespan_s)} "
            f"(ideal {_fmt_time(t.chain.ideal_makespan_s)}, stalls {_fmt_time(sim.stall_s)}), "
            f"{sum(1 for s in t.spans if s.lane == 'D2H')} units offloaded"
            + (f", {runs} run{'s' if runs != 1 else ''} recomputed" if runs else ""))


def plot_timeline(t: Timeline, path: str | os.PathLike) -> None:
    """Lanes for compute, D2H and H2D (stalls in red) above the memory curve with the budget line."""
    sim = t.simulation
    tscale, tunit = _time_unit(sim.makespan_s)
    mscale, munit = _byte_unit(max(m for _, _, m in t.memory))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 5.5), sharex=True, gridspec_kw={"height_ratios": [1.1, 1]})
    lanes = [lane for lane in ("compute", "codec", "D2H", "H2D") if lane != "codec" or any(s.lane == "codec" for s in t.spans)]
    rows = {lane: len(lanes) - 1 - k for k, lane in enumerate(lanes)}
    colors = {"F": "tab:blue", "B": "tab:orange", "R": "tab:cyan", "stall": "tab:red", "codec": "tab:olive",
              "D2H": "tab:green", "H2D": "tab:purple"}
    span_min = sim.makespan_s / 60  # label bars wide enough to hold text
    for s in t.spans:
        key = s.name if s.name == "stall" else (s.lane if s.lane != "compute" else s.name[0])
        top.broken_barh([(s.start / tscale, (s.end - s.start) / tscale)], (rows[s.lane] - 0.38, 0.76),
                        facecolors=colors[key], edgecolors="white", linewidth=0.4,
                        hatch="////" if s.name == "stall" else None, alpha=0.9)
        if s.name != "stall" and s.end - s.start >= span_min:
            top.text((s.start + s.end) / 2 / tscale, rows[s.lane], s.name, ha="center", va="center", fontsize=6,
                     color="white")
    top.set_yticks(list(rows.values()), list(rows))
    top.set_ylim(-0.6, len(lanes) - 0.4)
    top.legend(handles=[Patch(color=colors[k], label={"R": "R (re-run F)"}.get(k, k))
                        for k in ("F", "B", "R", "stall", *(("codec",) if "codec" in rows else ()), "D2H", "H2D")],
               ncol=7, fontsize=7, loc="upper right", bbox_to_anchor=(1, 1.18))
    top.set_title(timeline_title(t), fontsize=10, loc="left")
    xs, ys = [], []
    for start, end, nbytes in t.memory:
        xs += [start / tscale, end / tscale]
        ys += [nbytes / mscale, nbytes / mscale]
    bottom.fill_between(xs, ys, color="tab:blue", alpha=0.25, step=None)
    bottom.plot(xs, ys, color="tab:blue", lw=1)
    if t.budget_bytes is not None:
        bottom.axhline(t.budget_bytes / mscale, color="tab:red", ls="--", lw=1,
                       label=f"budget {t.budget_bytes / mscale:.3g} {munit}")
    bottom.axhline((sim.peak_bytes + t.base_bytes) / mscale, color="0.4", ls=":", lw=0.8,
                   label=f"peak {(sim.peak_bytes + t.base_bytes) / mscale:.3g} {munit}")
    bottom.legend(fontsize=7, loc="upper right")
    scope = "total" if t.base_bytes else "activation"
    bottom.set_ylabel(f"{scope} memory ({munit})")
    bottom.set_xlabel(f"time ({tunit})")
    bottom.set_ylim(bottom=0)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path)


def plot_bars(panels: dict[str, dict[str, list[float | None]]], groups: list[str], ylabel: str,
              path: str | os.PathLike, legend: str = "", columns: int = 2) -> None:
    """Grouped bars, one panel per key of ``panels`` (series name -> one value per group);
    ``None`` is drawn as a cross on the 1.0 line: no value there (infeasible)."""
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 3.5 * rows), sharey=True, squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels.items()):
        width = 0.8 / len(series)
        for k, (name, values) in enumerate(series.items()):
            xs = [n + (k - (len(series) - 1) / 2) * width for n in range(len(groups))]
            ax.bar([x for x, v in zip(xs, values) if v is not None], [v for v in values if v is not None], width,
                   label=f"{legend}{name}", color=f"C{k}")
            ax.plot([x for x, v in zip(xs, values) if v is None], [1.0] * sum(v is None for v in values), "x",
                    color=f"C{k}", markersize=9)
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xticks(range(len(groups)), groups, rotation=20)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    axes[0][0].legend(fontsize=8, title="x: infeasible", title_fontsize=8)
    fig.tight_layout()
    _save(fig, path)
