"""The profiler: cut sites, stages, saved-bytes accounting, transients, held storages, errors (CPU)."""
from __future__ import annotations

import importlib.util
import itertools
import json
import textwrap
from types import SimpleNamespace

import networkx as nx
import pytest
import torch
from torch import nn

from offload.cli import main
from offload.profiler import bandwidth, selective
from offload.profiler.selective import _menu
from offload.core.staging import Site, Staging
from offload.errors import ModelError
from offload.models import ModelSpec, resolve
from offload.profiler.capture import capture
from offload.profiler.linearize import default_cuts, merge_to, stages_at
from offload.profiler.measure import StepRunner, measure, spread
from offload.profiler.profile import ProfileOptions, profile, timing_warnings
from offload.step.chainfile import chain_from_dict, load_chain
from tests.runs import options_paying

SMALL = {
    "resnet18": {"image": 32},
    "gpt": {"layers": 2, "width": 32, "heads": 4, "seq": 16, "vocab": 50},
    "mlp": {"layers": 3, "width": 64, "features": 16, "classes": 10},
    "densenet121": {"image": 32},
}

USER_MODEL = textwrap.dedent('''
    import torch
    from torch import nn

    class Gated(nn.Module):
        """Data-dependent control flow and a residual written in forward."""
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

    class Shared(nn.Module):
        """Every block reads a differentiable value made before them: no cut between blocks."""
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(16, 32)
            self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
            self.out = nn.Linear(32, 4)

        def forward(self, x):
            e = self.emb(x)
            h = e
            for block in self.blocks:
                h = torch.tanh(block(h)) + e
            return self.out(h)

    class Stack(nn.Module):
        """Layers that read a value made before them, inside one block: no cut between them."""
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))

        def forward(self, h, e):
            for layer in self.layers:
                h = torch.tanh(layer(h)) + e
            return h

    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(16, 32)
            self.stacks = nn.ModuleList([Stack()])
            self.out = nn.Linear(32, 4)

        def forward(self, x):
            e = self.emb(x)
            return self.out(self.stacks[0](e, e))

    class Biased(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, h, bias):
            return torch.tanh(self.lin(h)) + bias

    class Overwritten(nn.Module):
        """Blocks read a tensor made before them that the forward writes in place after them."""
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(16, 32)
            self.blocks = nn.ModuleList(Biased() for _ in range(3))
            self.out = nn.Linear(32, 4)

        def forward(self, x):
            h = self.emb(x)
            bias = torch.ones(32)
            for block in self.blocks:
                h = block(h, bias)
            bias.add_(1.0)
            return self.out(h * 2)

    class Pooled(nn.Module):
        """A head that drops out, in place, the pool its forward's code made (MobileViT's)."""
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(16, 32)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
            self.drop, self.out = nn.Dropout(0.5, inplace=True), nn.Linear(32, 4)

        def forward(self, x):
            h = self.emb(x)
            for block in self.blocks:
                h = block(h)
            return self.out(self.drop(h.mean(1)))

    class Scale(nn.Module):
        """Scales its argument in place by a weight."""
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.full((32,), 0.5))

        def forward(self, x):
            return x.mul_(self.w)

    class PooledInput(nn.Module):
        """A head that scales, in place, the pool its forward's code made of the head stage's
        input (the last block's output, which crossed the boundary)."""
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(16, 32)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
            self.scale, self.out = Scale(), nn.Linear(32, 4)

        def forward(self, x):
            h = self.emb(x)
            for block in self.blocks:
                h = block(h)
            return self.out(self.scale(h.mean(1)))

    class Backbone(nn.Module):
        """Blocks, then a pooler the backbone's call runs and no loss reads (SqueezeBERT's)."""
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(16, 32)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
            self.pooler = nn.Linear(32, 32)

        def forward(self, x):
            h = self.emb(x)
            for block in self.blocks:
                h = block(h)
            return h, torch.tanh(self.pooler(h[:, 0]))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense, self.norm, self.out = nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4)

        def forward(self, h):
            return self.out(self.norm(torch.tanh(self.dense(h))))

    class Unpooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone, self.head = Backbone(), Head()

        def forward(self, x):
            h, _ = self.backbone(x)
            return self.head(h)

    def build(batch):
        return Gated(), torch.randn(batch, 16)

    def unpooled(batch):
        return Unpooled(), torch.randn(batch, 6, 16)

    def pooled(batch):
        return Pooled(), torch.randn(batch, 6, 16)

    def pooled_input(batch):
        return PooledInput(), torch.randn(batch, 6, 16)

    def overwritten(batch):
        return Overwritten(), torch.randn(batch, 16)

    def shared(batch):
        return Shared(), torch.randn(batch, 16)

    def nested(batch):
        return Nested(), torch.randn(batch, 16)

    def frozen(batch, head=3):
        """A frozen backbone of six blocks, a trainable head of ``head`` layers."""
        backbone = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(6)])
        backbone.requires_grad_(False)
        layers = [nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(head - 1)] + [nn.Linear(16, 4)]
        return nn.Sequential(backbone, *layers), torch.randn(batch, 16)

    def keywords(batch):
        class KW(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)
            def forward(self, x, scale=None):
                return {"logits": self.b(torch.relu(self.a(x))) * scale.mean(), "aux": None}
        return KW(), {"x": torch.randn(batch, 8), "scale": torch.ones(batch)}

    def raises(batch):
        raise RuntimeError("no such weights")

    def exits(batch):
        import sys
        sys.exit(0)

    def bad_forward(batch):
        return nn.Linear(3, 3), torch.randn(batch, 5)

    def not_a_tuple(batch):
        return nn.Linear(3, 3)

    class Flagged(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)
        def forward(self, x, return_loss=False, mode="sum"):
            out = self.b(torch.relu(self.a(x)))
            return out.sum() if return_loss else out

    def flagged(batch):
        return Flagged(), {"x": torch.randn(batch, 8), "return_loss": True, "mode": "sum"}

    def listed(batch):
        return Flagged(), {"x": torch.randn(batch, 8), "extra": [torch.ones(2)]}

    class RunAgain(torch.autograd.Function):
        """Layers run without autograd, run again in the backward: a reversible network's way."""
        @staticmethod
        def forward(ctx, x, layers, *params):
            ctx.layers, ctx.params = layers, params
            ctx.save_for_backward(x)
            with torch.no_grad():
                for layer in layers:
                    x = torch.relu(layer(x))
            return x

        @staticmethod
        def backward(ctx, grad):
            x, = ctx.saved_tensors
            with torch.enable_grad():
                y = x = x.detach().requires_grad_()
                for layer in ctx.layers:
                    y = torch.relu(layer(y))
                grads = torch.autograd.grad(y, (x, *ctx.params), grad)
            return (grads[0], None, *grads[1:])

    class Reversible(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Linear(8, 16), nn.Linear(16, 2)
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        def forward(self, x):
            return self.head(RunAgain.apply(self.emb(x), self.layers, *self.layers.parameters()))

    def reversible(batch):
        return Reversible(), torch.randn(batch, 8)

    class Skipping(nn.Module):
        """Stochastic depth that skips whole blocks while training: ``skip`` of them at random."""
        def __init__(self, skip):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
            self.skip, self.draws = skip, __import__("random").Random(1)
        def forward(self, x):
            for block in self.blocks:
                if not (self.training and self.draws.random() < self.skip):
                    x = x + torch.relu(block(x))
            return x

    def skipping(batch, skip=0.3):
        return Skipping(skip), torch.randn(batch, 16)

    class EncoderConfig:  # a config held in another (an encoder-decoder's config.encoder)
        layerdrop = 0.0

    class Routed(nn.Module):
        """Rows routed at random, those over a capacity dropped (a Switch Transformer's experts)."""
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        def forward(self, x):
            for block in self.blocks:
                routed = torch.rand(x.shape[0]) < 0.5
                x = x.index_put((routed,), torch.tanh(block(x[routed])))
            return x

    def routed(batch):
        return Routed(), torch.randn(batch * 16, 16)

    class Thresholded(nn.Module):
        """Rows picked by a trained threshold: which, follows the weights, not the draws."""
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
            self.threshold = nn.Parameter(torch.zeros(()))
        def forward(self, x):
            for block in self.blocks:
                x = torch.tanh(block(x[x[:, 0] > self.threshold]))
                x = torch.cat([x, x.new_full((1, 16), 1e-5)]) + self.threshold
            return x

    def thresholded(batch):  # a step of the threshold (Adam, lr 1e-4) moves it past rows 1e-5 apart
        x = torch.randn(401, 16)
        x[:, 0] = torch.linspace(-2e-3, 2e-3, 401)
        return Thresholded(), x

    def layer_dropping(batch):  # as a transformers Wav2Vec2 is by default
        import types
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        encoder = EncoderConfig()
        encoder.layerdrop = 0.05
        model.config = types.SimpleNamespace(layerdrop=0.1, encoder_layerdrop=0.0, use_cache=False, encoder=encoder)
        return model, torch.randn(batch, 8)
''')


