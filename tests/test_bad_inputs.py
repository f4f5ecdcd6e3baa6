"""Bad input, table by table, through the ``offload`` command: every case exits non-zero with
one error line naming the problem (and a hint where there is something to do), never a
traceback, and leaves every file in the folder as it was: nothing new, nothing changed."""
from __future__ import annotations

import csv
import errno
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

import pytest

from offload.cli import main
from offload.errors import FormatError
from offload.io import files
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.methods import Options, solve
from offload.step.chainfile import load_chain, save_chain
from offload.step.memory import no_offload_peak, smallest_feasible_budget
from offload.step.schedule import make_schedule
from offload.step.schedulefile import save_schedule

MLP = {"layers": 3, "width": 64, "features": 32, "classes": 10}


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> Path:
    """A real profiled chain (with its recipe), a schedule for it and a sweep CSV, made once."""
    folder = tmp_path_factory.mktemp("originals")
    chain = profile("mlp", ProfileOptions(batch=4, repeats=1, warmup=0, options=MLP)).chain
    save_chain(chain, folder / "chain.json")
    budget = (no_offload_peak(chain) + smallest_feasible_budget(chain)) // 2
    save_schedule(solve(chain, budget, "relax-lp", Options(heuristic_time_s=0.05)).schedule, chain,
                  folder / "schedule.json")
    assert main(["sweep", str(folder / "chain.json"), "--budgets", "70%,100%", "--methods", "vdnn-all",
                 "-j", "1", "-q", "-o", str(folder / "results.csv")]) == 0
    return folder


