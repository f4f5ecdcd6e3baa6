"""What a ``torch.profiler`` trace of one training step shows, read the way the simulator
reads its own timeline (``offload.step.intervals``).

The executor's whole point is that D2H and H2D copies run on side streams while kernels run
on the compute stream, and its promise is a step as long as the simulator says.  A Chrome
trace shows both, and this module turns the picture into numbers:

* ``copy_overlap``: the copy time, and the part of it during which some kernel was running;
* ``device_time``: where the compute stream's time went - running work, waiting for the host
  to launch it (a host-bound step: Python, hooks, re-runs issued again), waiting for a copy
  (an event of a side stream), or neither (launch latency) - and the host's calls to the
  CUDA runtime that may block it (synchronizations, ``cudaMalloc``/``cudaFree`` when the
  caching allocator grows or empties, pinned allocations).  Set beside the simulator's
  ``host_wait_s`` and ``stall_s``, it says which part of the model a measured step missed.
"""
from __future__ import annotations

from typing import Any

from offload.step.intervals import Interval, hidden, union

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_COPIES = ("DtoH", "HtoD", "Device -> Pinned", "Pinned -> Device")
# runtime calls that may make the host wait for the device (or for the driver)
BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMalloc", "cudaFree",
            "cudaHostAlloc", "cudaMallocHost", "cudaFreeHost", "cudaHostRegister", "cudaHostUnregister",
            "cudaMemcpy", "cudaMemset")


def _complete(events: list[dict[str, Any]], category: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") == category]


def _copies(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in _complete(events, "gpu_memcpy") if any(n in e.get("name", "") for n in HOST_COPIES)]


def copy_overlap(events: list[dict[str, Any]]) -> dict[str, float] | None:
    """``copy_s`` (D2H and H2D memcpy time, as a union), ``overlapped_s`` (of it, while a kernel
    ran) and ``fraction``, from the ``traceEvents`` of a Chrome trace; ``None`` when the trace
    holds no GPU copies (a CPU run, or a schedule that moves nothing)."""
    copies = union((e["ts"], e["ts"] + e["dur"]) for e in _copies(events))
    if not copies:
        return None
    copy_us, hidden_us = hidden(copies, ((e["ts"], e["ts"] + e["dur"]) for e in _complete(events, "kernel")))
    return {"copy_s": copy_us * 1e-6, "overlapped_s": hidden_us * 1e-6, "fraction": hidden_us / copy_us}


def _within(gap: Interval, spans: list[Interval]) -> float:
    """How much of ``gap`` the (disjoint, sorted) ``spans`` cover."""
    return sum(max(0.0, min(b, gap[1]) - max(a, gap[0])) for a, b in spans)


def device_time(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Where the compute stream's time went in a traced step (seconds): ``span_s`` from its
    first work to its last, ``busy_s`` running kernels (and its own copies and memsets),
    and its idle gaps split three ways - ``host_wait_s`` before the host had launched the
    work that ended the gap, ``copy_wait_s`` after the launch while a copy of another stream
    ran (a wait for its event), ``other_s`` the rest (launch latency, other waits) - and
    ``blocking`` (runtime call name -> [count, seconds]) among the calls the host made
    before its last launch (the step's own, not the trace's closing synchronization).
    ``None`` without GPU work (a CPU run).  The compute stream is the one with the most
    kernel time; a kernel's launch is found by its ``correlation`` id."""
    gpu = [e for c in GPU_CATEGORIES for e in _complete(events, c)]
    kernels = [e for e in gpu if e.get("cat") == "kernel"]
    if not kernels:
        return None
    time_on: dict[Any, float] = {}
    for e in kernels:
        stream = e.get("args", {}).get("stream")
        time_on[stream] = time_on.get(stream, 0.0) + e["dur"]
    compute = max(time_on, key=time_on.get)
    runtime = _complete(events, "cuda_runtime") + _complete(events, "cuda_driver")
    launched = {e["args"]["correlation"]: e["ts"] + e["dur"] for e in runtime if "correlation" in e.get("args", {})}
    work = sorted((e for e in gpu if e.get("args", {}).get("stream") == compute), key=lambda e: e["ts"])
    copies = union((e["ts"], e["ts"] + e["dur"]) for e in _copies(events) if e.get("args", {}).get("stream") != compute)
    host = copy = other = 0.0
    end = work[0]["ts"] + work[0]["dur"]
    for e in work[1:]:
        if e["ts"] > end:
            issued = launched.get(e.get("args", {}).get("correlation"), end)
            waited_host = min(max(issued - end, 0.0), e["ts"] - end)
            waited_copy = _within((end + waited_host, e["ts"]), copies)
            host, copy, other = host + waited_host, copy + waited_copy, other + e["ts"] - end - waited_host - waited_copy
        end = max(end, e["ts"] + e["dur"])
    busy = sum(b - a for a, b in union((e["ts"], e["ts"] + e["dur"]) for e in work))
    last_launch = max((launched[c] for c in (e.get("args", {}).get("correlation") for e in kernels) if c in launched),
                      default=float("inf"))
    blocking: dict[str, list[float]] = {}
    for e in runtime:
        if e["name"] in BLOCKING and e["ts"] < last_launch:
            count, seconds = blocking.get(e["name"], [0, 0.0])
            blocking[e["name"]] = [count + 1, seconds + e["dur"] * 1e-6]
    return {"span_s": (end - work[0]["ts"]) * 1e-6, "busy_s": busy * 1e-6, "host_wait_s": host * 1e-6,
            "copy_wait_s": copy * 1e-6, "other_s": other * 1e-6, "blocking": blocking}