def load_chain_doc(chain):
    """The chain read back from its own document."""
    return chain_from_dict(json.loads(json.dumps(chain.document())))


def quick(model: str, **kw) -> ProfileOptions:
    return ProfileOptions(batch=2, repeats=2, warmup=1, options=dict(SMALL.get(model, {})), **kw)


def independent_saved(spec: ModelSpec) -> dict[int, int]:
    """The storages saved for backward by one forward of the model without any boundary, and
    their bytes, counted here (weights, buffers and the input batch are never part of a unit)."""
    args, kwargs = spec.batch()
    skip = {t.untyped_storage().data_ptr() for t in itertools.chain(spec.module.parameters(), spec.module.buffers(),
                                                                     args, kwargs.values())}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = spec.loss(spec.module(*args, **kwargs))
    loss.backward()
    return storages


@pytest.fixture(scope="module")
def profiled():
    """Each small zoo model profiled once, shared by the tests below (which read no encodings:
    tests/test_encoders.py profiles them)."""
    return {name: profile(name, quick(name, encodings=False)) for name in SMALL}


@pytest.mark.parametrize("name", list(SMALL))
def test_saved_bytes_equal_an_independent_count(profiled, name):
    p = profiled[name]
    storages = independent_saved(p.spec)
    assert sum(s.saved_bytes for s in p.chain.stages) == sum(storages.values())
    assert sum(s.storages for s in p.chain.stages) == len(storages)  # what moving every unit copies


@pytest.mark.parametrize("name", list(SMALL))
def test_every_forward_peak_holds_the_stage_unit(profiled, name):
    for s in profiled[name].chain.stages:
        assert s.fwd_peak_bytes >= s.saved_bytes
        assert s.bwd_peak_bytes >= 0 and s.fwd_s > 0 and s.bwd_s > 0


