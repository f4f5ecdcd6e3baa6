"""The `offload` command as a user meets it: outputs, exit codes, no partial files."""
import json
import subprocess
import sys

import networkx as nx
import pytest

from experiments.synthetic import synthetic_chain
from offload.cli import main
from offload.io.text import parse_budget
from offload.solver.cli import _percent
from offload.step.chainfile import save_chain
from offload.step.schedulefile import load_schedule
from tests.conftest import chain_doc


@pytest.fixture
def chain_file(tmp_path):
    p = tmp_path / "chain.json"
    save_chain(synthetic_chain(12, seed=3), p)
    return p


def test_show_prints_the_picture_and_exports_graphml(chain_file, tmp_path, capsys):
    g = tmp_path / "g.graphml"
    assert main(["show", str(chain_file), "--graphml", str(g)]) == 0
    out = capsys.readouterr().out
    for words in ("12 stages", "no-offload", "ideal", "smallest", "stage12"):
        assert words in out
    graph = nx.read_graphml(g)
    assert graph.number_of_nodes() == 36 and graph.nodes["U3"]["type"] == "unit"


def test_solve_then_simulate(chain_file, tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["solve", str(chain_file), "--budget", "40%", "-m", "relax-lp", "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["format"] == "offload-schedule/2" and doc["method"] == "relax-lp"
    assert doc["solver"]["status"] in {"optimal", "heuristic"}
    assert main(["simulate", str(chain_file), str(out), "--timeline"]) == 0
    text = capsys.readouterr().out
    assert f"{doc['predicted']['makespan_s'] * 1e3:.3f} ms" in text and "D2H" in text


def test_impossible_budget_names_the_smallest_and_writes_nothing(chain_file, tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["solve", str(chain_file), "--budget", "1MB", "-o", str(out)]) == 4
    err = capsys.readouterr().err
    assert "below the smallest feasible budget" in err and "hint: use --budget" in err
    assert not out.exists() and list(tmp_path.iterdir()) == [chain_file]
    smallest = int(err.split("hint: use --budget ")[1].split()[0])  # a byte under it reads the same size
    assert main(["solve", str(chain_file), "--budget", str(smallest - 1), "-o", str(out)]) == 4
    err = capsys.readouterr().err
    assert f"({smallest - 1:,} B) (activations) is below the smallest feasible budget" in err
    assert f"({smallest:,} B): even with every unit" in err


def test_a_floor_that_is_an_ops_own_temporary_memory_says_so(write, capsys):
    """HRNet's last downsampling convolution: its backward makes an 18 MiB weight gradient before
    adding it to ``.grad``, and its floor sat at 76% of the peak with no word of why.  Where
    most of the floor is the op's own transient, the refusal names it; elsewhere it does not."""
    doc = chain_doc()
    doc["stages"][1]["bwd_peak_bytes"] = 5000
    assert main(["solve", str(write("c.json", doc)), "--budget", "1000"]) == 4
    err = capsys.readouterr().err
    assert "B2 holds 4.98 KiB of activations" in err and "4.88 KiB of it is B2's own temporary memory" in err
    assert "a smaller batch (where the op's own memory follows the batch" in err  # HRNet's did not
    doc = chain_doc()
    for stage in doc["stages"]:
        stage["fwd_peak_bytes"] = stage["saved_bytes"]
    assert main(["solve", str(write("d.json", doc)), "--budget", "100"]) == 4
    err = capsys.readouterr().err
    assert "below the smallest feasible budget" in err and "own temporary memory" not in err
    assert "or a smaller batch\n" in err


def test_baseline_that_cannot_fit_says_so(chain_file, capsys):
    assert main(["solve", str(chain_file), "--budget", "60%", "-m", "none"]) == 4
    err = capsys.readouterr().err
    assert "method none cannot meet the budget" in err and "it needs at least" in err
    assert "try --method ilp" in err


def test_malformed_chain_is_one_clear_message(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "offload-chain/2", "name": "x"')
    assert main(["show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "not valid JSON" in err and "Traceback" not in err


def test_schedule_for_another_chain_is_refused(chain_file, tmp_path, capsys):
    other = tmp_path / "other.json"
    save_chain(synthetic_chain(12, seed=4), other)
    sched = tmp_path / "s.json"
    assert main(["solve", str(other), "--budget", "50%", "-m", "swap-idle", "-o", str(sched)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(chain_file), str(sched)]) == 2
    assert "made for chain" in capsys.readouterr().err


def test_list_methods_one_per_line_name_first(capsys):
    assert main(["solve", "--list-methods"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    names = [line.split()[0] for line in lines]
    assert names[:3] == ["ilp", "relax-lp", "relax-bw"] and {"save-on-cpu", "vdnn-dyn", "layrub"} <= set(names)


def test_total_budget_counts_base_bytes(chain_file, tmp_path):
    from offload.step.chainfile import load_chain
    chain = load_chain(chain_file)
    out = tmp_path / "s.json"
    assert main(["solve", str(chain_file), "--budget", "70%", "--total", "-m", "relax-bw", "-o", str(out)]) == 0
    s = load_schedule(out, chain)
    assert s.budget.scope == "total" and s.predicted["peak_bytes"] <= s.budget.nbytes
    assert s.predicted["peak_bytes"] > chain.base_bytes


@pytest.mark.parametrize("text, ref, expected", [
    ("123456", 0, 123456), ("6GiB", 0, 6 * 2**30), ("800MB", 0, 800_000_000), ("60%", 1000, 600),
    ("1.5 gib", 0, int(1.5 * 2**30)), ("2e9", 0, 2_000_000_000),
])
def test_budget_units(text, ref, expected):
    assert parse_budget(text, ref) == expected


def test_bad_budget_unit(chain_file, capsys):
    assert main(["solve", str(chain_file), "--budget", "6 parsecs"]) == 2
    assert "unknown unit" in capsys.readouterr().err


@pytest.mark.parametrize("text, words", [("0.3", "fraction of a byte"), ("1e400", "more than"), ("1e300", "more than")])
def test_budgets_that_mean_something_else_are_refused(text, words):
    from offload.errors import FormatError
    with pytest.raises(FormatError, match=words):
        parse_budget(text, 1000)


def test_solver_commands_do_not_load_torch_or_matplotlib(chain_file):
    """`offload show/solve/simulate` start fast: torch and matplotlib stay unloaded (they took 6.5 s when they did)."""
    code = ("import sys; from offload.cli import main; "
            f"main(['solve', {str(chain_file)!r}, '--budget', '60%', '-m', 'vdnn-all']); "
            f"main(['show', {str(chain_file)!r}]); "
            "assert not {'torch', 'matplotlib'} & set(sys.modules), sorted({'torch', 'matplotlib'} & set(sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_console_script_entry_point(chain_file):
    run = subprocess.run([sys.executable, "-m", "offload", "solve", str(chain_file), "--budget", "10B"],
                         capture_output=True, text=True)
    assert run.returncode == 4 and "smallest feasible" in run.stderr


@pytest.mark.parametrize("gap, shown", [(0.0, "0.00%"), (1e-12, "0.00%"), (1.05e-4, "0.011%"), (8.4e-5, "0.0084%"),
                                        (0.0273, "2.73%")])
def test_a_gap_is_never_rounded_onto_the_proof_tolerance(gap, shown):
    """A solve stopped at 0.0105% printed "gap 0.01%", the default tolerance, next to "feasible"."""
    assert _percent(gap) == shown


def test_show_prints_each_stage_name_by_what_tells_it_from_the_others(tmp_path, capsys):
    """Names of one layer's stages differ at their ends (BART's decoder layer cut in two):
    a name too long for the column keeps its end, so no two stages read alike."""
    from offload.step.chainfile import chain_from_dict
    from tests.conftest import chain_doc
    doc = chain_doc()
    long = "model.decoder.layers.2."
    for s, tail in zip(doc["stages"], ("self_attn..encoder_attn_layer_norm", "fc1..final_layer_norm")):
        s["name"] = long + tail
    doc["stages"][2]["name"] = "x" * 80 + ".end"
    path = tmp_path / "long.json"
    save_chain(chain_from_dict(doc), path)
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "model.decoder.layers.2.fc1..final_layer_norm " in out
    assert "…der.layers.2.self_attn..encoder_attn_layer_norm " in out and "x.end " in out


def test_show_says_where_the_host_is_slower_than_the_device(tmp_path, capsys):
    """A chain profiled on a GPU whose host issues some ops slower than they run: ``show``
    gives both sums and the no-stall makespan with the host's waits."""
    from offload.step.chainfile import chain_from_dict
    from tests.conftest import chain_doc
    doc = chain_doc()
    for s in doc["stages"]:
        s.update(fwd_host_s=1.5, bwd_host_s=1.0)
    path = tmp_path / "host.json"
    save_chain(chain_from_dict(doc), path)
    assert main(["show", str(path)]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("ideal"))
    assert "makespan 14.000 s" in line and "add up to 12.000 s" in line and "to 10.000 s" in line
    assert "slower than the device in 4 of 8 ops" in line
    doc["stages"][1].update(input_bytes=10, recording_host_s=0.25, rerun_host_s=2.0)
    save_chain(chain_from_dict(doc), path)
    assert main(["show", str(path)]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("re-runs"))
    assert "re-run of the 3 recomputable stages in 5.000 s (their forwards: 4.500 s)" in line
    assert "for 250.000 ms more" in line


def test_our_warnings_read_as_one_line_and_the_libraries_keep_pythons_form(chain_file, monkeypatch, capsys):
    """While a command runs, a warning raised in our code prints ``warning: ...`` (not the file,
    line and source line where our code raised it); one from a library keeps Python's form;
    the command's end puts Python's formatter back."""
    import warnings

    import offload.solver.cli as solver_cli
    before = warnings.formatwarning

    def show(chain):
        ours = warnings.formatwarning(UserWarning("the graph moves U4 only in part"), UserWarning,
                                      solver_cli.__file__, 354, "self._check_moved()")
        theirs = warnings.formatwarning(UserWarning("deprecated"), UserWarning, warnings.__file__, 7, "x = 1")
        print(ours + theirs, end="")
    monkeypatch.setattr(solver_cli, "print_chain", show)
    assert main(["show", str(chain_file)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "warning: the graph moves U4 only in part"
    assert lines[1].startswith(warnings.__file__) and "UserWarning: deprecated" in lines[1]
    assert warnings.formatwarning is before
