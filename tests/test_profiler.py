"""The profiler: linearization, saved-bytes accounting, transients, timing, errors (CPU)."""
from __future__ import annotations

import importlib.util
import itertools
import json
import textwrap

import networkx as nx
import pytest
import torch
from torch import nn

from offload.cli import main
from profiler.capture import capture
from profiler.linearize import default_cuts, merge_to, stage_model
from profiler.measure import StepRunner, measure
from profiler.models import ModelError, resolve
from profiler.profile import ProfileOptions, profile
from profiler.zoo import ModelSpec
from solver.chain import load_chain

SMALL = {
    "resnet18": {"image": 32},
    "gpt": {"layers": 2, "width": 32, "heads": 4, "seq": 16, "vocab": 50},
    "mlp": {"layers": 3, "width": 64, "features": 16, "classes": 10},
    "densenet121": {"image": 32},
    "inception": {"image": 32},
    "vgg16": {"image": 32, "classes": 10},
}

USER_MODEL = textwrap.dedent('''
    import torch
    from torch import nn

    class Gated(nn.Module):
        """Data-dependent control flow: torch.fx cannot trace it."""
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(16, 32)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
            self.out = nn.Linear(32, 4)

        def forward(self, x):
            h = torch.relu(self.inp(x))
            for block in self.blocks:
                if h.mean() > -1e9:
                    h = h + block(h)
            return self.out(h * 2)

    def build(batch):
        return Gated(), torch.randn(batch, 16)

    def raises(batch):
        raise RuntimeError("no such weights")

    def bad_forward(batch):
        return nn.Linear(3, 3), torch.randn(batch, 5)

    def not_a_tuple(batch):
        return nn.Linear(3, 3)
''')


def quick(model: str, **kw) -> ProfileOptions:
    return ProfileOptions(batch=2, repeats=2, warmup=1, options=dict(SMALL.get(model, {})), **kw)


def independent_saved_bytes(spec: ModelSpec) -> int:
    """Bytes saved for backward by one forward of the *uninstrumented* model, counted here
    (the weights and the input batch are never part of a unit)."""
    inputs = [t.clone() for t in spec.inputs]
    params = {t.untyped_storage().data_ptr() for t in itertools.chain(spec.module.parameters(), spec.module.buffers(), inputs)}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = spec.loss(spec.module(*inputs))
    loss.backward()
    return sum(storages.values())


@pytest.fixture(scope="module")
def profiled():
    """Each small zoo model profiled once, shared by the tests below."""
    return {name: profile(name, quick(name)) for name in ("resnet18", "gpt", "mlp", "densenet121")}


@pytest.mark.parametrize("name", ["resnet18", "gpt", "mlp", "densenet121"])
def test_saved_bytes_equal_an_independent_count(profiled, name):
    p = profiled[name]
    assert sum(s.saved_bytes for s in p.chain.stages) == independent_saved_bytes(p.spec)


@pytest.mark.parametrize("name", ["resnet18", "gpt", "mlp", "densenet121"])
def test_every_forward_peak_holds_the_stage_unit(profiled, name):
    for s in profiled[name].chain.stages:
        assert s.fwd_peak_bytes >= s.saved_bytes
        assert s.bwd_peak_bytes >= 0 and s.fwd_s > 0 and s.bwd_s > 0


