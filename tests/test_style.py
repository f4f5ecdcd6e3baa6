"""The code base stays free of what pyflakes finds: unused imports and variables, undefined
names, redefinitions.  A test, so that `make test` and CI run it with everything else."""
import io

from pyflakes import api, reporter

from tests.runs import ROOT


def test_pyflakes_finds_nothing():
    out = io.StringIO()
    found = api.checkRecursive([str(ROOT / d) for d in ("offload", "experiments", "tests")],
                               reporter.Reporter(out, out))
    assert found == 0, out.getvalue()
