"""Running a schedule on the CPU and checking it against training without offloading: the
checks the executor tests and the real-model tests share."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import pytest

from offload.core.encoders import ENCODERS
from offload.profiler import selective
from offload.executor.train import TrainOptions, train
from offload.solver.checkpointing import block_runs, sqrt_runs
from offload.step.actions import Offload
from offload.step.chain import EVERY_OTHER_MATMUL, MATMULS
from offload.step.chainfile import save_chain
from offload.step.recompute import later_held_bytes
from offload.step.schedule import make_schedule
from offload.step.schedulefile import save_schedule

ROOT = Path(__file__).resolve().parent.parent
STAND_IN_RATIOS = {MATMULS: (0.5, 1.1), EVERY_OTHER_MATMUL: (0.75, 1.1)}  # over the whole re-run: (in part, recording)


@contextlib.contextmanager
def options_paying() -> Iterator[None]:
    """Profiles in this block time a stage's re-run in part (and its forward recording what it
    keeps) at ``STAND_IN_RATIOS`` of its whole re-run: on this CPU a small block's re-run in part measures no faster than the whole, so
    the profiler offers no option (docs/profiling.md); the tests of what the options keep,
    hold and run need the menus a device where they pay would give.  Everything else is
    measured."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(selective, "rerun_ratios",
                   lambda runner, candidates: {(k, o): STAND_IN_RATIOS[o] for k, o in candidates})
        yield

TOLERANCE = 64 * 1024  # bytes a measured op may differ from its prediction (held storages dying mid-stage)


class Profiled(dict):
    """Chains by model name, each profiled (``make(name)``) the first time a test asks for it: a
    module's fixture need not profile the models only its slow tests use."""

    def __init__(self, make) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, model: str):
        self[model] = self.make(model)
        return self[model]


def recomputing(chain):
    """Every other stage the executor can re-run recomputed on its own, the others offloaded at
    once (both, wherever two stages can be re-run); and runs of about sqrt(L) stages, nothing
    offloaded."""
    blocks = block_runs(chain)[::2]
    rebuilt = {i for r in blocks for i in r.stages}
    offloads = [Offload(i, i + 1, chain.stage(i).need_from) for i in chain.offloadable if i not in rebuilt]
    return {"blocks+offload": make_schedule(chain, offloads, recompute=blocks),
            "sqrt": make_schedule(chain, [], recompute=sqrt_runs(chain))}


def allowance(chain, sched, op):
    """How far below its prediction an op's measured memory may be: allocator slack, and what
    the checkpoints hold besides their own stage's storages, which the model counts once per
    checkpoint (a gradient-free tensor several stages read, such as a rotary table, is one
    storage), and from the run's second forward op on while the model's code holds them too
    (docs/model.md, "Recomputation")."""
    shared = sum(int(chain.x[r.first] - chain.xc[r.first]) + later_held_bytes(chain, r) for r in sched.recompute)
    return TOLERANCE + shared


def ops_off_prediction(report) -> dict[str, int]:
    """Per op measured less predicted, where it is off: above the prediction by more than the
    encoded blobs may vary (``Predicted.blob_slack_bytes``), or below it by more than
    ``TOLERANCE``."""
    measured, p = report.measured.op_peak_bytes, report.predicted
    return {op: b - p.op_bytes[op] for op, b in measured.items()
            if not -TOLERANCE <= b - p.op_bytes[op] <= p.blob_slack_bytes}


def moved_as_predicted(chain, sched, measured, predicted) -> bool:
    """Bytes moved per step equal to the prediction, to the byte, except where a unit is offloaded
    with an encoder whose blob's size follows the data: there by at most what those blobs may
    differ from the profiled ones (``Encoder.spare_bytes``)."""
    slack = sum(ENCODERS[t.encoder].spare_bytes(t.encoded_bytes) for o in sched.offloads if o.stage in sched.encode
                for t in chain.stage(o.stage).encoding(sched.encode[o.stage]).tensors)
    return all(abs(m - p) <= slack for m, p in zip(measured, predicted))


