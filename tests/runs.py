"""Running a schedule on the CPU and checking it against training without offloading: the
checks the executor tests and the real-model tests share."""
from __future__ import annotations

from offload.executor.train import TrainOptions, train
from offload.solver.checkpointing import block_runs, sqrt_runs
from offload.solver.schedule import Offload, make_schedule

TOLERANCE = 64 * 1024  # bytes a measured op may differ from its prediction (held storages dying mid-stage)


def recomputing(chain):
    """Every stage the executor can re-run recomputed on its own, the others offloaded at once;
    and runs of about sqrt(L) stages, nothing offloaded."""
    blocks = block_runs(chain)
    rebuilt = {i for r in blocks for i in r.stages}
    offloads = [Offload(i, i + 1, chain.stage(i).need_from) for i in chain.offloadable if i not in rebuilt]
    return {"blocks+offload": make_schedule(chain, offloads, recompute=blocks),
            "sqrt": make_schedule(chain, [], recompute=sqrt_runs(chain))}


def allowance(chain, sched, op):
    """How far below its prediction an op's measured memory may be: allocator slack, and what
    the checkpoints hold besides their own stage's storages, which the model counts once per
    checkpoint (a gradient-free tensor several stages read, such as a rotary table, is one
    storage: docs/model.md, "Recomputation")."""
    shared = sum(int(chain.x[r.first] - chain.xc[r.first]) for r in sched.recompute)
    return TOLERANCE + shared


def check_run(chain, sched, backend, name):
    """Two steps checked against training without offloading: gradients bit for bit, no leak,
    bytes moved and each op's memory as predicted, the arena allocating nothing after step 1."""
    report, error = train(None, chain, sched, TrainOptions(steps=2, backend=backend, check_grads=True, op_memory=True))
    assert error is None, (name, error)
    assert report["grads_match"] is True, (name, report["grad_mismatches"])
    m, p = report["measured"], report["predicted"]
    assert m["leaked_bytes_after_step"] == 0
    assert (m["d2h_bytes_per_step"], m["h2d_bytes_per_step"]) == (p["d2h_bytes"], p["h2d_bytes"])
    assert len(set(m["host_allocations"])) == 1
    measured, predicted = m["op_peak_bytes"], p["op_bytes"]
    assert list(measured) == list(predicted)
    assert all(0 <= predicted[op] - measured[op] <= allowance(chain, sched, op) for op in measured), \
        (name, {op: predicted[op] - measured[op] for op in measured if predicted[op] != measured[op]})
    return report
