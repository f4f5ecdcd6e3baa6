"""The real ``CudaBackend`` on the CPU, through the fake CUDA of ``tests/cudashim.py``: race
free and bit-exact as written, and each of its stream-ordering calls shown necessary by
removing it (a mutation test per call site, found in the source, so a new call is covered)."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from cudashim import FakeAllocator, FakeCuda

from offload.core.devices import make_optimizer
from offload.core.encoders import ENCODERS, usable_on
from offload.core.meters import Clock, CudaMeter
from offload.errors import ChainMismatch
from offload.executor import Offloaded
from offload.executor import backends
from offload.executor.compiled import SchedulePartitioner
from offload.executor.graph_copies import GraphCopies
from offload.executor.report import Report
from offload.executor.train import _measured
from offload.executor.trainer import Trainer
from offload.models import resolve
from offload.profiler import encodable
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.checkpointing import block_runs
from offload.solver.methods import Options, solve
from offload.step.actions import Offload, first_checkpoint_release
from offload.step.memory import floor_offloads, no_offload_peak, smallest_feasible_budget
from offload.step.recompute import moved_checkpoint_bytes, run_op
from offload.step.schedule import make_schedule
from offload.step.simulate import simulate

pytestmark = pytest.mark.cudashim

GPT = {"layers": 2, "width": 32, "heads": 4, "seq": 16, "vocab": 50}
ORDERING = {"wait_event", "wait_stream", "record"}


@pytest.fixture(scope="module")
def chain():
    """Profiled on the CPU, where the fake CUDA runs it, whether or not a real GPU is visible (on
    a GPU by default, the chain saved what CUDA kernels save: other bytes than the CPU's)."""
    return profile("gpt", ProfileOptions(batch=2, repeats=1, warmup=1, device="cpu", options=GPT)).chain


def schedules(chain):
    budget = (smallest_feasible_budget(chain) + no_offload_peak(chain)) // 2
    return {"everything": make_schedule(chain, floor_offloads(chain)),
            "solved": solve(chain, budget, "relax-lp", Options(heuristic_time_s=0.1)).schedule,
            "late-release": make_schedule(chain, [Offload(i, chain.L, chain.stage(i).need_from)
                                                  for i in chain.offloadable]),
            # every other stage that can be re-run recomputed, the others offloaded
            "recompute": make_schedule(chain, [Offload(i, i + 1, chain.stage(i).need_from) for i in chain.offloadable
                                               if i not in sorted(chain.recomputable)[::2]],
                                       recompute=block_runs(chain)[::2]),
            # every stage that can be re-run recomputed, its checkpoint offloaded at once
            "moved-checkpoints": make_schedule(chain, [], recompute=[
                dataclasses.replace(r, release=first_checkpoint_release(chain, r), prefetch=run_op(chain, r))
                for r in block_runs(chain) if moved_checkpoint_bytes(chain, r)])}


def checked(backend_class: type, cuda: FakeCuda) -> type:
    """``backend_class`` as the runtime uses it, with the free of a released storage shown to
    the fake CUDA (no ``record_stream``: the free is on the compute stream) and plain host
    slots (no pinned memory without a GPU)."""
    class Checked(backend_class):
        pin = False

        def released(self, src: torch.Tensor) -> None:
            cuda.freed(src)
            super().released(src)

        def evict(self, held: torch.Tensor) -> None:  # a held part's memory goes back to the compute stream
            cuda.freed(held)
            super().evict(held)
    return Checked


def train_steps(chain, schedule, backend_class, monkeypatch, steps=2):
    """``steps`` steps of the chain's model under the schedule on the fake CUDA, and of the plain
    model: (the fake CUDA and what it saw, gradients equal every step, bytes moved)."""
    r = chain.recipe
    mine, plain = (resolve(r.model, r.batch, dict(r.options)) for _ in range(2))
    equal = True
    with FakeCuda(monkeypatch) as cuda:
        monkeypatch.setitem(backends.BACKENDS, "cuda", checked(backend_class, cuda))
        run = Offloaded(mine.module, chain, schedule, backend="cuda")
        for step in range(steps):
            torch.manual_seed(step)
            mine.loss(run(*mine.args)).backward()
            with cuda.outside():
                torch.manual_seed(step)
                plain.loss(plain.module(*plain.args)).backward()
                for a, b in zip(mine.module.parameters(), plain.module.parameters()):
                    equal &= torch.equal(a.grad, b.grad)
                    a.grad = b.grad = None
        assert cuda.synchronizations == 0  # the steps never wait for the whole device
        torch.cuda.synchronize()
    return cuda, equal, run.moved_bytes


def protocol(backend_class, monkeypatch) -> tuple[FakeCuda, bool]:
    """The backend's contract called directly, in the tightest order it allows (the runtime
    adds waits of its own in between, which can hide a missing edge): D2H of a storage into
    a slot, at once the H2D of that slot (after that D2H, not after a wait of the compute
    stream), at once the next D2H into the same slot (after that H2D's read), then the
    waits.  (races, the round trip bit for bit)."""
    with FakeCuda(monkeypatch) as cuda:
        backend = checked(backend_class, cuda)(torch.device("cpu"))
        first, second = torch.randn(256).view(torch.uint8), torch.randn(256).view(torch.uint8)
        slot = torch.empty(first.numel(), dtype=torch.uint8)
        d2h = backend.d2h(first, slot, None)
        buffer = backend.empty(first.numel())
        h2d = backend.h2d(slot, buffer, d2h)
        again = backend.d2h(second, slot, h2d)
        backend.wait(h2d)
        same = torch.equal(buffer.clone(), first)
        backend.wait(again)
        backend.wait(d2h)
        backend.released(first), backend.released(second)
        torch.cuda.synchronize()
    return cuda, same


def test_the_protocol_round_trip_is_race_free(monkeypatch):
    cuda, same = protocol(backends.CudaBackend, monkeypatch)
    assert cuda.races == [] and same


@pytest.mark.parametrize("name", ["everything", "solved", "late-release", "recompute", "moved-checkpoints"])
def test_the_cuda_backend_is_race_free_and_bit_exact(chain, name, monkeypatch):
    sched = schedules(chain)[name]
    cuda, equal, moved = train_steps(chain, sched, backends.CudaBackend, monkeypatch)
    assert cuda.races == [] and cuda.host_waits == []  # nor a device value read back
    assert equal
    sim = simulate(chain, sched.offloads, recompute=sched.recompute)
    assert moved == (2 * sim.d2h_bytes, 2 * sim.h2d_bytes) != (0, 0)
    assert cuda.copies_issued == cuda.copies_run > 0


UNET = {"width": 4, "depth": 2, "image": 32}


@pytest.fixture(scope="module")
def unet():
    """A U-Net whose first skip features leave the device with their unit and come back for
    the up block that concatenates them (docs/model.md, "Held parts")."""
    return profile("tests/models/unet.py:build", ProfileOptions(batch=2, repeats=1, warmup=1, device="cpu",
                                                                encodings=False, options=UNET)).chain


def test_a_held_part_leaves_and_comes_back_race_free_and_bit_exact(unet, monkeypatch):
    """Evicted on the compute stream after the wait for its D2H copy, given its memory back on
    the compute stream before its H2D copy, which the reader waits for: no race, no host wait,
    gradients bit for bit, the restores' bytes moved as predicted."""
    sched = make_schedule(unet, floor_offloads(unet))
    assert any(o.restore for o in sched.offloads)
    cuda, equal, moved = train_steps(unet, sched, backends.CudaBackend, monkeypatch)
    assert cuda.races == [] and cuda.host_waits == [] and equal
    sim = simulate(unet, sched.offloads)
    assert moved == (2 * sim.d2h_bytes, 2 * sim.h2d_bytes) and sim.h2d_bytes > sim.d2h_bytes
    assert cuda.copies_issued == cuda.copies_run > 0


@pytest.mark.slow  # make test-all (time)
def test_a_reader_that_skips_the_restores_wait_is_caught(unet, monkeypatch):
    """The check has teeth: without the reader's wait for the restore's H2D copy, the up block
    reads a storage the copy has not written."""
    original = backends.CudaBackend.wait
    skipped = []

    def wait(self, copy):
        if copy.direction == "h2d" and copy.nbytes in {unet.stage(i).held_bytes for i in unet.restorable} and not skipped:
            skipped.append(copy)  # the first restore's wait (a prefetch of the same size comes in the backward)
            return None
        return original(self, copy)
    monkeypatch.setattr(backends.CudaBackend, "wait", wait)
    cuda, equal, _ = train_steps(unet, make_schedule(unet, floor_offloads(unet)), backends.CudaBackend, monkeypatch,
                                 steps=1)
    assert skipped and cuda.races and not equal


def compiled_steps(chain, schedule, monkeypatch, steps=2):
    """``train_steps`` for ``compile_scheduled``'s graph (aot_eager: the partitioned graphs run
    op by op, each under the fake CUDA's tracking from inside, since Dynamo runs no compiled
    frame under a dispatch mode), against plain ``torch.compile``: (the fake CUDA, gradients
    equal every step, the partitioner)."""
    r = chain.recipe
    mine, plain = (resolve(r.model, r.batch, dict(r.options)) for _ in range(2))
    torch._dynamo.reset()
    reference = torch.compile(plain.module, backend="aot_eager")
    equal = True
    with FakeCuda(monkeypatch, everywhere=False) as cuda:
        monkeypatch.setitem(backends.BACKENDS, "cuda", checked(backends.CudaBackend, cuda))

        def tracked(gm, _inputs):
            def run(*args):
                with cuda.tracked():
                    return gm(*args)
            return make_boxed_func(run)
        partitioner = SchedulePartitioner(chain, schedule, copy_backend="cuda")
        compiled = torch.compile(mine.module, fullgraph=True, backend=aot_autograd(
            fw_compiler=tracked, bw_compiler=tracked, partition_fn=partitioner))
        for step in range(steps):
            torch.manual_seed(step)
            mine.loss(compiled(*mine.args)).backward()
            with cuda.outside():
                torch.manual_seed(step)
                plain.loss(reference(*plain.args)).backward()
                for a, b in zip(mine.module.parameters(), plain.module.parameters()):
                    equal &= torch.equal(a.grad, b.grad)
                    a.grad = b.grad = None
        assert cuda.synchronizations == 0
        torch.cuda.synchronize()
    return cuda, equal, partitioner


@pytest.mark.parametrize("name", [pytest.param("everything", marks=pytest.mark.slow),
                                  pytest.param("late-release", marks=pytest.mark.slow), "recompute",
                                  pytest.param("moved-checkpoints", marks=pytest.mark.slow)])
def test_the_compiled_graphs_copies_are_race_free_and_bit_exact(chain, name, monkeypatch):
    """``compile_scheduled``'s own copy ops on the real ``CudaBackend``: the stream order of the
    compiled path proven as the eager one's, every unit (and offloaded checkpoint) moved whole,
    each way, every step."""
    sched = schedules(chain)[name]
    cuda, equal, partitioner = compiled_steps(chain, sched, monkeypatch)
    assert cuda.races == [] and cuda.host_waits == [] and equal
    runtime = partitioner.runtime
    assert runtime.d2h_bytes == runtime.h2d_bytes == 2 * runtime.planned_bytes > 0
    assert set(partitioner.moved) == {o.stage for o in sched.offloads}
    assert all(partitioner.placed.checkpoint_bytes[r.first] > 0 for r in sched.recompute if r.moves)
    assert all(left == 0 for _, left in partitioner.moved.values())
    assert cuda.copies_issued == cuda.copies_run > 0


def test_a_compiled_graph_that_skips_a_wait_is_caught(chain, monkeypatch):
    """The check has teeth: without the compute stream's wait for the H2D copy, the backward reads
    a buffer the copy has not written."""
    monkeypatch.setattr(GraphCopies, "wait", lambda self, key: self._in.pop(key))
    cuda, equal, _ = compiled_steps(chain, schedules(chain)["everything"], monkeypatch, steps=1)
    assert cuda.races and not equal


def ordering_calls() -> list[tuple[int, str]]:
    """(line, source) of every stream-ordering call in ``CudaBackend``."""
    source = textwrap.dedent(inspect.getsource(backends.CudaBackend))
    first = inspect.getsourcelines(backends.CudaBackend)[1]
    calls = [node for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ORDERING]
    return sorted((first + c.lineno - 1, ast.unparse(c)) for c in calls)


class _Drop(ast.NodeTransformer):
    """The call statement at ``line`` replaced by ``pass``."""

    def __init__(self, line: int) -> None:
        self.line = line

    def visit_Expr(self, node: ast.Expr) -> ast.AST:
        if isinstance(node.value, ast.Call) and node.lineno == self.line:
            return ast.copy_location(ast.Pass(), node)
        return node


def without(line: int) -> type:
    """``CudaBackend`` compiled from its module's source with the call at ``line`` removed."""
    path = inspect.getsourcefile(backends)
    tree = _Drop(line).visit(ast.parse(open(path).read()))
    namespace = {"__name__": backends.__name__}  # dataclasses look their module up by name
    exec(compile(ast.fix_missing_locations(tree), path, "exec"), namespace)
    return namespace["CudaBackend"]


def test_the_ordering_calls_are_found():
    found = [src for _, src in ordering_calls()]
    assert len(found) >= 7, found


@pytest.mark.parametrize("line,call", ordering_calls(), ids=[f"L{n}:{s}" for n, s in ordering_calls()])
def test_removing_any_ordering_call_is_caught(chain, line, call, monkeypatch):
    """With the call gone, the fake CUDA reports a race: in training, or in the direct
    protocol (the runtime's own waits make some edges redundant in training, not in the
    backend's contract)."""
    mutant = without(line)
    direct, _ = protocol(mutant, monkeypatch)
    trained, _, _ = train_steps(chain, schedules(chain)["everything"], mutant, monkeypatch)
    assert direct.races or trained.races, f"removing {call!r} (line {line}) went unnoticed"


def test_a_forward_on_another_stream_is_refused(chain, monkeypatch):
    spec = resolve("gpt", 2, GPT)
    with FakeCuda(monkeypatch) as cuda:
        monkeypatch.setitem(backends.BACKENDS, "cuda", checked(backends.CudaBackend, cuda))
        run = Offloaded(spec.module, chain, schedules(chain)["everything"], backend="cuda")
        with torch.cuda.stream(torch.cuda.Stream()), pytest.raises(RuntimeError, match="one compute stream"):
            run(*spec.args)


# -- the CUDA meter on the fake allocator's counters --------------------------------------

MiB = 2**20


def metered(allocator: FakeAllocator, step: list[int]) -> CudaMeter:
    """One metered block: ``step``'s allocations (negative: frees), a boundary after each."""
    with CudaMeter(torch.device("cuda", 0)) as meter:
        for nbytes in step:
            allocator.allocate(nbytes) if nbytes > 0 else allocator.free(-nbytes)
            meter.boundary()
    return meter


@pytest.mark.parametrize("prior_peak,step,peak_after", [
    (10 * MiB, [3 * MiB, -3 * MiB], 10 * MiB),  # the user's earlier peak survives the resets
    (2 * MiB, [3 * MiB, -3 * MiB], 4 * MiB),  # the block's own peak (1 MiB live + 3 MiB), not its last interval's
])
def test_the_meter_leaves_the_devices_peak_as_it_was(monkeypatch, prior_peak, step, peak_after):
    allocator = FakeAllocator(monkeypatch, allocated=MiB, peak=prior_peak, reserved=12 * MiB)
    meter = metered(allocator, step)
    assert torch.cuda.max_memory_allocated() == peak_after
    assert allocator.reserved == 12 * MiB  # served from the cache: no new device memory
    assert meter.reserved_peak == 12 * MiB


def test_the_meter_says_so_when_it_cannot_restore_the_peak(monkeypatch):
    allocator = FakeAllocator(monkeypatch, allocated=MiB, peak=10 * MiB, reserved=4 * MiB)
    with pytest.warns(UserWarning, match="reports less than the device's peak"):
        meter = metered(allocator, [3 * MiB, -3 * MiB])
    assert allocator.touched == [] and allocator.reserved == 4 * MiB
    assert meter.reserved_peak == 4 * MiB


def test_after_a_cuda_error_the_original_error_is_raised(monkeypatch):
    """A CUDA error is sticky: every later call fails too.  The meter's exit touches nothing
    then, so the user sees the error of the step, not one of the clean-up."""
    allocator = FakeAllocator(monkeypatch, allocated=MiB, peak=10 * MiB, reserved=12 * MiB)
    with pytest.raises(ValueError, match="the step's own error"):
        with CudaMeter(torch.device("cuda", 0)):
            allocator.allocate(MiB)
            allocator.sticky = True
            raise ValueError("the step's own error")


def test_the_clock_marks_its_own_devices_stream(monkeypatch):
    """Profiling on ``cuda:1`` while ``cuda:0`` is current must time ``cuda:1``'s work: the
    clock records its events on that device's stream, never on whatever is current."""
    recorded = []

    class Event:
        def __init__(self, **_):
            pass

        def record(self, stream=None):
            recorded.append(stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    clock = Clock(torch.device("cuda", 1))
    clock.mark(), clock.mark()
    assert recorded == ["stream of cuda:1"] * 2


def test_bytes_per_step_count_the_warm_up_step_too(chain, monkeypatch):
    """On a GPU the trainer leaves step 1 out of the step times (a warm-up); the bytes it
    moved are still the runtime's, so per step is over every step it ran (divided by the
    timed steps only they were 3/2 of the truth here, 8/7 in an 8-step run on an H100)."""
    sched = schedules(chain)["everything"]
    spec = resolve("gpt", 2, GPT)
    params = [p for p in spec.module.parameters() if p.requires_grad]
    FakeAllocator(monkeypatch, allocated=MiB, peak=MiB, reserved=64 * MiB)  # its counters; FakeCuda's streams
    with FakeCuda(monkeypatch) as cuda:
        monkeypatch.setitem(backends.BACKENDS, "cuda", checked(backends.CudaBackend, cuda))
        run = Offloaded(spec.module, chain, sched, backend="cuda")
        trainer = Trainer(spec, params, make_optimizer("adam", params, 1e-4), torch.device("cuda", 0))
        steps, error = trainer.measure(3, lambda args, kwargs: run(*args, **kwargs), runtime=run.runtime)
        report = Report.start(chain, sched, "cuda", "cuda:0")
        _measured(report, steps, run, chain)
    assert error is None and steps.warmup_s is not None and len(steps.step_s) == 2  # the CUDA path: step 1 apart
    sim = simulate(chain, sched.offloads)
    assert (report.measured.d2h_bytes_per_step, report.measured.h2d_bytes_per_step) == (sim.d2h_bytes, sim.h2d_bytes)


@pytest.mark.parametrize("stale,extra,expected", [pytest.param(0, 0, [2 * MiB] * 3, marks=pytest.mark.slow),  # time
                                                  (0, 3 * MiB, [5 * MiB] * 3), (7 * MiB, 3 * MiB, [9 * MiB] * 3)])
def test_a_step_is_judged_over_the_chains_base_workspaces_included(monkeypatch, stale, extra, expected):
    """cuBLAS makes its workspace at the first matmul and keeps it: in step 1 it appears during
    the step.  The chain's base counts the profiled workspace (``workspace_bytes``), so step 1
    is not charged for it; memory a run holds beyond it (``extra``: a buffer the profile never
    saw) is charged to every step, step 1 included, though after step 1 it sits in the bytes
    live as the step starts.  Memory held without a tensor before the run (``stale``: an earlier
    run's workspaces) is not the run's, but it may not be the workspaces the chain counts:
    beyond the larger of the two, all the run makes is charged.  (Tensors here are on the CPU: the fake allocator's bytes
    are all untracked, its 1 MiB at the start standing for the weights.)"""
    spec = resolve("gpt", 2, GPT)
    params = [p for p in spec.module.parameters() if p.requires_grad]
    allocator = FakeAllocator(monkeypatch, allocated=MiB + stale, peak=MiB, reserved=64 * MiB)
    made = []

    def forward(args, kwargs):
        if not made:  # the first step: the workspace, kept; and what the run holds beyond it
            allocator.allocate(4 * MiB + extra)
            made.append(True)
        allocator.allocate(2 * MiB)  # the step's activations
        allocator.free(2 * MiB)
        return spec.module(*args, **kwargs)
    trainer = Trainer(spec, params, None, torch.device("cuda", 0), workspace_bytes=5 * MiB)
    run, error = trainer.measure(3, forward)
    assert error is None and run.peaks == expected


@pytest.mark.parametrize("leak", [0, 3 * MiB])
def test_what_the_optimizer_makes_between_steps_is_the_base(monkeypatch, leak):
    """The optimizer's first update makes its state between steps 1 and 2, and the allocator
    holds more for it than its tensors (rounded up to its blocks: 2 MiB here, held by no
    tensor): that is the base's, not the steps' activations.  What a step leaves behind
    (``leak``) is still charged to every step after it."""
    spec = resolve("gpt", 2, GPT)
    params = [p for p in spec.module.parameters() if p.requires_grad]
    allocator = FakeAllocator(monkeypatch, allocated=MiB, peak=MiB, reserved=64 * MiB)
    made = []

    class Optimizer:
        state: dict = {}  # its tensors the meter tracks: none here, all the allocator's bytes are untracked

        def step(self):
            if not made:
                allocator.allocate(2 * MiB)
                made.append(True)

    def forward(args, kwargs):
        allocator.allocate(2 * MiB)  # the step's activations
        allocator.free(2 * MiB)
        allocator.allocate(leak)
        return spec.module(*args, **kwargs)
    trainer = Trainer(spec, params, Optimizer(), torch.device("cuda", 0))
    run, error = trainer.measure(3, forward)
    assert error is None
    assert run.peaks == [max(2 * MiB, leak) + n * leak for n in range(3)] and run.leaks == [leak * (n + 1) for n in range(3)]
    assert run.base_growth == 2 * MiB  # a total budget counts it: the base is that much larger than the chain says


@pytest.fixture(scope="module")
def resnet():
    """A ReLU network's chain, with encodings (sign masks where only the sign is read), on the CPU."""
    return profile("resnet18", ProfileOptions(batch=2, repeats=1, warmup=1, device="cpu", options={"image": 16})).chain


@pytest.fixture(scope="module")
def resnet_as_on_a_gpu():
    """The same chain with the encoders a GPU is offered (no ``sparse``: on a CPU the lossy
    encodings mix it in where it is smaller, and then no stage's lossy one is a GPU's alone,
    as on torch 2.11)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(encodable, "usable_on", lambda gpu: usable_on(gpu=True))
        return profile("resnet18", ProfileOptions(batch=2, repeats=1, warmup=1, device="cpu",
                                                  options={"image": 16})).chain


def gpu_encodings(chain, lossless: bool) -> dict[int, str]:
    """Per stage, its first encoding (lossless ones only, or any) that a GPU's steps may run."""
    usable = usable_on(gpu=True)
    return {i: next(e.name for e in s.encodings if all(t.encoder in usable for t in e.tensors)
                    and (e.lossless or not lossless))
            for i, s in enumerate(chain.stages, 1)
            if any(all(t.encoder in usable for t in e.tensors) and (e.lossless or not lossless) for e in s.encodings)}


def test_encoders_on_a_gpu_never_make_the_host_wait(resnet_as_on_a_gpu, monkeypatch):
    """Every encoder a GPU may run, kept and offloaded, in training steps on the fake CUDA: no
    race, no op that reads a device value back; lossless ones bit for bit."""
    resnet = resnet_as_on_a_gpu
    lossless, lossy = gpu_encodings(resnet, lossless=True), gpu_encodings(resnet, lossless=False)
    used = {t.encoder for i, name in lossy.items() for t in resnet.stage(i).encoding(name).tensors}
    assert lossless and used == set(usable_on(gpu=True)), used  # sign-mask and bf16 both run
    offloads = floor_offloads(resnet)
    for choice, exact in ((lossless, True), (lossy, False)):
        for sched in (make_schedule(resnet, [], encode=choice), make_schedule(resnet, offloads, encode=choice)):
            cuda, equal, _ = train_steps(resnet, sched, backends.CudaBackend, monkeypatch)
            assert cuda.races == [] and cuda.host_waits == [], cuda.host_waits
            assert equal or not exact


def test_a_host_wait_in_an_encoder_is_caught(resnet, monkeypatch):
    """The detector finds a ``nonzero`` put back into an encoder, and the executor refuses an
    encoder that reads its size back (``sparse``) on the CUDA backend."""
    mask = ENCODERS["sign-mask"]
    monkeypatch.setitem(ENCODERS, "sign-mask", dataclasses.replace(
        mask, encode=lambda flat: (flat.nonzero(), mask.encode(flat))[1]))
    sched = make_schedule(resnet, floor_offloads(resnet), encode=gpu_encodings(resnet, lossless=True))
    cuda, _, _ = train_steps(resnet, sched, backends.CudaBackend, monkeypatch)
    assert "nonzero" in cuda.host_waits
    sparse = {i: e.name for i, s in enumerate(resnet.stages, 1) for e in s.encodings
              if any(t.encoder == "sparse" for t in e.tensors)}
    with pytest.raises(ChainMismatch, match="sparse encoder, which reads its size back"):
        train_steps(resnet, make_schedule(resnet, [], encode=sparse), backends.CudaBackend, monkeypatch)


def test_a_batch_of_copies_is_race_free_and_round_trips(monkeypatch):
    """A unit's storages copied as one batch each way (one event before and after it): the
    H2D of each waits for the batch's D2H, the next D2H into the same slots for the H2D's
    reads, and the compute stream for each batch it reads."""
    with FakeCuda(monkeypatch) as cuda:
        backend = checked(backends.CudaBackend, cuda)(torch.device("cpu"))
        first = [torch.randn(64).view(torch.uint8) for _ in range(3)]
        second = [torch.randn(64).view(torch.uint8) for _ in range(3)]
        slots = [torch.empty(256, dtype=torch.uint8) for _ in first]
        d2h = backend.d2h_many([(src, slot, None) for src, slot in zip(first, slots)])
        buffers = [backend.empty(256) for _ in first]
        h2d = backend.h2d_many(list(zip(slots, buffers, d2h)))
        again = backend.d2h_many(list(zip(second, slots, h2d)))
        assert len({id(c.event) for c in d2h}) == 1 and len({id(c.event) for c in h2d}) == 1
        backend.wait_many(h2d)
        same = all(torch.equal(b.clone(), src) for b, src in zip(buffers, first))
        backend.wait_many(again)
        backend.wait_many(d2h)
        torch.cuda.synchronize()
    assert cuda.races == [] and same
