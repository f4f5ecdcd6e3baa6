"""The experiment scripts run end to end at tiny sizes (their real sizes need minutes or a GPU)."""
from __future__ import annotations

import csv

from experiments import bench_executor


def test_bench_executor_writes_a_row_per_model(tmp_path, capsys):
    assert bench_executor.main(["--set", "tiny", "--models", "gpt", "--device", "cpu", "--steps", "2",
                                "--repeats", "1", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert [r["model"] for r in rows] == ["gpt"]
    row = rows[0]
    assert row["grads_match"] == "True" and row["solver_status"] == "optimal"
    assert int(row["d2h_bytes"]) == int(row["h2d_bytes"]) > 0
    assert float(row["vs_save_on_cpu"]) > 0 and float(row["vs_no_offload"]) > 0
    assert {p.name for p in tmp_path.iterdir()} >= {"gpt-chain.json", "gpt-schedule.json", "gpt-run.json",
                                                     "gpt-trace.json", "summary.csv"}
    assert "vs save_on_cpu" in capsys.readouterr().out