@pytest.fixture
def folder(originals, tmp_path, monkeypatch) -> Path:
    for f in originals.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every regular file's mode and content (a file of more than 64 MiB by its size and time:
    the 2 GiB chain of one case is sparse, reading it would take seconds)."""
    def content(p: Path) -> str:
        st = p.stat()
        return f"{st.st_size}@{st.st_mtime_ns}" if st.st_size > 64 * 2**20 else hashlib.sha256(p.read_bytes()).hexdigest()
    return {str(p.relative_to(root)): (p.stat().st_mode, content(p)) for p in sorted(root.rglob("*")) if p.is_file()}


def edit_json(name: str, change: Callable[[dict], None], to: str | None = None) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        doc = json.loads((root / name).read_text())
        change(doc)
        (root / (to or name)).write_text(json.dumps(doc))
    return setup


def edit_csv(change: Callable[[list[dict]], None]) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        with open(root / "results.csv", newline="") as fh:
            rows = list(csv.DictReader(fh))
        change(rows)
        with open(root / "results.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return setup


def truncate_csv(root: Path) -> None:
    text = (root / "results.csv").read_text()
    (root / "results.csv").write_text(text[: len(text) - 40])


def stage0(**fields) -> Callable[[dict], None]:
    return lambda d: d["stages"][0].update(fields)


def nest(root: Path) -> None:
    (root / "chain.json").write_text("[" * 100_000 + "]" * 100_000)


SOLVE = ["solve", "chain.json", "--budget", "100%"]
TRAIN = ["train", "--chain", "chain.json", "--schedule", "schedule.json", "--steps", "1"]

CASES = {
    # where the output goes
    "output is /dev/full": (None, SOLVE + ["-o", "/dev/full"], "not a regular file"),
    "output is /dev/null": (None, SOLVE + ["-o", "/dev/null"], "not a regular file"),
    "output is the input": (None, SOLVE + ["-o", "chain.json"], "also an input"),
    "output is a folder": (None, SOLVE + ["-o", "sub"], "is a folder"),
    "output folder missing": (None, SOLVE + ["-o", "nodir/s.json"], "does not exist"),
    "report folder missing, checked before training": (None, TRAIN + ["--report", "nodir/r.json"], "does not exist"),
    "plot to an unknown format": (None, ["plot", "results.csv", "-o", "p.xyz"], "unknown picture format"),
    # chains that are not what they claim
    "JSON nested 100000 deep": (nest, ["show", "chain.json"], "deeper than 64"),
    "byte count past 2**53": (edit_json("chain.json", stage0(saved_bytes=2**63 - 1)), ["show", "chain.json"],
                              "saved_bytes"),
    "a stage of 1e300 s": (edit_json("chain.json", stage0(fwd_s=1e300)), SOLVE, "fwd_s"),
    "bandwidth 1e-300 B/s": (edit_json("chain.json", lambda d: d["platform"].update(d2h_bytes_per_s=1e-300)),
                             SOLVE, "d2h_bytes_per_s"),
    "no platform": (edit_json("chain.json", lambda d: d.pop("platform")), ["show", "chain.json"], "platform"),
    "recipe batch 'abc'": (edit_json("chain.json", lambda d: d["recipe"].update(batch="abc")), TRAIN,
                           "recipe.batch"),
    "recipe dtype float64": (edit_json("chain.json", lambda d: d["recipe"].update(dtype="float64")), TRAIN,
                             "recipe.dtype"),
    "chain edited after solving": (edit_json("chain.json", lambda d: d["recipe"].update(batch=8)), TRAIN,
                                   "another version"),
    "schedule with an unknown field": (edit_json("schedule.json", lambda d: d.update(bogus=1)),
                                       ["simulate", "chain.json", "schedule.json"], "unknown field"),
    # numbers that mean something else
    "budget 1e400": (None, ["solve", "chain.json", "--budget", "1e400"], "more than"),
    "budget 0.3 bytes": (None, ["solve", "chain.json", "--budget", "0.3"], "fraction of a byte"),
    "a million budgets": (None, ["sweep", "chain.json", "--budgets", "20%:100%:1000000", "-o", "r.csv"],
                          "number of budgets"),
    "gap -1": (None, SOLVE + ["--gap", "-1"], "out of range"),
    "gap nan": (None, SOLVE + ["--gap", "nan"], "not a finite number"),
    "heuristic time -1": (None, SOLVE + ["--heuristic-time", "-1"], "out of range"),
    "jobs -1": (None, ["sweep", "chain.json", "-j", "-1", "-o", "r.csv"], "out of range"),
    "steps 0": (None, TRAIN[:-1] + ["0"], "out of range"),
    "steps -1": (None, TRAIN[:-1] + ["-1"], "out of range"),
    "optimizer foo": (None, TRAIN + ["--optimizer", "foo"], "invalid choice"),
    "batch abc": (None, ["profile", "mlp", "--batch", "abc", "-o", "c.json"], "not a whole number"),
    # sweep CSVs that were damaged
    "truncated CSV": (truncate_csv, ["plot", "results.csv", "-o", "p.png"], "line"),
    "NaN in a CSV": (edit_csv(lambda rows: rows[0].update(makespan_s="nan")), ["plot", "results.csv", "-o", "p.png"],
                     "not a finite non-negative number"),
    "-5 in a CSV": (edit_csv(lambda rows: rows[0].update(solve_s="-5")), ["plot", "results.csv", "-o", "p.png"],
                    "not a finite non-negative number"),
    "inf in a CSV": (edit_csv(lambda rows: rows[0].update(peak_bytes="inf")), ["plot", "results.csv", "-o", "p.png"],
                     "line 2"),
    # models that do not behave
    "unknown model": (None, ["profile", "resnet9000", "--batch", "2", "-o", "c.json"], "resnet9000"),
    "a model option against its meaning": (None, ["profile", "mlp", "--batch", "2", "-O", "layers=-1", "-o", "c.json"],
                                           "layers=-1: give a whole number from 1 to 1024"),
    "a sequence of a billion": (None, ["profile", "gpt", "--batch", "1", "-O", "seq=1000000000", "-o", "c.json"],
                                "seq=1000000000"),
    "a model too big for the host": (None, ["profile", "mlp", "--batch", "2", "-O", "width=65536", "-O", "layers=64",
                                            "-o", "c.json"], "GiB of weights and batch before any activation"),
}


def special(name: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    """Replace ``name`` with what ``make`` puts at its path (a link to a device, a pipe)."""
    def setup(root: Path) -> None:
        (root / name).unlink()
        make(root / name)
    return setup


def huge(root: Path) -> None:
    """A chain of 2 GiB (sparse on disk: nothing is written but its size)."""
    os.truncate(root / "chain.json", 2 ** 31)


def digits(root: Path) -> None:
    text = (root / "chain.json").read_text()
    (root / "chain.json").write_text(text.replace('"base_bytes": ', '"base_bytes": ' + "9" * 5000 + ", \"x\": ", 1))


def twice(root: Path) -> None:
    text = (root / "schedule.json").read_text()
    (root / "schedule.json").write_text(text.replace('"method": ', '"method": "ilp", "method": ', 1))


CASES |= {
    # no command destroys an input, or one of its own outputs with another
    "trace onto its schedule": (None, ["trace", "chain.json", "schedule.json", "-o", "schedule.json"], "also an input"),
    "show --graphml onto the chain": (None, ["show", "chain.json", "--graphml", "chain.json"], "also an input"),
    "sweep onto its chain": (None, ["sweep", "chain.json", "--methods", "none", "-o", "chain.json"], "also an input"),
    "plot onto its CSV": (None, ["plot", "results.csv", "-o", "results.csv"], "also an input"),
    "plot --timeline onto its chain": (None, ["plot", "--timeline", "chain.json", "schedule.json", "-o", "chain.json"],
                                       "also an input"),
    "trace onto its chain, spelt otherwise": (None, ["trace", "chain.json", "schedule.json", "-o", "./sub/../chain.json"],
                                              "also an input"),
    "profile: chain and graph one file": (None, ["profile", "mlp", "--batch", "2", "-o", "g.json", "--graphml", "g.json"],
                                          "another output"),
    "train: trace and report one file": (None, TRAIN + ["--trace", "x.json", "--report", "x.json"], "another output"),
    "train: report onto the schedule": (None, TRAIN + ["--report", "schedule.json"], "also an input"),
    "output named ''": (None, SOLVE + ["-o", ""], "output path is empty"),
    # inputs that are not files, or not of a sane size
    "chain is a link to /dev/zero": (special("chain.json", lambda p: p.symlink_to("/dev/zero")), ["show", "chain.json"],
                                     "not a regular file"),
    "schedule is a link to /dev/urandom": (special("schedule.json", lambda p: p.symlink_to("/dev/urandom")),
                                           ["simulate", "chain.json", "schedule.json"], "not a regular file"),
    "chain is a named pipe": (special("chain.json", os.mkfifo), SOLVE, "not a regular file"),
    "sweep CSV is a named pipe": (special("results.csv", os.mkfifo), ["plot", "results.csv", "-o", "p.png"],
                                  "not a regular file"),
    "chain of 2 GiB": (huge, ["show", "chain.json"], "more than any chain"),
    "a number of 5000 digits": (digits, ["show", "chain.json"], "more than 4,300 digits"),
    "a key given twice": (twice, ["simulate", "chain.json", "schedule.json"], "given twice"),
}


def user_model(root: Path) -> None:
    (root / "models.py").write_text(
        "import sys, torch\n"
        "def no_params(batch):\n    return torch.nn.ReLU(), torch.randn(batch, 8)\n"
        "def exits(batch):\n    sys.exit(3)\n"
        "class Argmax(torch.nn.Linear):\n    def forward(self, x):\n        return super().forward(x).argmax(-1)\n"
        "def no_float(batch):\n    return Argmax(8, 4), torch.randn(batch, 8)\n"
        "def frozen(batch):\n    return torch.nn.Linear(8, 4).requires_grad_(False), torch.randn(batch, 8)\n")


def frozen_model(root: Path) -> None:
    """The chain's recipe pointed at a model with no weight to train, and a schedule solved for it."""
    user_model(root)
    doc = json.loads((root / "chain.json").read_text())
    doc["recipe"].update(model="models.py:frozen", options={})
    (root / "chain.json").write_text(json.dumps(doc))
    chain = load_chain(root / "chain.json")
    save_schedule(make_schedule(chain, []), chain, root / "schedule.json")