def test_hand_counted_mlp():
    """Linear(4,8) → ReLU → Linear(8,3), batch 2, float32, loss mean(out²): every byte counted by hand."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    spec = ModelSpec(module, (torch.randn(2, 4),), lambda out: out.square().mean())
    cap = capture(module, spec.inputs)
    staged = stage_model(cap, default_cuts(cap))
    assert [st.name for st in staged.stages] == ["0", "2"]  # the ReLU joins the first Linear
    m = measure(StepRunner(staged, spec, torch.device("cpu"), "sgd"), repeats=1, warmup=1)
    # stage 1 saves its input (the batch, 32 B: the loop's, never a unit) and the ReLU output
    # (64 B), which Linear 2 saves too: need_from 2; stage 2 saves its output (24 B) for the loss
    assert [s.saved_bytes for s in m.stages] == [64, 24]
    assert [s.need_from for s in m.stages] == [2, 2]
    # F1: input 32 + Linear output 64 + ReLU output 64;  F2: input 32 + output 24 + square 24 + mean 4
    assert [s.fwd_peak_bytes for s in m.stages] == [160, 84]
    assert m.base_bytes == 3 * (4 * 8 + 8 + 8 * 3 + 3) * 4  # weights, gradients, SGD momentum


def test_residual_blocks_become_stages(profiled):
    staged = profiled["resnet18"].staged
    stage_of = {data["label"]: data["stage"] for _, data in staged.graph.nodes(data=True) if "stage" in data}
    for layer, block in itertools.product(range(1, 5), range(2)):
        prefix = f"layer{layer}.{block}."
        stages = {s for label, s in stage_of.items() if label.startswith(prefix)}
        assert len(stages) == 1, f"block {prefix} spans stages {stages}"
    assert staged.L >= 8 + 2


def test_dense_blocks_become_stages(profiled):
    names = [s.name for s in profiled["densenet121"].chain.stages]
    for i in (0, 2, 4, 6):
        assert f"features.{i}.layers" in names


def test_profiling_twice_gives_the_same_sizes_and_times_within_noise():
    opts = ProfileOptions(batch=16, repeats=5, warmup=2, options={"layers": 4, "width": 512, "features": 256})
    a, b = profile("mlp", opts).chain, profile("mlp", opts).chain
    assert [(s.saved_bytes, s.fwd_peak_bytes, s.bwd_peak_bytes, s.need_from) for s in a.stages] == \
           [(s.saved_bytes, s.fwd_peak_bytes, s.bwd_peak_bytes, s.need_from) for s in b.stages]
    assert a.base_bytes == b.base_bytes
    assert 0.5 < a.ideal_makespan_s / b.ideal_makespan_s < 2.0


def test_hooks_capture_agrees_with_fx(profiled):
    fx_chain = profiled["resnet18"].chain
    hooks = profile("resnet18", quick("resnet18", capture="hooks")).chain
    assert [s.name for s in hooks.stages] == [s.name for s in fx_chain.stages]
    assert [s.saved_bytes for s in hooks.stages] == [s.saved_bytes for s in fx_chain.stages]
    assert [s.need_from for s in hooks.stages] == [s.need_from for s in fx_chain.stages]


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user_model.py"
    path.write_text(USER_MODEL)
    return path


def test_user_file_model_that_fx_cannot_trace(user_file):
    p = profile(f"{user_file}:build", ProfileOptions(batch=4, repeats=1, warmup=1))
    assert p.staged.capture == "hooks"
    assert any("torch.fx cannot trace" in n for n in p.staged.notes)
    # the residual `h + block(h)` is seen, so each block is its own stage
    assert [s.name for s in p.chain.stages] == ["inp", "blocks.0.0", "blocks.1.0", "blocks.2.0", "out"]
    assert sum(s.saved_bytes for s in p.chain.stages) == independent_saved_bytes(p.spec)


def test_package_module_reference(user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file.parent))
    spec = resolve("user_model:build", 3)
    assert spec.inputs[0].shape == (3, 16)


def test_merge_to_a_stage_count():
    p = profile("resnet18", quick("resnet18", stages=4))
    assert p.chain.L == 4
    assert sum(s.saved_bytes for s in p.chain.stages) == independent_saved_bytes(p.spec)


@pytest.mark.parametrize("weights,count", [([1, 2, 3, 4, 5], 2), ([5, 1, 1, 1, 5, 1], 3), ([1] * 7, 7), ([3, 1], 5)])
def test_merge_to_is_the_best_contiguous_split(weights, count):
    ends = merge_to(weights, count)
    groups = [weights[a + 1:b + 1] for a, b in zip([-1] + ends, ends + [len(weights) - 1])]
    assert len(groups) == min(count, len(weights)) and sum(groups, []) == weights
    best = min(max(sum(weights[a + 1:b + 1]) for a, b in zip((-1,) + cut, cut + (len(weights) - 1,)))
               for cut in itertools.combinations(range(len(weights) - 1), min(count, len(weights)) - 1))
    assert max(sum(g) for g in groups) == best


def test_cli_profile_writes_chain_and_graphml(tmp_path, capsys):
    out, graph = tmp_path / "c.json", tmp_path / "g.graphml"
    rc = main(["profile", "mlp", "--batch", "2", "-O", "layers=2", "-O", "width=32", "--repeats", "1",
               "-o", str(out), "--graphml", str(graph), "-q"])
    assert rc == 0
    chain = load_chain(out)
    assert chain.source["model"] == "mlp" and chain.source["capture"] == "fx"
    assert "CPU stand-in" in chain.platform.note
    g = nx.read_graphml(graph)
    stages = {d["stage"] for _, d in g.nodes(data=True) if "stage" in d}
    assert stages == set(range(1, chain.L + 1))


def test_cli_bandwidth_override(tmp_path):
    out = tmp_path / "c.json"
    assert main(["profile", "mlp", "--batch", "2", "-O", "layers=2", "--repeats", "1", "-q",
                 "--bandwidth", "25GB/s,20GB/s", "--latency", "10us", "-o", str(out)]) == 0
    p = json.loads(out.read_text())["platform"]
    assert (p["d2h_bytes_per_s"], p["h2d_bytes_per_s"], p["latency_s"]) == (25e9, 20e9, pytest.approx(1e-5))
    assert "not measured" in p["note"]


@pytest.mark.parametrize("model,message", [
    ("nosuch", "unknown model 'nosuch'"),
    ("missing_dir/none.py:build", "model file not found"),
    ("{file}:nofn", "no function 'nofn'"),
    ("{file}:raises", "building {file}:raises failed: RuntimeError: no such weights"),
    ("{file}:bad_forward", "failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    ("{file}:not_a_tuple", "expected (module, example_input[, loss_fn])"),
    ("no_such_package_xyz:fn", "cannot import module 'no_such_package_xyz'"),
    ("torchvision:resnet18", "torchvision is not installed"),
])
def test_bad_models_get_one_clear_error(model, message, user_file, tmp_path, capsys):
    model, message = model.format(file=user_file), message.format(file=user_file)
    if model.startswith("torchvision:") and importlib.util.find_spec("torchvision"):
        pytest.skip("torchvision is installed here")
    out = tmp_path / "c.json"
    rc = main(["profile", model, "--batch", "2", "-o", str(out), "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err
    assert not out.exists()


def test_bad_options_are_refused():
    with pytest.raises(ModelError, match="does not accept"):
        resolve("resnet18", 2, {"depth": 3})
    with pytest.raises(ModelError, match="--batch must be at least 1"):
        resolve("mlp", 0)
    assert main(["profile", "mlp", "--batch", "2", "-O", "oops", "-o", "x.json"]) == 2