def test_a_storage_dropped_right_after_a_boundary_is_carried_into_the_next_stage():
    """``x = block(x)`` drops the old value after the block's hooks: after the boundary, before
    the next stage's first op.  It is alive as that stage starts, and the meter's reading at
    the boundary starts the stage's peak, so it is carried into it (ResNet's stem: counted as
    dead there, a recomputed stem's next stage read 7.5 KiB over its prediction)."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x):
            x = self.a(x)
            x = self.b(x)  # b saves a's output (its unit's), dropped here, after b's boundary
            return self.c(torch.tanh(x))

    torch.manual_seed(0)
    module = Net()
    spec = ModelSpec(module, (torch.randn(2, 16),), {}, lambda out: out.square().mean())
    m = measure(StepRunner(Staging(module, [Site("a"), Site("b")]), spec, torch.device("cpu"), "sgd"),
                repeats=1, warmup=1)
    assert m.stages[1].carry_bytes == 2 * 16 * 4  # a's output, into F3


def test_hand_counted_mlp():
    """Linear(4,8) -> ReLU -> Linear(8,3), batch 2, float32, loss mean(out^2): the bytes counted by hand."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    spec = ModelSpec(module, (torch.randn(2, 4),), {}, lambda out: out.square().mean())
    args, kwargs = spec.batch()
    cap = capture(module, lambda: spec.loss(module(*args)), (args, kwargs))
    stages = stages_at(cap, default_cuts(cap))
    assert [st.name for st in stages.stages] == ["0", "2"] and stages.cuts == [Site("1")]  # ReLU joins Linear 1
    m = measure(StepRunner(Staging(module, stages.cuts), spec, torch.device("cpu"), "sgd"), repeats=1, warmup=1)
    # stage 1 saves the ReLU output (64 B), which Linear 2 saves too: need_from 2 (the batch it also
    # saves is the loop's, in base_bytes); stage 2 saves its output (24 B) for the loss's square
    assert [s.saved_bytes for s in m.stages] == [64, 24]
    assert [s.need_from for s in m.stages] == [2, 2]
    assert [s.storages for s in m.stages] == [1, 1]
    assert m.stages[0].fwd_peak_bytes == 64 + 64  # Linear 1's output and the ReLU's
    assert m.stages[1].fwd_peak_bytes >= 24 + 24 + 4  # output, square, mean (and the loss's backward to the output)
    assert m.base_bytes == 3 * (4 * 8 + 8 + 8 * 3 + 3) * 4 + 2 * 4 * 4  # weights, grads, SGD momentum; the batch


def test_residual_blocks_become_stages(profiled):
    names = [s.name for s in profiled["resnet18"].chain.stages]
    for layer, block in itertools.product(range(1, 5), range(2)):
        assert f"layer{layer}.{block}" in names
    assert len(names) >= 8 + 2


def test_a_stage_that_runs_part_of_a_module_is_named_by_its_span():
    """BERT cuts each layer after its attention: the layer's second stage is not all of
    ``bert.encoder.layer.0`` (the attention stage runs part of it), so it is named by the
    submodules it runs; a stage that runs all of a module keeps that module's name."""
    spec = resolve("bert", 2, {"layers": 2, "width": 32, "heads": 4, "seq": 16, "vocab": 50})
    args, kwargs = spec.batch()
    cap = capture(spec.module, lambda: spec.loss(spec.module(*args, **kwargs)), (args, kwargs))
    names = [st.name for st in stages_at(cap, default_cuts(cap)).stages]
    assert names[2:6] == ["bert.encoder.layer.0.attention", "bert.encoder.layer.0.intermediate..output",
                          "bert.encoder.layer.1.attention", "bert.encoder.layer.1.intermediate..output"]


def test_dense_blocks_become_stages(profiled):
    names = [s.name for s in profiled["densenet121"].chain.stages]
    for i in (0, 2, 4, 6):
        assert f"features.{i}.layers" in names


def test_the_recipe_says_how_to_rebuild_and_cut(profiled):
    chain = profiled["gpt"].chain
    r = chain.recipe
    assert (r.model, r.batch, dict(r.options), r.dtype, r.optimizer) == ("gpt", 2, SMALL["gpt"], "float32", "adam")
    assert len(r.cuts) == chain.L - 1 and r.inputs == ("0:int64[2,16]",)
    assert [Site.parse(c).text for c in r.cuts] == list(r.cuts)
    assert chain.source["cpu_wait_share"] >= 0  # how busy the machine was (tests/test_contention.py)


