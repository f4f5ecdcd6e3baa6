"""How much of the time this process was ready to run it waited for a CPU that other
processes held: what says that its timings were taken on a busy machine.

Linux counts, for each thread, the nanoseconds it ran and those it spent on a run queue,
ready but with no CPU free (``/proc/<pid>/task/<tid>/schedstat``, the scheduler's
``run_delay``).  A measurement whose threads waited a large share of their running time
was slowed by other processes, not by the model: on the 2-core machine this project is
developed on, a profile taken while a benchmark ran timed the ops about 2.6 times slower,
and a schedule solved on it was predicted that much slower than it then ran.  Waits of the
process's own threads for each other count too, which a training step's intra-op threads,
as many as the cores, rarely do.  Where the counters cannot be read (not Linux, schedstat
compiled out: zeros), the share is ``None``.
"""
from __future__ import annotations

import os
from pathlib import Path

BUSY_SHARE = 0.1  # a wait above this share of the running time is worth a warning


def _counters() -> dict[str, tuple[int, int]]:
    """Thread id -> (nanoseconds run, nanoseconds waited for a CPU), of this process's live threads."""
    out = {}
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            ran, waited = (int(x) for x in (task / "schedstat").read_text().split()[:2])
        except (OSError, ValueError):  # the thread ended while read, or no such counters
            continue
        out[task.name] = (ran, waited)
    return out


class CpuWait:
    """Started at construction; ``share()`` the wait for a CPU over the time run since, by the
    threads alive at the reading (a thread that ended in between is not counted)."""

    def __init__(self) -> None:
        self.start = _counters()

    def share(self) -> float | None:
        """Nanoseconds waited over nanoseconds run since the start, to a thousandth (what the
        chain and the report keep; ``None``: nothing counted)."""
        ran = waited = 0
        for tid, (r, w) in _counters().items():
            r0, w0 = self.start.get(tid, (0, 0))
            ran, waited = ran + r - r0, waited + w - w0
        return round(waited / ran, 3) if ran > 0 else None


def busy_warning(share: float | None, what: str) -> list[str]:
    """The warning that ``what`` (a profile, a run) was measured on a busy machine, where its
    threads waited for a CPU more than ``BUSY_SHARE`` of the time they ran; else none."""
    if share is None or share <= BUSY_SHARE:
        return []
    return [f"{what} waited for a CPU {share:.0%} of the time it ran (other processes held them): its times are "
            "slower than the model's own; measure again on a quiet machine"]
