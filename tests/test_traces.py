"""What a torch.profiler Chrome trace of a step shows: copy overlap, where the device's time went."""
import pytest

from offload.executor.traces import copy_overlap, device_time


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


def gpu(cat, name, ts, dur, stream, correlation):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "correlation": correlation}}


def launch(name, ts, dur, correlation):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def test_where_the_device_time_went():
    """Compute stream 7: a kernel, a gap the host caused (the next launch came late), a gap a
    copy caused (launched early, waiting for the H2D's event), a gap of neither; a blocking
    call inside the step and the closing synchronization after it."""
    events = [
        launch("cudaLaunchKernel", 0, 5, 1), gpu("kernel", "a", 10, 100, 7, 1),            # busy 10..110
        launch("cudaMalloc", 20, 300, 90),                                                 # blocks the host
        launch("cudaLaunchKernel", 330, 5, 2), gpu("kernel", "b", 340, 50, 7, 2),          # idle 110..340: host until 335
        launch("cudaMemcpyAsync", 340, 5, 3), gpu("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 345, 100, 9, 3),
        launch("cudaLaunchKernel", 350, 5, 4), gpu("kernel", "c", 450, 50, 7, 4),          # idle 390..450: copy until 445
        launch("cudaLaunchKernel", 360, 5, 5), gpu("kernel", "d", 520, 30, 7, 5),          # idle 500..520: neither
        gpu("kernel", "side", 0, 20, 9, 6),                                                # another stream: not the compute one
        launch("cudaDeviceSynchronize", 600, 10, 91),                                      # after the last launch
    ]
    got = device_time(events)
    assert got["span_s"] == pytest.approx(540e-6) and got["busy_s"] == pytest.approx(230e-6)
    assert got["host_wait_s"] == pytest.approx(225e-6)   # 110..335
    assert got["copy_wait_s"] == pytest.approx(55e-6)    # 390..445 under the H2D
    assert got["other_s"] == pytest.approx(30e-6)        # 335..340, 445..450, 500..520
    assert got["busy_s"] + got["host_wait_s"] + got["copy_wait_s"] + got["other_s"] == pytest.approx(got["span_s"])
    assert got["blocking"] == {"cudaMalloc": [1, pytest.approx(300e-6)]}


def test_no_kernels_no_device_time():
    assert device_time([event("cpu_op", "aten::mm", 0, 100)]) is None


def test_the_report_sets_the_device_time_beside_the_prediction(capsys):
    from offload.executor.cli import _print_device_time
    from offload.executor.report import Predicted

    p = Predicted(step_s=0.050, stall_s=0.002, activation_peak_bytes=0, total_peak_bytes=0, d2h_bytes_per_step=0,
                  h2d_bytes_per_step=0, copy_overlap=None, host_wait_s=0.003)
    _print_device_time({"busy_s": 0.030, "host_wait_s": 0.020, "copy_wait_s": 0.010, "other_s": 0.001,
                        "blocking": {"cudaMalloc": [2, 0.004]}}, p)
    out = capsys.readouterr().out
    assert "20.000 ms waiting for the host, 10.000 ms for copies" in out
    assert "predicted: 45.000 ms, 3.000 ms, 2.000 ms" in out and "cudaMalloc x2 (4.000 ms)" in out