class _Adapted(nn.Module):
    """A frozen linear with a trainable low-rank update (LoRA)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width).requires_grad_(False)
        self.down, self.up = nn.Linear(width, 4, bias=False), nn.Linear(4, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


class _Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = _Adapted(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.mlp.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


def test_a_lora_models_stages_are_named_by_the_layers_they_run():
    """Only adapters train (LoRA): a stage is named by the layers it runs, frozen weights and
    all, not by its adapters alone (``layers.1`` was ``layers.1.attn``), and a span with no
    common prefix by its first and last items (``layers.2..head``, was ``layers..head``).
    (The first adapter's output is the first value with a gradient: a cut of its own.)"""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.layers = nn.ModuleList(_Layer(16) for _ in range(3))
    model.head = nn.Linear(16, 4).requires_grad_(False)

    batch = torch.randn(2, 16)

    def run():
        x = batch
        for layer in model.layers:
            x = layer(x)
        return model.head(x).square().mean()
    cap = capture(model, run, batch)
    names = [st.name for st in stages_at(cap, default_cuts(cap)).stages]
    assert names == ["layers.0.attn.down", "layers.0.attn..mlp.2", "layers.1", "layers.2..head"]


class _Transposed(nn.Module):
    """A linear layer as Falcon writes its own: the input times a view of the weight."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x @ self.weight.T)


def test_a_weight_read_through_a_view_is_a_weight():
    """Blocks whose only weight is read as ``self.weight.T`` hold parameters: each is a stage
    (they were read as parameter-free, and the whole model one stage, ``blocks.0..mean``)."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.blocks = nn.ModuleList(_Transposed(16) for _ in range(3))
    batch = torch.randn(2, 16)

    def run():
        x = batch
        for block in model.blocks:
            x = block(x)
        return x.square().mean()
    cap = capture(model, run, batch)
    assert [st.name for st in stages_at(cap, default_cuts(cap)).stages] == ["blocks.0", "blocks.1", "blocks.2"]


def test_cut_sites_read_back_as_written():
    """A site's text (a chain's ``recipe.cuts``) parses back to it, a cut at a call's start too."""
    for text in ("h.3", "relu@2", "block@0[1]", "layers.0:in", "layers.0@1:in[2]"):
        assert Site.parse(text).text == text
    assert Site.parse("layers.0@1:in[2]") == Site("layers.0", 1, 2, before=True)
    assert not Site.parse("block@0[1]").before


def test_held_storages_are_found(profiled):
    """ResNet's forward holds the stem's output in a local while layer1..layer4 run (one
    nested call): it stays alive after its unit's release, which the chain must book."""
    chain = profiled["resnet18"].chain
    held = {i: (s.held_bytes, s.held_until) for i, s in enumerate(chain.stages, start=1) if s.held_bytes}
    stem_out = 2 * 64 * 8 * 8 * 4  # the maxpool output, first saved by layer1.0 (stage 3)
    assert held.get(3, (0, 0))[0] >= stem_out and held[3][1] >= 9


def test_profiling_twice_gives_the_same_sizes():
    opts = ProfileOptions(batch=8, repeats=2, warmup=1, options={"layers": 3, "width": 256, "features": 64})
    a, b = profile("mlp", opts).chain, profile("mlp", opts).chain
    assert [(s.saved_bytes, s.fwd_peak_bytes, s.bwd_peak_bytes, s.need_from) for s in a.stages] == \
           [(s.saved_bytes, s.fwd_peak_bytes, s.bwd_peak_bytes, s.need_from) for s in b.stages]
    assert a.base_bytes == b.base_bytes and a.recipe == b.recipe


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user_model.py"
    path.write_text(USER_MODEL)
    return path


def test_user_model_with_control_flow_and_a_residual(user_file):
    p = profile(f"{user_file}:build", ProfileOptions(batch=4, repeats=1, warmup=1))
    # the residual `h + block(h)` is in forward, so each block's own output is no cut: the sums are
    # no module's output, the stages end where a module's output dominates the rest
    assert p.chain.L >= 2
    assert sum(s.saved_bytes for s in p.chain.stages) == sum(independent_saved(p.spec).values())


def test_keyword_inputs_and_dict_outputs(user_file):
    p = profile(f"{user_file}:keywords", ProfileOptions(batch=4, repeats=1, warmup=1))
    assert p.chain.recipe.inputs == ("scale:float32[4]", "x:float32[4,8]")
    assert p.chain.L == 2


def test_plain_values_beside_the_tensors_are_part_of_the_batch(user_file):
    """A transformers CLIP takes ``return_loss=True`` beside its tensors: a plain value in the
    example input is handed to every step, recorded in the chain's signature, and a batch that
    hands another is refused (it changes what the step runs)."""
    from offload.errors import ChainMismatch
    from offload.executor import Offloaded
    from offload.step.schedule import make_schedule

    p = profile(f"{user_file}:flagged", ProfileOptions(batch=4, repeats=1, warmup=1))
    assert p.chain.recipe.inputs == ("mode='sum'", "return_loss=True", "x:float32[4,8]")
    assert load_chain_doc(p.chain).recipe.inputs == p.chain.recipe.inputs
    run = Offloaded(p.spec.module, p.chain, make_schedule(p.chain, []))
    run(x=torch.randn(4, 8), return_loss=True, mode="sum").backward()
    with pytest.raises(ChainMismatch, match="return_loss=False"):
        run(x=torch.randn(4, 8), return_loss=False, mode="sum")


def test_a_model_set_to_drop_layers_after_its_profile_is_refused_by_the_executor(user_file):
    """LayerDrop turned on after the profile (the profile refuses it: test_bad_models_get_one_
    clear_error): wrapping the model says so before any step, rather than failing at the
    first step whose draws skip a layer."""
    from offload.executor import Offloaded
    from offload.step.schedule import make_schedule

    p = profile(f"{user_file}:flagged", ProfileOptions(batch=4, repeats=1, warmup=1))
    p.spec.module.config = SimpleNamespace(layerdrop=0.2)
    with pytest.raises(ModelError, match=r"config.layerdrop=0.2\)"):
        Offloaded(p.spec.module, p.chain, make_schedule(p.chain, []))


def test_a_list_of_layers_is_cut_though_a_shared_value_crosses_it(user_file):
    p = profile(f"{user_file}:shared", ProfileOptions(batch=4, repeats=1, warmup=1))
    assert p.chain.recipe.cuts[:5] == ("emb", "blocks.0", "blocks.1", "blocks.2", "blocks.3")
    assert not any("no cut was found" in w for w in p.warnings)
    assert all(values[1].startswith("linear in emb") for values in p.chain.source["crossing"].values())


def test_a_stage_whose_held_tensor_the_forward_writes_later_is_not_re_run(user_file):
    """The blocks read ``bias`` as an argument, which the forward writes in place after them:
    a re-run would read other values, so they are not re-runnable, and the note says why."""
    p = profile(f"{user_file}:overwritten", ProfileOptions(batch=4, repeats=1, warmup=1))
    assert p.chain.recipe.cuts[:4] == ("emb", "blocks.0", "blocks.1", "blocks.2")
    assert not {2, 3, 4} & p.chain.recomputable
    assert any("writes in place, after the stage, a tensor its re-run reads" in n for n in p.chain.source["notes"])


def test_a_stage_whose_call_writes_a_tensor_it_holds_is_not_re_run(user_file):
    """The head stage pools its input in its forward's code (held: made of what crossed the
    boundary, not of a recorded call's output) and scales the pool in place: a re-run would
    read the pool written, so the stage is not re-runnable and the note says why."""
    p = profile(f"{user_file}:pooled_input", ProfileOptions(batch=4, repeats=1, warmup=1))
    k = list(p.chain.recipe.cuts).index("scale") + 1  # the stage the scale ends: the pool and the scale
    assert k not in p.chain.recomputable and {2, 3} <= p.chain.recomputable
    assert any(f"stage {k} cannot be re-run: a call of it writes in place a tensor made before that call" in n
               for n in p.chain.source["notes"])


def test_a_stage_that_writes_in_place_a_pool_of_its_own_calls_is_re_run(user_file):
    """The last stage pools its last block's output in its forward's code and drops the pool
    out in place (MobileViT's head): the pool reads what a recorded call made, so it is
    recorded too, and the re-run makes it again before the dropout writes it (it was held,
    written, and the stage could not be re-run).  Recomputed with the block before it, it
    trains bit for bit with every op as predicted."""
    from offload.step.actions import Recompute
    from offload.step.schedule import make_schedule
    from tests.runs import check_run

    chain = profile(f"{user_file}:pooled", ProfileOptions(batch=4, repeats=1, warmup=1)).chain
    k = list(chain.recipe.cuts).index("drop") + 1  # the stage the dropout ends: the last block, the pool and the dropout
    assert k in chain.recomputable
    check_run(chain, make_schedule(chain, [], recompute=[Recompute(k - 1, k)]), "cpu-eager", "pooled head")


def test_an_unread_pooler_after_the_blocks_makes_no_cut_at_the_heads_start(user_file):
    """The backbone's call runs a pooler after its blocks' output and returns both; the head
    reads the blocks' output.  The pooler's ops, made after that output and before the head's
    call, looked like code that makes the head's input: a cut at the head's start
    (``head:in``) ended a stage of no ops right after the backbone's, whose transients and
    held parts then disagreed (SqueezeBERT: "stages[10].input_held_bytes must be in [0, 0]")."""
    p = profile(f"{user_file}:unpooled", ProfileOptions(batch=4, repeats=1, warmup=1))
    assert not any(cut.endswith(":in") for cut in p.chain.recipe.cuts), p.chain.recipe.cuts


def test_a_collapsed_chain_says_so_and_names_the_cause(user_file):
    """Layers inside a block are not cut where a shared value crosses them."""
    p = profile(f"{user_file}:nested", ProfileOptions(batch=4, repeats=1, warmup=1))
    assert p.chain.L <= 3
    warning = " ".join(p.warnings)
    assert "6 blocks" in warning and "no cut was found" in warning and "linear in emb" in warning


@pytest.mark.parametrize("head", [1, 3])
def test_a_frozen_backbone_is_said_for_what_it_is(user_file, head):
    """Blocks that compute without gradient save nothing, so no stage ends among them: the
    warning says that, not that a shared value blocks the cuts; the trainable head gets its
    own stages; where the floor is the backbone's own forward memory, the warning names the
    op and suggests a smaller batch, not more stages."""
    p = profile(f"{user_file}:frozen", ProfileOptions(batch=64, repeats=1, warmup=1, options={"head": head}))
    assert p.chain.L == head
    warning = " ".join(p.warnings)
    assert "6 of the 6 blocks of 0 compute without gradient" in warning and "no cut was found" not in warning
    if head == 1:
        assert "F1 (1) holds it" in warning and "a smaller batch" in warning and "--stages" not in warning


def test_a_forward_whose_calls_differ_from_the_profiled_ones_is_told_why(user_file):
    """Blocks skipped after the profile (here all of them, turned on after it; the profile of a
    model that skips at random stops so too: test_bad_models_get_one_clear_error): the step
    stops at the first boundary out of order, or at its end with none passed, with a
    ``CallsDiffer`` (a ``ModelError``: exit 2) whose hint names the likely cause, not "check
    that the model runs"."""
    from offload.errors import CallsDiffer
    from offload.executor import Offloaded
    from offload.step.schedule import make_schedule

    p = profile(f"{user_file}:skipping", ProfileOptions(batch=4, repeats=1, warmup=1, options={"skip": 0.0}))
    run = Offloaded(p.spec.module, p.chain, make_schedule(p.chain, []))
    p.spec.module.skip = 1.0
    with pytest.raises(CallsDiffer, match="0 of the 5 stage boundaries were passed in this forward: the model's calls ") as raised:
        run(torch.randn(4, 16))
    assert isinstance(raised.value, ModelError) and "skips blocks at random" in raised.value.hint


def test_blocks_run_again_by_a_custom_function_are_not_called_frozen(user_file):
    """Reformer's reversible layers run inside one autograd Function that records nothing and
    runs them again in its backward: like frozen blocks they save nothing and no stage ends
    among them, but their weights train, and the warning says where they run instead."""
    p = profile(f"{user_file}:reversible", ProfileOptions(batch=4, repeats=1, warmup=1))
    warning = " ".join(p.warnings)
    assert "4 of the 4 blocks of layers compute without gradient though their weights train" in warning
    assert "frozen" not in warning


@pytest.mark.slow  # make test-all (time: make test stays under 3 minutes in a fresh clone)
def test_a_users_file_is_found_from_any_directory(user_file, tmp_path, monkeypatch, capsys):
    """Profiled as ``user_model.py:build`` in its own directory, the chain trains from another
    one (it records where the file was), takes the file again on the command line however
    its path is written, or a copy of it (the same bytes), and refuses an edited copy or a
    file gone, saying which."""
    monkeypatch.chdir(user_file.parent)
    assert main(["profile", "user_model.py:build", "--batch", "4", "--repeats", "1", "--warmup", "1",
                 "-o", "c.json"]) == 0
    assert main(["solve", "c.json", "--budget", "100%", "-o", "s.json"]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    chain = ["--chain", "../c.json", "--schedule", "../s.json", "--steps", "1", "--quiet"]
    copy = elsewhere / "copy.py"
    copy.write_bytes(user_file.read_bytes())
    for model in ([], [f"{user_file}:build"], ["../user_model.py:build"], ["copy.py:build"]):
        assert main(["train", *model, *chain]) == 0, capsys.readouterr().err
    copy.write_text(copy.read_text() + "\n# edited\n")
    assert main(["train", "copy.py:build", *chain]) == 2
    assert "copy.py is another file, its bytes differ" in capsys.readouterr().err
    assert main(["train", "copy.py:shared", *chain]) == 2  # another function
    user_file.rename(tmp_path / "moved.py")
    assert main(["train", *chain]) != 0
    err = capsys.readouterr().err
    assert "model file not found: user_model.py" in err and f"profiled from {user_file}, gone too" in err


def _tiny_llama():
    return profile("llama", ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False, options={
        "layers": 2, "width": 64, "heads": 4, "kv_heads": 2, "seq": 32, "vocab": 64, "dropout": 0.1})).chain


def test_a_swiglu_block_has_an_option_between_all_kept_and_all_recomputed():
    """The in-stage menu (issue #33): each decoder block of a Llama (SwiGLU MLP, attention
    dropout) offers ``matmuls``, which keeps strictly less than its whole unit (measured) and
    re-runs strictly less than its whole forward (on a device where that pays: this CPU's
    re-runs in part are timed at ``tests.runs.STAND_IN_RATIOS`` of the whole), and
    ``every-other-matmul``, which keeps less still; the options are in the file."""
    with options_paying():
        chain = _tiny_llama()
    blocks = [s for s in chain.stages if s.name.startswith("model.layers.")]
    assert len(blocks) == 2
    for s in blocks:
        assert [o.name for o in s.options] == ["matmuls", "every-other-matmul"]
        option, half = s.option("matmuls"), s.option("every-other-matmul")
        assert 0 < half.kept_bytes < option.kept_bytes < s.saved_bytes
        # shares of the stage's own re-run and recorded forward, as timed on this CPU in the
        # executor's steps (the recording's and the replay's work in them)
        assert s.rerun_s is not None and s.recorded_fwd_s >= s.fwd_s and s.recorded_bwd_s >= s.bwd_s
        assert option.recompute_s == pytest.approx(s.rerun_s / 2) and option.fwd_s == pytest.approx(1.1 * s.recorded_fwd_s)
        assert option.fwd_peak_bytes > 0 and option.rerun_peak_bytes > 0
    assert load_chain_doc(chain) == chain


def test_an_option_no_faster_than_the_whole_re_run_is_not_offered(monkeypatch):
    """Where the re-run in part measures no faster than the whole one (a small block on a CPU,
    whose dispatch mode costs more than the matmuls it saves), keeping part of the unit only
    costs memory: the menu is empty."""
    monkeypatch.setattr(selective, "rerun_ratios", lambda runner, candidates: {c: (1.0, 1.0) for c in candidates})
    assert all(not s.options for s in _tiny_llama().stages)


def test_timing_spread_is_reported(profiled):
    m = profiled["mlp"]
    assert "spread" in m.chain.source["step_s"]
    noisy = type("M", (), {"step_s": [1.0, 1.0, 2.0]})()
    assert spread(noisy.step_s) == 1.0 and "disagree by 100%" in timing_warnings(noisy)[0]
    assert "the machine is busy" in timing_warnings(noisy)[0] == timing_warnings(noisy, 0.5)[0]
    quiet = timing_warnings(noisy, 0.02)[0]  # the threads hardly waited: not other processes
    assert "not other processes (its threads waited for a CPU 2% of the time they ran)" in quiet
    assert timing_warnings(type("M", (), {"step_s": [1.0, 1.05, 1.1]})()) == []


def test_package_module_reference(user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file.parent))
    spec = resolve("user_model:build", 3)
    assert spec.args[0].shape == (3, 16)


