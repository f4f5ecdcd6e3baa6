import json
import os

import pytest
from hypothesis import settings

from offload.step.chainfile import chain_from_dict

# The property tests draw the same examples at every ``make test`` (its time bounded: a new
# draw of a random chain can take HiGHS seconds), new ones at every ``make test-all``.
settings.register_profile("suite", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("OFFLOAD_HYPOTHESIS", "suite"))


def chain_doc(**over):
    """A small valid chain document; keyword arguments override top-level fields."""
    doc = {
        "format": "offload-chain/2",
        "name": "four",
        "source": {"model": "hand-made"},
        "platform": {"d2h_bytes_per_s": 100.0, "h2d_bytes_per_s": 100.0, "latency_s": 0.0},
        "base_bytes": 1000,
        "stages": [
            {"name": f"s{i}", "kind": "conv", "fwd_s": 1.0, "bwd_s": 2.0, "saved_bytes": 100,
             "fwd_peak_bytes": 150, "bwd_peak_bytes": 50}
            for i in range(1, 5)
        ],
    }
    doc.update(over)
    return doc


@pytest.fixture
def four():
    """Four equal stages: 1 s forward, 2 s backward, 100-byte units, 100 B/s copies (1 s each)."""
    return chain_from_dict(chain_doc())


@pytest.fixture
def write(tmp_path):
    def _write(name, data):
        p = tmp_path / name
        p.write_text(data if isinstance(data, str) else json.dumps(data))
        return p
    return _write


def assert_loads_exactly(model, offloads, encode=None, runs=(), casts_kept=()) -> None:
    """Loading a schedule into the MILP sets every variable so that all rows hold and the
    objective is the simulated makespan: the MILP's rows say exactly what the simulator does."""
    span = model.load(offloads, encode, runs, casts_kept)
    assert not [name for name, row in model.lp.constraints.items() if not row.valid(1e-7)]
    assert model.makespan.value() * model.tau == pytest.approx(span, rel=1e-9)