CASES |= {
    # offload train --nproc: refused before any rank starts
    "--nproc past the machine's cores": (None, TRAIN + ["--nproc", "1000"], "this machine has"),
    "--nproc with another chain's schedule": (edit_json("chain.json", lambda d: d["recipe"].update(batch=8)),
                                              TRAIN + ["--nproc", "2"], "another version"),
    "--nproc with a missing schedule": (None, ["train", "--chain", "chain.json", "--schedule", "none.json", "--nproc", "2"],
                                        "not found"),
    "--nproc with a model without weights to train": (frozen_model, TRAIN + ["--nproc", "2"],
                                                      "no weight that requires a gradient"),
    "--nproc with another batch": (None, TRAIN + ["--nproc", "2", "--batch", "3"], "profiled at batch 4"),
    "a model option the chain was not profiled with": (None, TRAIN + ["-O", "layers=9"], "profiled with"),
    "a model option unread": (None, TRAIN + ["-O", "layers"], "cannot read model option"),
    "model without parameters": (user_model, ["profile", "models.py:no_params", "--batch", "2", "-q", "-o", "c.json"],
                                 "no parameters that require grad"),
    "model function calls sys.exit": (user_model, ["profile", "models.py:exits", "--batch", "2", "-q", "-o", "c.json"],
                                      "SystemExit"),
    "model output without a loss": (user_model, ["profile", "models.py:no_float", "--batch", "2", "-q", "-o", "c.json"],
                                    "no floating-point tensor"),
    "profile onto its model file": (user_model, ["profile", "models.py:no_params", "--batch", "2", "-o", "models.py"],
                                    "also an input"),
    "chain and schedule where train takes its MODEL": (None, ["train", "chain.json", "schedule.json"],
                                                       "is a JSON file, not a model"),
    "model file is a folder": (None, ["profile", "sub/x.py:build", "--batch", "2", "-o", "c.json"], "not found"),
    "model file is a pipe": (lambda root: os.mkfifo(root / "pipe.py"),
                             ["profile", "pipe.py:build", "--batch", "2", "-o", "c.json"], "not a regular file"),
}