def test_merge_to_a_stage_count():
    p = profile("resnet18", quick("resnet18", stages=4))
    assert p.chain.L == 4
    assert sum(s.saved_bytes for s in p.chain.stages) == sum(independent_saved(p.spec).values())


@pytest.mark.parametrize("weights,count", [([1, 2, 3, 4, 5], 2), ([5, 1, 1, 1, 5, 1], 3), ([1] * 7, 7), ([3, 1], 5)])
def test_merge_to_is_the_best_contiguous_split(weights, count):
    ends = merge_to(weights, count)
    groups = [weights[a + 1:b + 1] for a, b in zip([-1] + ends, ends + [len(weights) - 1])]
    assert len(groups) == min(count, len(weights)) and sum(groups, []) == weights
    best = min(max(sum(weights[a + 1:b + 1]) for a, b in zip((-1,) + cut, cut + (len(weights) - 1,)))
               for cut in itertools.combinations(range(len(weights) - 1), min(count, len(weights)) - 1))
    assert max(sum(g) for g in groups) == best


def test_cli_profile_writes_chain_and_graphml(tmp_path):
    out, graph = tmp_path / "c.json", tmp_path / "g.graphml"
    rc = main(["profile", "mlp", "--batch", "2", "-O", "layers=2", "-O", "width=32", "--repeats", "1",
               "-o", str(out), "--graphml", str(graph), "-q"])
    assert rc == 0
    chain = load_chain(out)
    assert chain.recipe.model == "mlp" and "CPU stand-in" in chain.platform.note
    g = nx.read_graphml(graph)
    stages = {d["stage"] for _, d in g.nodes(data=True) if "stage" in d}
    assert stages == set(range(1, chain.L + 1))


