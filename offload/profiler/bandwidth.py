"""The platform of a chain: copy bandwidths and latency between GPU and host, measured.

On CUDA: pinned host buffers and device buffers, copies on their own streams (as the
executor issues them), timed with CUDA events at a large and a small size; the linear
model ``t = latency + bytes / bandwidth`` is fitted through the two medians (the small copy's
over ``SMALL_REPEATS`` at least: it is cheap, and on a busy host a few of its runs wait for a
descheduled thread for milliseconds, a latency a thousand times the copy's).  The two
directions are measured one at a time: in the schedule class every D2H copy ends before
the first prefetch starts, and only a held part's restore (a forward's H2D copy) may run
beside D2H copies, where the model takes them to run at once, as a GPU's copy engines do.

On CUDA the platform also carries the executor's host time per storage it copies
(``offload.executor.copy_cost``): the host issues the copies between the model's kernels,
and where it falls behind the device the step waits for it.

On a machine without a GPU there is no link to measure.  The stand-in measures host
memory-copy bandwidth (what the executor's CPU backend pays per copy) and says so in the
platform's ``note``; ``--bandwidth`` plans for a real machine instead.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from offload.executor.copy_cost import copy_host_seconds
from offload.step.chain import Platform

LARGE, SMALL = 256 * 2**20, 64 * 2**10
SMALL_REPEATS = 101


def _small_repeats(repeats: int) -> int:
    return max(repeats, SMALL_REPEATS)


def _line(copy: Callable[[int], float], large: int, repeats: int) -> tuple[float, float]:
    """(bandwidth B/s, latency s) of the line through the median seconds ``copy(n)`` takes for
    ``large`` bytes (over ``repeats`` copies) and ``SMALL`` bytes (``_small_repeats``)."""
    def median(n: int, k: int) -> float:
        copy(n)  # warm-up
        return statistics.median(copy(n) for _ in range(k))

    large_s, small_s = median(large, repeats), median(SMALL, _small_repeats(repeats))
    slope = (large_s - small_s) / (large - SMALL)
    bandwidth = 1.0 / slope if slope > 0 else large / large_s
    return bandwidth, max(0.0, small_s - SMALL / bandwidth)


def _cuda_platform(device: torch.device, repeats: int, size: int) -> Platform:
    host = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    dev = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
    d2h, h2d = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def timed(copies: list[tuple[torch.cuda.Stream, torch.Tensor, torch.Tensor]]) -> float:
        compute = torch.cuda.current_stream(device)
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(compute)
        for stream, dst, src in copies:
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            compute.wait_stream(stream)
        end.record(compute)
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    d2h_bw, d2h_lat = _line(lambda n: timed([(d2h, host[0][:n], dev[0][:n])]), size, repeats)
    h2d_bw, h2d_lat = _line(lambda n: timed([(h2d, dev[1][:n], host[1][:n])]), size, repeats)
    name = torch.cuda.get_device_name(device)
    note = (f"measured on {name}: pinned host buffers, {size // 2**20} MiB and {SMALL // 2**10} KiB copies, "
            f"medians of {repeats} and {_small_repeats(repeats)}; the executor's host time per storage copied "
            "timed as it issues them")
    return Platform(d2h_bytes_per_s=d2h_bw, h2d_bytes_per_s=h2d_bw, latency_s=(d2h_lat + h2d_lat) / 2, note=note,
                    copy_host_s=copy_host_seconds(device, repeats=repeats))


def _cpu_standin(repeats: int, size: int) -> Platform:
    src, dst = torch.empty(size, dtype=torch.uint8).fill_(1), torch.empty(size, dtype=torch.uint8)

    def timed(n: int) -> float:
        t = time.perf_counter()
        dst[:n].copy_(src[:n])
        return time.perf_counter() - t

    bw, lat = _line(timed, size, repeats)
    note = ("CPU stand-in, not a GPU link: host memory-copy bandwidth of this machine "
            "(what the CPU executor pays per copy); plan for a real GPU with --bandwidth")
    return Platform(d2h_bytes_per_s=bw, h2d_bytes_per_s=bw, latency_s=lat, note=note)


def measure_platform(device: torch.device, repeats: int = 5, size: int = LARGE) -> Platform:
    """The copy platform of ``device``: measured on CUDA, a labelled stand-in on the CPU."""
    if device.type == "cuda":
        return _cuda_platform(device, repeats, size)
    return _cpu_standin(repeats, min(size, 64 * 2**20))


def given_platform(d2h: float, h2d: float, latency_s: float) -> Platform:
    """A platform the user states (``--bandwidth``), for planning another machine."""
    return Platform(d2h_bytes_per_s=d2h, h2d_bytes_per_s=h2d, latency_s=latency_s,
                    note="given on the command line (--bandwidth), not measured")
