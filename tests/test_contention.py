"""A measurement on a busy machine says so: the profile and ``offload train`` read how long
their threads waited for a CPU (``offload.io.contention``), the chain and the report keep
it, and ``show`` and ``train`` warn above ``BUSY_SHARE``."""
import os
import subprocess
import sys
import time

import pytest

from offload.cli import main
from offload.io.contention import BUSY_SHARE, CpuWait, busy_warning
from offload.step.chainfile import chain_from_dict, save_chain
from tests.conftest import chain_doc

SPIN = "import time\nt = time.time()\nwhile time.time() - t < 3: pass"


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task"), reason="Linux's per-thread scheduler counters")
def test_a_thread_that_other_processes_crowd_out_waits_a_large_share():
    """Twice as many spinning processes as cores beside one spinning thread of ours: it waits
    for a CPU more than it runs, whatever else the machine is doing."""
    crowd = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        time.sleep(0.3)  # the crowd is running
        waited = CpuWait()
        _spin(0.5)
        share = waited.share()
    finally:
        for p in crowd:
            p.kill()
            p.wait()
    assert share is not None and share > BUSY_SHARE
    assert busy_warning(share, "the profile")[0].startswith(f"the profile waited for a CPU {share:.0%}")
    assert busy_warning(BUSY_SHARE, "x") == busy_warning(None, "x") == []


def test_show_warns_of_a_chain_profiled_on_a_busy_machine(tmp_path, capsys):
    doc = chain_doc()
    path = tmp_path / "chain.json"
    for share, warned in [(0.02, False), (0.8, True), ("much", False)]:  # (a hand-edited value is not read)
        doc["source"] = {"cpu_wait_share": share}
        save_chain(chain_from_dict(doc), path)
        assert main(["show", str(path)]) == 0
        out = capsys.readouterr().out
        assert ("warning     its profile waited for a CPU 80% of the time it ran" in out) == warned
