"""The events of a step (offload.step.events): one table, read by the simulator, the
executor's plan and the runtime alike, in the order docs/model.md gives."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from offload.executor.plan import StepPlan
from offload.step import encoding
from offload.step.actions import Offload, Recompute
from offload.step.chainfile import chain_from_dict
from offload.step.events import (BACKWARD, D2H, DECODE, ENCODE, FORWARD, FREE, H2D, RECOMPUTE, RELEASE, WAIT, Event,
                                 step_events)
from offload.step.schedule import make_schedule
from tests.strategies import chains
from tests.test_solver_properties import SETTINGS

COMPUTE = (FORWARD, BACKWARD)


@st.composite
def schedules(draw):
    """A random chain and a random schedule of its class: runs of recomputable stages, other
    units offloaded at random points, encodings of kept or offloaded units."""
    chain = draw(chains(min_stages=1, max_stages=7, encodings=True, inputs=True))
    runs, i = [], 1
    while i < chain.L:
        length = draw(st.integers(1, 3))
        if draw(st.integers(0, 3)) == 0 and chain.can_recompute(i, min(i + length, chain.L) - 1):
            runs.append(Recompute(i, min(i + length, chain.L) - 1))
            i += length
        else:
            i += 1
    rebuilt = {j for r in runs for j in r.stages}
    offloads = [Offload(j, draw(st.integers(j + 1, chain.L)), draw(st.integers(int(chain.need[j]), chain.L)))
                for j in chain.offloadable if j not in rebuilt and draw(st.booleans())]
    options = encoding.allowed(chain, "lossy")
    encode = {j: draw(st.sampled_from([e.name for e in es])) for j, es in options.items()
              if j not in rebuilt and draw(st.booleans())}
    return chain, make_schedule(chain, offloads, runs, encode=encode)


@settings(max_examples=60, **SETTINGS)
@given(schedules())
def test_simulator_and_executor_plan_read_the_same_table(cs):
    chain, sched = cs
    sim = sched.simulate(chain)
    plan = StepPlan.from_schedule(chain, sched)
    assert sim.events == plan.events == step_events(chain, sched.offloads, sched.recompute, sched.encode)
    seq, L = plan.events.sequence, chain.L
    # the ops in execution order, and every other event in exactly one boundary, in order
    assert [(e.kind, e.stage) for e in seq if e.kind in COMPUTE] == \
        [(FORWARD, j) for j in range(1, L + 1)] + [(BACKWARD, j) for j in range(L, 0, -1)]
    assert [e for e in seq if e.kind not in COMPUTE] == [e for o in range(2 * L + 1) for e in plan.events.before(o)]
    assert plan.events.before(0) == plan.events.before(2 * L) == ()
    # the simulator's copies and re-run ops are the table's, in its order
    assert [(c.direction, c.stage) for c in sim.copies] == \
        [("D2H" if e.kind == D2H else "H2D", e.stage) for e in plan.events.of(D2H, H2D)]
    assert [r.stage for r in sim.recomputes] == [j for e in plan.events.of(RECOMPUTE) for j in e.run.stages]
    # each action where the schedule puts it
    for o in sched.offloads:
        assert Event(D2H, o.stage) in plan.events.after_forward(o.stage) or o.stage == L
        at = plan.events.after_forward(o.release) if o.release < L else plan.events.before_backward(L)
        assert Event(RELEASE, o.stage) in at
        assert Event(H2D, o.stage) in plan.events.before_backward(o.prefetch)
        assert Event(WAIT, o.stage) in plan.events.before_backward(int(chain.need[o.stage]))
    for i, name in sched.encode.items():
        assert Event(ENCODE, i, encoding=name) in plan.events.before(i)
        assert Event(DECODE, i, encoding=name) in plan.events.before_backward(int(chain.need[i]))
    assert plan.offloaded == {o.stage for o in sched.offloads}
    assert plan.recomputed == {j for r in sched.recompute for j in r.stages}


def test_a_step_in_order():
    """Four stages: U1 offloaded (released at 2, fetched at 3), U2 offloaded at the turn and
    fetched at 2, U3 recomputed (rebuilt at B3), U1 encoded."""
    doc = {"format": "offload-chain/2", "name": "four",
           "platform": {"d2h_bytes_per_s": 1e4, "h2d_bytes_per_s": 1e4},
           "stages": [{"fwd_s": 0.001, "bwd_s": 0.002, "saved_bytes": 100, "fwd_peak_bytes": 100, "bwd_peak_bytes": 0,
                       "input_bytes": 10, "encodings": [{"name": "m", "lossless": True, "encode_s": 0, "decode_s": 0,
                       "tensors": [{"index": 0, "encoder": "sign-mask", "bytes": 100, "encoded_bytes": 13}]}]}
                      for _ in range(4)]}
    chain = chain_from_dict(doc)
    events = step_events(chain, [Offload(1, 2, 3), Offload(2, 4, 2)], [Recompute(3, 3)], {1: "m"})
    assert [(e.kind, e.stage) for e in events.sequence] == [
        (FORWARD, 1), (ENCODE, 1), (D2H, 1), (FORWARD, 2), (D2H, 2), (RELEASE, 1), (FORWARD, 3), (FORWARD, 4),
        (RELEASE, 2), (BACKWARD, 4),
        (H2D, 1), (RECOMPUTE, 3), (BACKWARD, 3),
        (FREE, 3), (H2D, 2), (WAIT, 2), (BACKWARD, 2),
        (FREE, 2), (WAIT, 1), (DECODE, 1), (BACKWARD, 1)]


def test_prefetches_of_one_point_go_latest_need_first():
    doc = {"format": "offload-chain/2", "name": "needs",
           "platform": {"d2h_bytes_per_s": 1e4, "h2d_bytes_per_s": 1e4},
           "stages": [{"fwd_s": 0.001, "bwd_s": 0.001, "saved_bytes": 10, "fwd_peak_bytes": 10, "bwd_peak_bytes": 0,
                       "need_from": need} for need in (3, 2, 3, 5, 5)]}
    chain = chain_from_dict(doc)
    events = step_events(chain, [Offload(i, i + 1, 5) for i in range(1, 5)])
    assert [e.stage for e in events.before_backward(5) if e.kind == H2D] == [4, 3, 1, 2]
