"""How much of the copy time a ``torch.profiler`` trace shows hidden behind GPU compute.

The executor's whole point is that D2H and H2D copies run on side streams while kernels run
on the compute stream; a Chrome trace shows it, and this module turns the picture into two
numbers: the copy time, and the part of it during which some kernel was running.
"""
from __future__ import annotations

from typing import Any

from offload.step.intervals import Interval, hidden, union

def copy_overlap(events: list[dict[str, Any]]) -> dict[str, float] | None:
    """``copy_s`` (D2H and H2D memcpy time, as a union), ``overlapped_s`` (of it, while a kernel
    ran) and ``fraction``, from the ``traceEvents`` of a Chrome trace; ``None`` when the trace
    holds no GPU copies (a CPU run, or a schedule that moves nothing)."""
    def spans(category: str, names: tuple[str, ...] = ()) -> list[Interval]:
        return union((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("ph") == "X" and e.get("cat") == category
                     and (not names or any(n in e.get("name", "") for n in names)))
    copies = spans("gpu_memcpy", ("DtoH", "HtoD", "Device -> Pinned", "Pinned -> Device"))
    if not copies:
        return None
    copy_us, hidden_us = hidden(copies, spans("kernel"))
    return {"copy_s": copy_us * 1e-6, "overlapped_s": hidden_us * 1e-6, "fraction": hidden_us / copy_us}