def run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        rc = exc.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_refused_and_changes_nothing(case, folder, capsys):
    setup, argv, words = CASES[case]
    if setup:
        setup(folder)
    before = snapshot(folder)
    rc, err = run(argv, capsys)
    assert rc not in (0, None), err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and words in errors[0], err
    assert "Traceback" not in err
    assert snapshot(folder) == before


@pytest.mark.parametrize("fault", ["ENOSPC", "EACCES"])
def test_a_failing_disk_leaves_no_partial_file(fault, folder, capsys, monkeypatch):
    if fault == "ENOSPC":
        def fsync(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(os, "fsync", fsync)
    else:
        def mkstemp(*a, **k):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    before = snapshot(folder)
    rc, err = run(SOLVE + ["-m", "vdnn-all", "-o", "schedule.json"], capsys)
    assert rc == 2 and "cannot write schedule.json" in err and "Traceback" not in err
    assert snapshot(folder) == before


def test_output_through_a_symlink_replaces_the_target_and_keeps_the_link(folder, capsys):
    (folder / "link.json").symlink_to(folder / "sub" / "real.json")
    assert main(SOLVE + ["-m", "vdnn-all", "-o", "link.json"]) == 0
    assert (folder / "link.json").is_symlink()
    assert json.loads((folder / "sub" / "real.json").read_text())["method"] == "vdnn-all"


def test_new_files_get_the_umask_mode(folder, capsys):
    old = os.umask(0o027)
    try:
        assert main(SOLVE + ["-m", "vdnn-all", "-o", "s.json"]) == 0
    finally:
        os.umask(old)
    assert (folder / "s.json").stat().st_mode & 0o777 == 0o640


def test_names_with_escape_sequences_are_printed_escaped(folder, capsys):
    edit_json("chain.json", stage0(name="bad\x1b[31mred\nline"))(folder)
    assert main(["show", "chain.json"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "bad\\x1b[31mred\\x0aline" in out


def test_the_writer_itself_refuses_what_the_command_read_or_wrote(folder):
    """A command that forgets to declare an output still cannot replace an input: the shared
    writer checks every write against what the command read and wrote so far."""
    with files.command():
        files.read_json("chain.json", "chain")
        with pytest.raises(FormatError, match="also an input"):
            files.write_json("chain.json", {})
        files.write_json("out.json", {})
        with pytest.raises(FormatError, match="written already"):
            files.write_json("./out.json", {})
    files.write_json("out.json", {"outside": "a command nothing is tracked"})
