"""The overlap figure read from a torch.profiler Chrome trace."""
import pytest

from offload.executor.overlap import copy_overlap


def event(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_copy_time_under_kernels():
    events = [event("kernel", "conv", 0, 100), event("kernel", "relu", 150, 50),
              event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 50, 100),   # 50 hidden, 50 exposed (100..150)
              event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 140, 20),   # 10 hidden (150..160)
              event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 0, 500),    # not a host copy
              event("cpu_op", "aten::copy_", 0, 1000)]
    got = copy_overlap(events)
    assert got["copy_s"] == pytest.approx(110e-6)  # union of [50,150] and [140,160]
    assert got["overlapped_s"] == pytest.approx(60e-6) and got["fraction"] == pytest.approx(60 / 110)


def test_no_copies_no_figure():
    assert copy_overlap([event("kernel", "conv", 0, 100)]) is None