def test_cli_bandwidth_override(tmp_path, capsys):
    """--bandwidth and --latency are the platform's; and the profile times a plain PyTorch step
    beside each timed one (``source.plain_step_s``), which ``show`` prints beside the hooked step."""
    out = tmp_path / "c.json"
    assert main(["profile", "mlp", "--batch", "2", "-O", "layers=2", "--repeats", "2", "-q",
                 "--bandwidth", "25GB/s,20GB/s", "--latency", "10us", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    p = doc["platform"]
    assert (p["d2h_bytes_per_s"], p["h2d_bytes_per_s"], p["latency_s"]) == (25e9, 20e9, pytest.approx(1e-5))
    assert "not measured" in p["note"]
    plain = doc["source"]["plain_step_s"]
    assert 0 < plain["min"] <= plain["median"] <= plain["max"]
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    assert "as plain PyTorch runs it, timed beside the profile's steps" in capsys.readouterr().out


def test_a_profile_without_recomputation_offers_none_and_says_so():
    """``--no-recompute``: no re-run is measured, no stage is recomputable, a note says why (a
    chain of the compiled graph skips five compiles so)."""
    chain = profile("gpt", ProfileOptions(batch=2, repeats=1, warmup=0, encodings=False, recompute=False,
                                          options={"layers": 2, "width": 32, "heads": 2, "seq": 16, "vocab": 64})).chain
    assert not chain.recomputable and not any(s.options for s in chain.stages)
    assert "recomputation not measured (--no-recompute): the chain offers none" in chain.source["notes"]


def test_a_few_slow_small_copies_make_no_latency():
    """The copy line's latency is the small copy's median less its bytes at the bandwidth: on a
    busy 2-core host the first small copies after a large one waited 7.9 ms for a descheduled
    thread (a 64 KiB copy takes 5 us), which a median of the profile's 5 repeats made an
    8 ms latency per copy; the cheap small copy is timed SMALL_REPEATS times."""
    calls = {"small": 0}

    def copy(n: int) -> float:  # seconds of an 8 GB/s copy with 5 us latency; 8 ms for the first six small ones
        if n == bandwidth.SMALL:
            calls["small"] += 1
            if calls["small"] <= 6:
                return 8e-3
        return 5e-6 + n / 8e9

    bw, latency = bandwidth._line(copy, 64 * 2**20, repeats=5)
    assert bw == pytest.approx(8e9, rel=1e-3) and latency == pytest.approx(5e-6, rel=1e-3)


@pytest.mark.parametrize("model,message", [
    ("nosuch", "unknown model 'nosuch'"),
    ("missing_dir/none.py:build", "model file not found"),
    ("{file}:nofn", "no function 'nofn'"),
    ("{file}:raises", "building {file}:raises failed: RuntimeError: no such weights"),
    ("{file}:exits", "building {file}:exits failed: SystemExit"),
    ("{file}:bad_forward", "failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    ("{file}:not_a_tuple", "expected (module, example_input[, loss_fn])"),
    ("{file}:skipping", "the model's calls differ from the profiled ones"),
    ("{file}:layer_dropping", "skips whole layers at random while training (LayerDrop: config.encoder.layerdrop=0.05, "
                              "config.layerdrop=0.1)"),
    ("{file}:routed", "what the model saves for the backward changes from one step to the next on the same batch"),
    ("{file}:thresholded", "what the model saves for the backward changes from one step to the next on the same batch"),
    ("{file}:listed", "with plain values (bool, int, float, str, NoneType) beside them as options; found Tensor, list"),
    ("no_such_package_xyz:fn", "cannot import module 'no_such_package_xyz'"),
    ("torchvision:resnet18", "torchvision cannot be imported"),
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


def test_a_module_name_for_a_file_here_says_to_give_the_file(tmp_path, monkeypatch, capsys):
    """``mymodels.net:build`` from a directory holding mymodels/net.py: Python imports module names
    from the installed packages, so the message names the file form that works."""
    (tmp_path / "mymodels").mkdir()
    (tmp_path / "mymodels" / "net.py").write_text("def build(batch_size):\n    raise SystemExit\n")
    monkeypatch.chdir(tmp_path)
    assert main(["profile", "mymodels.net:build", "--batch", "2", "-o", "c.json", "-q"]) == 2
    err = capsys.readouterr().err
    assert "cannot import module 'mymodels.net'" in err and "give mymodels/net.py:build" in err


def test_bad_options_are_refused():
    with pytest.raises(ModelError, match="does not accept"):
        resolve("resnet18", 2, {"depth": 3})
    with pytest.raises(ModelError, match="--batch must be at least 1"):
        resolve("mlp", 0)
    assert main(["profile", "mlp", "--batch", "2", "-O", "oops", "-o", "x.json"]) == 2


def test_a_menu_holds_the_pareto_front_between_keeping_and_recomputing():
    """An option is offered where it keeps part of the unit, re-runs part of the forward and no
    other keeps no more and re-runs no more."""
    candidates = {"a": (10, 1.0), "b": (20, 0.5), "dominated": (20, 1.0), "keeps nothing": (0, 0.2),
                  "keeps it all": (100, 0.1), "re-runs it all": (5, 1.5)}
    assert _menu(candidates, 100, 1.5) == {"a": (10, 1.0), "b": (20, 0.5)}


def test_replays_are_timed_as_the_executor_replays_them():
    """The re-runs' host time (``profiler.replays``): every stage asked for is recorded,
    replayed and timed; the host's intervals line up with the stages (one per stage but the
    last).  On a CPU, whose host is the device, they are the stages' recorded times: the
    forward the timed steps measured plus what recording adds, the replay's time, and the
    backward as timed (the eager model's kernels)."""
    from offload.profiler import replays

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    spec = ModelSpec(module, (torch.randn(8, 16),), {}, lambda out: out.square().mean())
    args, kwargs = spec.batch()
    cap = capture(module, lambda: spec.loss(module(*args)), (args, kwargs))
    stages = stages_at(cap, default_cuts(cap))
    runner = StepRunner(Staging(module, stages.cuts), spec, torch.device("cpu"), "sgd")
    L = stages.L
    assert L >= 3
    assert len(replays._forward_host(runner, {})) == L - 1
    rerun, recording = replays.host_seconds(runner, list(range(1, L)))
    assert sorted(rerun) == sorted(recording) == list(range(1, L))
    assert all(t > 0 for t in rerun.values()) and all(t >= 0 for t in recording.values())
    timed = [(0.001 * k, 0.002 * k) for k in range(1, L + 1)]
    recorded = replays.recorded_times(runner, list(range(1, L)), timed, 1, eager_kernels=True)
    assert sorted(recorded) == list(range(1, L))
    for k, (forward, again, backward) in recorded.items():
        assert forward >= timed[k - 1][0] and again > 0 and backward is None
    runner.staging.remove()


def test_a_call_that_hands_its_input_back_is_no_cut_of_its_own():
    """A dropout of p=0 (which ATen returns as it is) or ``nn.Identity`` computes nothing: its
    output is its input, a value its producer's call made, so the cut is that call's, and a
    compiled graph, which has no node inside the identity, finds it (GPT-NeoX's emb_dropout:
    its compiled profile stopped as at a graph break).  A call that changes its input in
    place makes a new value, and cuts there."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0), nn.Identity(), nn.ReLU(inplace=True), nn.Linear(8, 8),
                           nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    cap = capture(module, lambda: module(x).square().mean(), ((x,), {}))
    cuts = [site.module for site in cap.candidates]
    assert cuts == ["0", "3", "4", "5", "6"]


def test_a_torchvision_models_options_are_the_recipes(monkeypatch):
    """``torchvision:NAME -O image=64``: the chain's recipe keeps ``image`` (and ``classes``),
    so that ``offload train`` rebuilds the model at the profiled size (it used to rebuild at
    224 and refuse the batch).  torchvision stands in here: its wheel may not be installed."""
    import sys
    from types import ModuleType

    built = {}

    def get_model(name, weights=None, num_classes=1000, **rest):
        built.update(name=name, classes=num_classes, **rest)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(num_classes))

    fake = ModuleType("torchvision.models")
    fake.get_model = get_model
    monkeypatch.setitem(sys.modules, "torchvision", ModuleType("torchvision"))
    monkeypatch.setitem(sys.modules, "torchvision.models", fake)
    options = {"image": 16, "classes": 10, "width_mult": 0.5}
    spec = resolve("torchvision:tiny", 2, options)
    assert spec.options == options and built == {"name": "tiny", "classes": 10, "width_mult": 0.5}
    assert spec.batch()[0][0].shape == (2, 3, 16, 16)


BATCHNORM_NET = '''
import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    """A convolution, its batch norm and a ReLU in one call (no submodules: one compiled region)."""

    def __init__(self, cin, cout):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(cout, cin, 3, 3) * 0.1)
        self.scale, self.shift = nn.Parameter(torch.ones(cout)), nn.Parameter(torch.zeros(cout))
        self.register_buffer("running_mean", torch.zeros(cout))
        self.register_buffer("running_var", torch.ones(cout))

    def forward(self, x):
        y = F.conv2d(x, self.weight, padding=1)
        y = F.batch_norm(y, self.running_mean, self.running_var, self.scale, self.shift, training=self.training)
        return F.relu(y)


def build(batch_size):
    torch.manual_seed(0)
    net = nn.Sequential(Block(3, 8), Block(8, 8), Block(8, 8), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))
    return net, torch.randn(batch_size, 3, 8, 8)
'''


def test_a_compiled_model_whose_units_the_cpu_meter_cannot_see_is_refused(tmp_path, capsys):
    """On the CPU the memory passes meter each op under a dispatch mode, under which
    torch.compile runs the model uncompiled (and, once seen there, its frames stay so): a
    BatchNorm saves its running statistics themselves uncompiled and copies of them compiled,
    so a ResNet profiled --compile on the CPU was refused at its first training step ("stage 7
    saved 53248 B ... when profiled it saved 47104 B").  The profile compiles afresh after the
    metered passes, compares the units, and says so at once, writing nothing; the timed steps
    then run compiled again."""
    model = tmp_path / "bn.py"
    model.write_text(BATCHNORM_NET)
    out = tmp_path / "c.json"
    torch._dynamo.reset()
    assert main(["profile", f"{model}:build", "--batch", "2", "--compile", "aot_eager", "--no-encodings",
                 "--no-recompute", "--repeats", "1", "--warmup", "1", "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert "runs a torch.compile'd model uncompiled, and the compiled model saves other tensors" in err
    assert "B compiled and" in err and "--whole-graph" in err and "Traceback" not in err
    assert not out.exists()
    assert main(["profile", f"{model}:build", "--batch", "2", "--no-encodings", "--no-recompute", "--repeats", "1",
                 "--warmup", "1", "-o", str(out), "-q"]) == 0  # uncompiled: as measured


def test_a_profile_whose_compiles_hit_the_recompile_limit_says_what_to_do(monkeypatch):
    """timm's PoolFormer: each block's drop-path rate differs, torch.compile makes one graph per
    block, and past its recompile limit (8) the rest ran uncompiled, with one line of dynamo's
    log.  The profile counts the limit's hits in dynamo's own counters and says what that does
    to the chain and how to lift it."""
    from torch._dynamo.utils import counters

    from offload.profiler.profile import _recompile_warning, recompile_limit_hits

    before = recompile_limit_hits()
    monkeypatch.setitem(counters, "unimplemented", counters["unimplemented"].copy())
    counters["unimplemented"]["Dynamo recompile limit exceeded\n  Explanation: ..."] += 2
    counters["unimplemented"]["Call to `torch._dynamo.graph_break()`\n  Explanation: ..."] += 1
    assert recompile_limit_hits() == before + 2
    assert _recompile_warning(0) == []
    [said] = _recompile_warning(2)
    assert "torch.compile hit its recompile limit (8) 2 time(s)" in said
    assert "set torch._dynamo.config.recompile_limit above the number of blocks" in said


def test_a_builders_chain_is_named_after_its_file_and_function(user_file):
    """Builders are often all called ``build``: a chain named ``build-b4`` titled a sweep's plot
    with nothing of the model.  The default name carries the file's name too; a zoo or
    torchvision model keeps its own."""
    from offload.profiler.profile import _model_label

    assert profile(f"{user_file}:build", ProfileOptions(batch=4, repeats=1, warmup=1)).chain.name == "user_model.build-b4"
    assert [_model_label(m) for m in ("gpt2", "torchvision:resnet50", "pkg.models:make")] == ["gpt2", "resnet50",
                                                                                              "models.make"]