def check_run(chain, sched, backend, name):
    """Two steps checked against training without offloading: gradients bit for bit, no leak,
    bytes moved and each op's memory as predicted, the arena allocating nothing after step 1
    and nothing beyond its plan."""
    report, error = train(None, chain, sched, TrainOptions(steps=2, backend=backend, check_grads=True, op_memory=True))
    assert error is None, (name, error)
    assert report.grads_match is True, (name, report.grad_mismatches)
    m, p = report.measured, report.predicted
    assert max(m.leaked_by_step) == 0
    assert moved_as_predicted(chain, sched, (m.d2h_bytes_per_step, m.h2d_bytes_per_step),
                              (p.d2h_bytes_per_step, p.h2d_bytes_per_step))
    assert len(set(m.host_allocations)) == 1 and m.host_arena_grown_bytes == 0 and not report.arena_grew()
    measured, predicted = m.op_peak_bytes, p.op_bytes
    assert list(measured) == list(predicted)
    assert all(0 <= predicted[op] - measured[op] <= allowance(chain, sched, op) for op in measured), \
        (name, {op: predicted[op] - measured[op] for op in measured if predicted[op] != measured[op]})
    return report


def none_over(chain, offloads, runs) -> tuple[dict[str, int], dict[str, int]]:
    """One step of ``offloads`` and ``runs`` checked against training without offloading:
    gradients bit for bit and no op over its prediction (under it is what the model books
    conservatively).  Returns the measured and the predicted memory per op."""
    report, error = train(None, chain, make_schedule(chain, offloads, recompute=runs),
                          TrainOptions(steps=1, check_grads=True, op_memory=True))
    m, p = report.measured.op_peak_bytes, report.predicted.op_bytes
    assert error is None and report.grads_match is True, (runs, error)
    assert all(m[op] <= p[op] for op in p), (runs, {op: m[op] - p[op] for op in p if m[op] > p[op]})
    return m, p


def without_late_parts(chain):
    """``chain`` as if the model's code let go of nothing after a boundary
    (``carried_early_bytes``, ``carried_late_bytes``, ``held_late_bytes``): the ops' memory
    without the late parts of their first readings."""
    return replace(chain, stages=tuple(replace(s, carried_early_bytes=0, carried_late_bytes=0, held_late_bytes=0)
                                       for s in chain.stages))


def without_shared_checkpoints(chain):
    """``chain`` as if no checkpoint shared a storage with the unit before it
    (``input_prev_bytes``, ``input_prev_held_bytes``): each counted beside that unit."""
    return replace(chain, stages=tuple(replace(s, input_prev_bytes=0, input_prev_held_bytes=0) for s in chain.stages))


def processes_of(marker: str) -> list[int]:
    """The processes whose command line holds ``marker`` (a job's launcher, its workers, its ranks)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return found


def _ranks(chain, sched, where: Path, cmd: list[str], out: str) -> tuple[str, dict]:
    """Run ``cmd`` (its ``{chain}`` and ``{schedule}`` the saved files) as a job of ranks: its
    output, and the JSON rank 0 wrote to ``where / out``."""
    save_chain(chain, where / "c.json")
    save_schedule(sched, chain, where / "s.json")
    files = {"chain": str(where / "c.json"), "schedule": str(where / "s.json")}
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # the caller's packages too
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *(a.format(**files) for a in cmd)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads((where / out).read_text())


def data_parallel(chain, sched, where: Path, modes: list[str], nproc: int = 2, device: str = "cpu") -> dict:
    """One ``torch.distributed.run`` of ``nproc`` ranks of ``tests/data_parallel_worker.py``
    (gloo on the CPU, NCCL on CUDA) training the chain's model under every mode with and
    without ``sched``: rank 0's summary per mode."""
    return _ranks(chain, sched, where, ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
                                        str(ROOT / "tests" / "data_parallel_worker.py"), ",".join(modes),
                                        "{chain}", "{schedule}", str(where / "out.json"), device], "out.json")[1]


def train_on_ranks(chain, sched, where: Path, nproc: int, *options: str) -> tuple[str, dict]:
    """``offload train --nproc nproc --check-grads`` with ``options``: its output and rank 0's report."""
    return _ranks(chain, sched, where, ["-m", "offload", "train", "--chain", "{chain}", "--schedule", "{schedule}",
                                        "--check-grads", "--nproc", str(nproc), "--report", str(where / "r.json"),
                                        *options], "r.json")
