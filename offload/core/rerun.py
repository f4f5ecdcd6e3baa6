"""Re-running one stage's forward: what a recomputation replays (docs/executor.md, "Recomputation").

A stage is code of the user's forward between two boundaries; it has no function of its
own to call again.  While it runs, a ``StageRecorder`` (global module hooks, installed for
that stage only) records its *top-level module calls*: the calls that start and end within
the stage, not nested in another such call (when the stage ends inside a call that began
in it, a ``Sequential`` whose first block ends the stage, the calls completed inside that
one count, in order).  Beside them, a ``TorchFunctionMode`` sees the torch calls of the
stage's own code, the code of the model (or of a block the stage ends in) between those
module calls, and records each that saves a tensor for the backward (BART's and Whisper's
functional dropouts after their embeddings, DenseNet's functional ReLUs, a U-Net's
pooling), writes in place what a recorded call made, or makes a tensor of what a recorded
call made (a residual sum after a block, a concatenation of its output, a pool of it), in
order with the module calls: their re-run replays them, under the grad mode they ran in.
The rest of that code (a mask or a pool made of the stage's input or of tensors made before
the stage) is not replayed: what it makes is held where a call reads it.  Only the modules
whose calls may still run where the stage ends are watched so (``StageListener.enclosing``:
its boundary's ancestors), and none under a compiled module, whose code Dynamo would trace
with the mode.  A call of any other module completes within the stage, so the calls inside
it are not even opened (its re-run makes them again), and a call's arguments in a tuple and
a dict are flattened and copied without pytree (``_leaves``, ``_mapped``): on the development
CPU a 4-layer Qwen3's forward recording every stage took 1.84x its plain one, 1.44-1.46x
since (medians of 40 alternating pairs).  Where the stage ends
inside such a call after calls of its own began (the boundary's module called from outside
its parents in the module tree), those were not recorded, and the stage cannot be re-run.
The stage can be re-run exactly when

* every tensor it saves for the backward is saved inside one of those calls, and
* every tensor argument of a call is a parameter or buffer, part of the step's batch, the
  stage's input (the value that crossed the previous boundary, or a view of it), an output
  of an earlier call of the stage (or a view of one), or any other tensor made before the
  call, *held* as it is until the re-run: a mask, position ids, a rotary table, and the
  other values that cross a block boundary (a U-Net's skip features, an encoder's output,
  an attention bias: their gradients flow through the forward's own graph, which the re-run
  only hands its saved tensors), and
* every other argument is a value nothing can change (a number, a string, ``None``, a dtype,
  a device...): an object with state, such as a Hugging Face key/value cache that every
  attention call appends to, would be in another state when the stage runs again (so
  transformers itself turns the cache off under gradient checkpointing: train with
  ``use_cache=False``), and
* neither it nor the rest of the forward writes in place its input or a held tensor (the
  profiler checks the rest of the forward: ``written_later``).

Its re-run rebuilds its output too when that is an output of one of its calls (or a view
of one: a transformer layer's MLP half, cut by ``--split-blocks``, ends with the residual
add in the layer's own code, recorded as it reads the MLP's output); otherwise (an output
made of the stage's input alone) the stage can only end a recomputed run: the next stage's
re-run would have no input (``StageProgram.output`` is ``None``).

Then ``StageProgram.run`` replays the calls on a new input, under the stage's recorded
random state and autocast state, with grad mode on and the modules' buffers (BatchNorm's
running statistics) put back afterwards: the same kernels on the same values, so every
tensor it saves is bit-identical to what the forward saved, in the same order.  Autocast's
cache of weight casts is off in a replay: each cast dies with its reader instead of living
through the stage (a weight read twice is cast twice, to the same bits; the replay's own
graph never runs backward, so no gradient sees the second cast).  The
profiler records every stage (``recomputable`` and ``input_bytes`` in the chain); the
executor records the stages its schedule recomputes and replays them before their backward.
Under ``torch.compile`` (a graph break at each boundary) a recorded stage runs eagerly: Dynamo
is off while a recorder is open (``_EagerWhileRecording``), since compiled code runs no hooks.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from .devices import ModuleTensors
from .places import Place, place_of, view_at
from .rng import RngState, drew, forked_rng, rng_state, set_rng_state, torch_draws
from .units import among, is_weight, plain, storage_key

View = Place | None  # where in the source's storage (None: the source itself)


@dataclass(frozen=True)
class FromInput:
    """The stage's input, or a view of it."""

    view: View


@dataclass(frozen=True)
class FromCall:
    """Output value ``leaf`` (pytree order) of top-level call ``call``, or a view of it."""

    call: int
    leaf: int
    view: View


@dataclass
class Call:
    """One top-level call: a module, or a torch function the stage's own code calls, its
    arguments with tensors as references, and whether grad mode was on."""

    fn: Callable[..., Any]  # an nn.Module or a torch function
    args: tuple
    kwargs: dict
    grad: bool = True


# argument values a re-run may pass again as they are: nothing can change them in between
_UNCHANGING = (type(None), bool, int, float, complex, str, bytes, slice, type(Ellipsis), enum.Enum, type,
               types.FunctionType, types.BuiltinFunctionType, torch.dtype, torch.device, torch.layout,
               torch.memory_format, torch.Size)


# leaves as pytree has them, by exact type: a call's arguments are mostly these, in a tuple and a dict
_LEAVES = frozenset({torch.Tensor, nn.Parameter, type(None), bool, int, float, complex, str, torch.dtype,
                     torch.device})
_CONTAINERS = (tuple, list, dict)  # exact types (not a namedtuple, an OrderedDict, a registered node)


def _plain_tree(tree: Any, depth: int = 2) -> bool:
    """Whether ``tree`` is a leaf of ``_LEAVES``, or a tuple, list or dict of such trees down
    to ``depth`` levels: its leaves and its copies are then what pytree's would be, in order
    (a dict's in insertion order), at a fraction of the cost (pytree's flatten and map of a
    call's arguments took about 39 us on the development CPU, once per call recorded)."""
    kind = type(tree)
    if kind in _LEAVES:
        return True
    if depth == 0 or kind not in _CONTAINERS:
        return False
    return all(_plain_tree(v, depth - 1) for v in (tree.values() if kind is dict else tree))


def _leaves(tree: Any) -> list:
    """``tree_flatten(tree)[0]``."""
    if not _plain_tree(tree):
        return tree_flatten(tree)[0]
    out: list = []
    _rebuilt(out.append, tree)  # the same walk, in the same order (its copy dropped)
    return out


def _mapped(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree_map(fn, tree)``: new containers, ``fn`` applied to each leaf."""
    return _rebuilt(fn, tree) if _plain_tree(tree) else tree_map(fn, tree)


def _rebuilt(fn: Callable[[Any], Any], node: Any) -> Any:
    """``node`` (``_plain_tree``) in new containers, ``fn`` applied to each leaf.  A function of
    the module, not a closure calling itself: that is a reference cycle, which kept what ``fn``
    holds (a re-run's outputs) alive until Python's collector ran (a GPT's last stage then
    measured 64 KiB over its peak, and was found not re-runnable)."""
    kind = type(node)
    if kind in _LEAVES:
        return fn(node)
    if kind is dict:
        return {k: _rebuilt(fn, v) for k, v in node.items()}
    return kind(_rebuilt(fn, v) for v in node)


def _view_of(t: torch.Tensor, source: torch.Tensor | None) -> View:
    return None if t is source else place_of(t)


def _apply_view(base: torch.Tensor, view: View) -> torch.Tensor:
    return base if view is None else view_at(view, base)


class NotRerunnable(Exception):
    """The stage cannot be re-run; the message says why."""


def written_later(versions: list[tuple[weakref.ref, int]]) -> bool:
    """Whether a tensor of ``StageRecorder.versions`` that still lives was written in place
    since: the re-run would read other values than the stage did (a dead one cannot be)."""
    return any((t := ref()) is not None and t._version != version for ref, version in versions)


@dataclass
class StageProgram:
    """A stage's top-level calls, ready to replay from a new input (``run``)."""

    stage: int
    calls: list[Call]
    output: FromCall | None  # None: the re-run does not rebuild the stage's output (it can only end a run)
    input_requires_grad: bool
    held: list[tuple[torch.Tensor, int]]  # tensors held for the re-run, their versions when recorded
    rng: RngState  # every generator's state at the stage's start
    autocast: list[tuple[str, bool, torch.dtype]]

    def run(self, stage_input: torch.Tensor | None, device: torch.device,
            saved: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """Replay the calls on ``stage_input`` (its storage laid out as the recorded input's);
        ``saved`` sees every tensor saved for the backward, in the forward's order (the replay's
        own graph keeps none of them: it never runs backward, and an output saved as itself
        would make a reference cycle through autograd that Python's collector cannot free).
        Returns the stage's output, detached (the next stage's input; ``None`` where the re-run
        does not rebuild it)."""
        for t, version in self.held:
            if t._version != version:
                raise NotRerunnable(f"stage {self.stage}: a tensor held to re-run it ({t.dtype} {list(t.shape)}) was "
                                    "written in place after the stage ran")
        x = None
        if stage_input is not None:
            x = stage_input.detach().requires_grad_(self.input_requires_grad)
        outputs: list[list[Any]] = []

        def resolve(ref: Any) -> Any:
            if isinstance(ref, FromInput):
                return _apply_view(x, ref.view)
            if isinstance(ref, FromCall):
                return _apply_view(outputs[ref.call][ref.leaf], ref.view)
            return ref

        modules = [call.fn for call in self.calls if isinstance(call.fn, nn.Module)]
        buffers = [(b, b.clone()) for module in modules for b in module.buffers()]
        stored = _stored_tensors(modules)
        # the replay's graph keeps its pack hook (each saved variable holds it) for as long as
        # whatever ``saved`` stores keeps the graph: emptied after the replay, so that the hook
        # holds no way back to that store (a cycle through autograd that Python cannot collect:
        # the profiler's timed replays kept every rebuilt tensor, 139 GiB on an H200)
        sink = [saved]
        with contextlib.ExitStack() as stack:
            stack.callback(sink.clear)
            stack.enter_context(forked_rng(device))
            set_rng_state(self.rng, device)
            stack.enter_context(torch.enable_grad())
            for device_type, enabled, dtype in self.autocast:
                # no cast cache: a weight's cast dies with its reader, where the cache would
                # hold every cast of the stage through the re-run (its casts are as many bytes
                # as its saves in a bf16 Llama block); the same cast, so the same bits
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=False))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda t: sink[0](t), _never_unpacked))
            last_read = self._last_reads()
            for n, call in enumerate(self.calls):
                with torch.set_grad_enabled(call.grad):
                    out = call.fn(*_mapped(resolve, call.args), **_mapped(resolve, call.kwargs))
                outputs.append(_leaves(out))
                del out
                for done in last_read.get(n, ()):  # as the forward's code drops them
                    outputs[done] = []
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
        for module, name, value in stored:
            setattr(module, name, value)
        return resolve(self.output).detach() if self.output is not None else None

    def _last_reads(self) -> dict[int, list[int]]:
        """Per call ``n``, the calls whose outputs nothing reads after it (the stage's output is
        read last)."""
        last = {m: m for m in range(len(self.calls))}
        for m, call in enumerate(self.calls):
            for ref in _leaves((call.args, call.kwargs)):
                if isinstance(ref, FromCall):
                    last[ref.call] = m
        if self.output is not None:
            last[self.output.call] = len(self.calls)
        out: dict[int, list[int]] = {}
        for m, at in last.items():
            out.setdefault(at, []).append(m)
        return out


def _stored_tensors(modules: list[nn.Module]) -> list[tuple[nn.Module, str, torch.Tensor | None]]:
    """The plain attributes of these modules and theirs that hold a tensor (or ``None``:
    ``ModuleTensors``), put back after a re-run as its buffers are: a forward may store a
    tensor on its module (RecurrentGemma's recurrent layer keeps its last state, with its
    autograd history), and the re-run's would replace the forward's, holding the re-run's
    graph until the next forward (15 KiB over the prediction through the rest of the backward)."""
    return [(m, name, getattr(m, name)) for top in modules for m, name in ModuleTensors(top).attributes]


def _never_unpacked(_: None) -> torch.Tensor:
    raise RuntimeError("the graph of a stage's re-run has no backward")


def _autocast_state(device: torch.device) -> list[tuple[str, bool, torch.dtype]]:
    kinds = dict.fromkeys([device.type, "cpu"])
    return [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds]


class _Held(NamedTuple):
    """A tensor a stage's calls read that its re-run holds as it is."""

    tensor: torch.Tensor | None  # kept only with ``keep`` (the executor)
    ref: weakref.ref  # the tensor, while it lives
    storage: weakref.ref  # its storage, while it lives (its key may be another's after)
    version: int  # when recorded
    nbytes: int  # its storage's
    call: int  # the index in ``StageRecorder.calls`` of the call that first read it


class _Began(NamedTuple):
    """A call's arguments as it began: a call may change them before its post-hook sees them."""

    versions: dict[int, int]  # of its tensor arguments (an in-place dropout on a pooled output the model made)
    given: Any  # the arguments themselves
    copied: Any  # the same in containers of their own: a call may empty a list it is given (a U-Net's up
    # block that pops its skip feature off the list it is handed; a compiled graph's boxed arguments)


class _Own:
    """How many of our hooks are running now (``own_code``)."""

    depth = 0


@contextlib.contextmanager
def own_code() -> Iterator[None]:
    """Around the hooks of ours that run inside a model's forward (stage boundaries, the
    recorder's own): their torch calls are no stage's code, and no recorder records them."""
    _Own.depth += 1
    try:
        yield
    finally:
        _Own.depth -= 1


class _StageCode(TorchFunctionMode):
    """Hands its recorder the torch calls the stage's own code makes (``StageRecorder._op``):
    those outside every module call begun in the stage and outside our hooks; the others run
    as they are."""

    def __init__(self, recorder: "StageRecorder") -> None:
        super().__init__()
        self.recorder = weakref.ref(recorder)

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        recorder = self.recorder()
        if recorder is None or _Own.depth or not recorder.recording[-1]:
            return func(*args, **kwargs)
        return recorder._op(func, args, kwargs)


def _remove_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off the torch function mode stack, wherever it is (a mode the model
    entered in the stage and left open stays, above it or not)."""
    above = []
    while torch._C._len_torch_function_stack():
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


class _EagerWhileRecording:
    """Compiled code runs uncompiled while a stage is recorded.  A recorder sees a stage's
    module calls through Python hooks, which a compiled frame does not run: the stage is
    recorded, and re-run, as the eager calls of the user's modules.  Without it a model
    compiled per stage (a graph break at each boundary) was recorded as Dynamo happened to
    treat the hooks: torch 2.13 recompiled the stage's frame up to its recompile limit and
    then ran it eager; 2.14 ran it compiled, the recorder saw one call of Dynamo's
    ``GraphModule``, and its re-run replayed that alone, saving other tensors.

    A recorder opens and closes inside a boundary hook, which runs behind
    ``torch.compiler.disable``: the context that decorator enters puts Dynamo's callback
    back as the hook returns, and ``set_stance`` is read only as a compiled function is
    entered.  So the recorders are counted here and ``settle`` (``stage_hook``: after the
    hook, in a frame Dynamo skips without a context of its own) takes the callback off
    while one records (frames entered from then on run eager, the rest of the stage's
    frame too) and puts it back once none does."""

    def __init__(self) -> None:
        self.recorders = 0
        self._callback: Any = _NONE  # Dynamo's callback while it is off (``_NONE``: it is not)

    def settle(self) -> None:
        from torch._C._dynamo.eval_frame import set_eval_frame
        if self.recorders and self._callback is _NONE:
            self._callback = set_eval_frame(None)
        elif not self.recorders and self._callback is not _NONE:
            set_eval_frame(self._callback)
            self._callback = _NONE

    def forward_begins(self) -> None:
        """A callback taken off in a forward that raised while recording (its recorders closed
        outside a hook) was put back by Dynamo's own context as the error unwound: forgotten,
        not put back in a later forward (where a meter may run the model eager)."""
        self._callback = _NONE


_NONE = object()
EAGER_WHILE_RECORDING = _EagerWhileRecording()


def stage_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` (one of ours that a model's forward calls: a stage boundary) run eagerly under
    ``torch.compile``, a graph break, as ``own_code``; then ``_EagerWhileRecording.settle``,
    in a frame Dynamo skips (``recursive=False``: no context of its own that would put its
    callback back as the frame returns)."""
    inner = torch.compiler.disable(own_code()(hook))

    @torch.compiler.disable(recursive=False)
    @functools.wraps(hook)
    def settled(*args: Any, **kwargs: Any) -> Any:
        try:
            return inner(*args, **kwargs)
        finally:
            EAGER_WHILE_RECORDING.settle()
    return settled


def _weakly(method: Callable[..., None]) -> Callable[..., None]:
    """``method`` of an object, called while the object lives, through a weak reference."""
    ref = weakref.WeakMethod(method)

    @own_code()
    def hook(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)
    return hook


class StageRecorder:
    """Records stage ``stage``'s top-level calls while it runs (module docstring).

    Made as the stage begins (it installs the hooks); ``saved`` is told of every tensor
    saved for the backward; ``finish`` takes the stage's output, removes the hooks and
    returns the ``StageProgram`` (``NotRerunnable`` if there is none).  ``excluded``: the
    storages (by key, ``UnitTracker.excluded``) that are never a stage's input (the batch,
    parameters, buffers).  Without ``keep`` (the profiler, which only asks whether and at
    what cost) the input and the held tensors are sized, not held: recording must not change
    the memory it measures (a U-Net's up block drops its input after upsampling it).  ``opening``: the stage begins with a
    module call that is starting now (its boundary is that call's pre-hook, ``Site.before``):
    the hooks installed here miss its start, so it is opened here, and is a call of the stage."""

    def __init__(self, stage: int, stage_input: torch.Tensor | None, device: torch.device,
                 excluded: Mapping[int, weakref.ref], keep: bool = True, opening: bool = False,
                 code: frozenset[nn.Module] | None = None) -> None:
        self.stage, self.device, self.excluded, self.keep = stage, device, excluded, keep
        if stage_input is not None and plain(stage_input) and among(stage_input, excluded):
            stage_input = None  # the batch: the training loop holds it anyway
        self._input = stage_input if keep else None  # held (``keep``): the executor re-runs from it
        self._input_ref = weakref.ref(stage_input) if stage_input is not None else None
        self.input_key = storage_key(stage_input) if stage_input is not None and plain(stage_input) else None
        # the input's storage while it lives (its key may be a later storage's once it died)
        self._input_storage = weakref.ref(stage_input.untyped_storage()) if self.input_key is not None else None
        self.input_bytes = stage_input.untyped_storage().nbytes() if self.input_key is not None else 0
        self.input_version = stage_input._version if stage_input is not None else 0
        self.input_requires_grad = bool(stage_input is not None and stage_input.requires_grad)
        self.calls: list[Call] = []  # completed calls not inside another completed call, in order
        self.held: dict[int, _Held] = {}  # storage key -> the tensor held for the re-run
        self._aliases: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # id of a held tensor -> it, its alias
        # storage key -> (tensor ref, call, leaf, whether it required grad as the call returned)
        self.outputs: dict[int, list[tuple[weakref.ref, int, int, bool]]] = {}
        # per level (the stage itself, then each call begun in it and still running): where its
        # completed calls begin in ``calls``, and why it cannot be re-run if it ends the stage open
        self.starts: list[int] = [0]
        self.whys: list[str | None] = [None]
        # per level, the call's arguments as it began: its re-run reads them as they were then
        # (the profile of a U-Net whose up blocks pop their skips failed, handed the list emptied)
        self.began: list[_Began] = [_Began({}, (), ())]
        # per level, whether the torch calls of its own code are recorded (``code``: the
        # modules whose calls may still run where the stage ends; the stage's own level is)
        self.code, self.recording = code, [code is not None]
        # open calls from the outermost one of a module outside ``code`` on: such a call ends
        # before the stage does (its module is none of the boundary's ancestors), so the calls
        # inside it are dropped as it completes, and are not even opened (``_pre``): a Llama
        # block's dozen module calls cost the recording's hooks no more than a counter each
        self._opaque = 0
        self._skipped = False  # whether a call inside it has begun (a boundary at its start begins none)
        self.rng = rng_state(device)
        self.autocast = _autocast_state(device)
        # the hooks reach this recorder through a weak reference: a module call running when they
        # were installed keeps them in its frame until it returns (a Sequential the stage ends in),
        # and a strong one would keep the stage's input and calls alive that long
        self._handles = [nn.modules.module.register_module_forward_pre_hook(_weakly(self._pre)),
                         nn.modules.module.register_module_forward_hook(_weakly(self._post), with_kwargs=True)]
        EAGER_WHILE_RECORDING.recorders += 1
        self._mode = _StageCode(self) if code is not None else None
        self._off = False  # the mode taken off the stack while a call whose code it does not record runs
        if opening:
            self._pre(None, ())
        if self._mode is not None:  # on the stack now, or once the call the stage opens in returns
            if self.recording[-1]:
                self._mode.__enter__()
            else:
                self._off = True

    def saved(self) -> None:
        """A tensor is being saved for the backward now."""
        self._fail("it saves a tensor for the backward outside any module call" + (
            "" if self.code is None else " or torch function (a custom autograd.Function's ctx.save_for_backward)"))

    def _fail(self, why: str) -> None:
        """Not re-runnable, unless the innermost running call completes within the stage."""
        if self.whys[-1] is None:
            self.whys[-1] = why

    @property
    def input(self) -> torch.Tensor | None:
        """The stage's input (without ``keep``: while the model holds it)."""
        return self._input_ref() if self._input_ref is not None else None

    def _pre(self, module: nn.Module | None, args: tuple) -> None:
        if self._opaque:
            self._opaque += 1
            self._skipped = True
            return
        recording = self.code is not None and module in self.code
        if self.recording[-1] and not recording:
            self._mode_off()
        self._open(args, recording)
        if self.code is not None and module is not None and not recording:
            self._opaque, self._skipped = 1, False

    def _open(self, values: Any, recording: bool) -> None:
        """A call begins: a level of its own, ``recording`` the torch calls of its code or not."""
        self.starts.append(len(self.calls))
        self.whys.append(None)
        versions = {id(t): t._version for t in _leaves(values) if isinstance(t, torch.Tensor)}
        self.began.append(_Began(versions, values, _mapped(lambda v: v, values)))
        self.recording.append(recording)

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if self._opaque > 1:
            self._opaque -= 1
            return  # a call inside one that completes within the stage: re-run with it
        self._opaque = 0
        if len(self.starts) == 1:
            return  # a call that began before the stage (the block the stage ends in)
        _, began = self._completed()  # what happened inside it is re-run with it
        # as given, unless a pre-hook of the module's own handed it others (a stage's opening boundary
        # passes a leaf through it; the module's library may move keywords into the arguments)
        if len(began.given) == len(args) and all(a is b for a, b in zip(began.given, args)):
            args = began.copied
        if self.recording[-1]:
            self._mode_on()
        try:
            call = self._call(module, args, kwargs, began.versions)
        except NotRerunnable as exc:
            self._fail(f"{exc} (a call of {type(module).__name__})")
            return
        self._append(call, out)

    def _op(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """A torch call of the stage's own code (``_StageCode``), recorded as a call when it
        saves a tensor for the backward (a functional dropout between two layers, BART's), so
        that its re-run saves it again, when it writes in place what a recorded call made, so
        that its re-run reads it written, or when it makes a tensor of what a recorded call
        made (a residual sum after a block), so that its re-run makes it again instead of
        holding it (and rebuilds the stage's output where that is what it makes), or when it
        draws from torch's generators (a LayerDrop draw, ``torch.rand([])``, that older
        transformers' encoder-decoders make before each layer even at a rate of 0), so that
        its re-run draws it again and the calls after it draw what they drew.  Any other
        (a mask made of the input, a size asked) is left to the forward: what it makes is held
        where a call reads it.  One
        that saves but writes in place a tensor made before it, or takes an argument a re-run
        cannot pass again, makes the stage one that cannot be re-run."""
        self._open((args, kwargs), False)
        generators = torch_draws(self.device)
        try:
            out = func(*args, **kwargs)
        finally:
            saved, began = self._completed()
        (args, kwargs), before = began.copied, began.versions
        random = drew(generators, self.device)
        tensors = [t for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        written = [t for t in tensors if t._version != before[id(t)]]
        made_here = [plain(t) and self._source(t) is not None for t in written]
        goes_on = any(isinstance(t, torch.Tensor) for t in _leaves(out)) \
            and any(plain(t) and self._source(t) is not None for t in tensors)
        if saved is None and not any(made_here) and not goes_on and not random:
            return out
        try:
            if not all(made_here):
                raise NotRerunnable("it writes in place a tensor made before it")
            call = self._call(func, args, kwargs, before)
        except NotRerunnable as exc:
            self._fail(f"{exc} ({getattr(func, '__name__', func)})")
            return out
        self._append(call, out)
        for t in written:  # written from a tensor that requires grad, it may require grad now, as its re-run will
            key = storage_key(t)
            self.outputs[key] = [(ref, n, leaf, source.requires_grad if (source := ref()) is not None else grad)
                                 for ref, n, leaf, grad in self.outputs[key]]
        return out

    def _mode_off(self) -> None:
        """A call whose own code is not recorded begins: the mode leaves the stack while it
        runs, so that its torch calls (a block's hundreds) pay nothing for it."""
        n = torch._C._len_torch_function_stack()
        if self._mode is not None and not self._off and n and torch._C._get_function_stack_at(n - 1) is self._mode:
            torch._C._pop_torch_function_stack()
            self._off = True

    def _mode_on(self) -> None:
        if self._off:
            torch._C._push_on_torch_function_stack(self._mode)
            self._off = False

    def _completed(self) -> tuple[str | None, _Began]:
        """The innermost running call has completed: its level closed, what was recorded
        inside it dropped (it is re-run whole).  Returns why the level could not be re-run on
        its own (a tensor it saved outside its calls), and its arguments as it began."""
        start = self.starts.pop()
        why = self.whys.pop()
        began = self.began.pop()
        self.recording.pop()
        if start < len(self.calls):
            del self.calls[start:]
            self.outputs = {k: kept for k, v in self.outputs.items() if (kept := [o for o in v if o[1] < start])}
        # what only the calls inside it read is made again by its re-run (a decoder layer's
        # residual sum, read by its MLP's norm): held, it would double the checkpoint
        self.held = {k: h for k, h in self.held.items() if h.call < start}
        return why, began

    def _call(self, fn: Callable, args: tuple, kwargs: dict, before: dict[int, int]) -> Call:
        reference = functools.partial(self._reference, before=before)
        return Call(fn, _mapped(reference, args), _mapped(reference, kwargs), torch.is_grad_enabled())

    def _append(self, call: Call, out: Any) -> None:
        n = len(self.calls)
        self.calls.append(call)
        for leaf, t in enumerate(_leaves(out)):
            if isinstance(t, torch.Tensor) and plain(t):
                self.outputs.setdefault(storage_key(t), []).append((weakref.ref(t), n, leaf, t.requires_grad))

    def _source(self, t: torch.Tensor) -> FromCall | None:
        """``t`` as an output of an earlier call (itself first, else a view of a live one).
        Not an output that requires grad now and did not as its call returned: the call ran in
        a custom ``autograd.Function``'s forward (under no grad), whose ``apply`` made it the
        function's output, which a re-run of the call would not."""
        found = None
        for ref, call, leaf, requires_grad in reversed(self.outputs.get(storage_key(t), ())):
            source = ref()
            if source is None or source.requires_grad != requires_grad:
                continue
            if source is t:
                return FromCall(call, leaf, None)
            if found is None:
                found = FromCall(call, leaf, _view_of(t, source))
        return found

    def _reference(self, t: Any, before: dict[int, int]) -> Any:
        """``t``, an argument of a call that has returned, as the re-run finds it; ``before``:
        the versions of the call's arguments as it began."""
        if not isinstance(t, torch.Tensor):
            if not isinstance(t, _UNCHANGING):
                raise NotRerunnable(f"a call takes a {type(t).__name__} argument, an object whose state the forward may "
                                    "change before the re-run (a key/value cache: train with use_cache=False)")
            return t
        if not plain(t) or is_weight(t) or among(t, self.excluded):
            return t
        made = self._source(t)
        if made is not None:
            return made
        if self.input_key is not None and self._input_storage() is None:
            self.input_key = None  # the input died: its key may be this tensor's storage's now
        if self.input_key is not None and storage_key(t) == self.input_key:
            return FromInput(_view_of(t, self.input) if t is not self.input else None)
        key = storage_key(t)
        if key not in self.held:
            self.held[key] = _Held(self._detached(t) if self.keep else None, weakref.ref(t),
                                   weakref.ref(t.untyped_storage()), before.get(id(t), t._version),
                                   t.untyped_storage().nbytes(), len(self.calls))
        return self._detached(t)

    def _detached(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the re-run reads it where it is held (``keep``): an alias without its
        autograd history, a leaf that requires grad where ``t`` does, so that the re-run's ops
        save what the stage's did.  Held as it was, it tied the program to the step's graph,
        which holds the step: a cycle through autograd that no collector frees (a U-Net's skip
        features, read by a recomputed up block, kept a forward whose output was dropped alive,
        and the next forward was refused).  One alias per tensor while the program holds it
        (a held tensor, a call's argument), known here only weakly: an alias kept here held its
        storage after the program let go of it (what only calls nested in a completed call read
        is no longer held), until a new tensor happened to take the dead one's ``id``, a moment
        that follows Python's garbage collections (a Whisper layer's recorded forward read
        32 KiB more or less, run to run)."""
        if not self.keep:
            return t
        found = self._aliases.get(id(t))
        alias = found[1]() if found is not None and found[0]() is t else None
        if alias is None:
            alias = t.detach().requires_grad_(t.requires_grad)
            self._aliases[id(t)] = (weakref.ref(t), weakref.ref(alias))
        return alias

    def finish(self, output: torch.Tensor) -> StageProgram:
        """The stage ended with ``output`` (the value crossing its boundary)."""
        self.close()
        why = next((w for w in self.whys if w is not None), None)
        if why is None and self._opaque and self._skipped:
            why = ("it ends inside a call of a module that is none of its boundary's ancestors in the module tree (a "
                   "module called from outside its parent), whose calls it did not record")
        if why is None and self.input is not None and self.input._version != self.input_version:
            why = "it writes its input in place"
        if why is None and written_later([(h.ref, h.version) for h in self.held.values()]):
            why = "a call of it writes in place a tensor made before that call, which its re-run would read written"
        if why is not None:
            raise NotRerunnable(f"stage {self.stage} cannot be re-run: {why}")
        return StageProgram(self.stage, self.calls, self._source(output), self.input_requires_grad,
                            [(h.tensor, h.version) for h in self.held.values() if h.tensor is not None], self.rng,
                            self.autocast)

    def close(self) -> None:
        if self._handles:
            EAGER_WHILE_RECORDING.recorders -= 1
        if self._mode is not None:
            if not self._off:
                _remove_mode(self._mode)
            self._mode = None
        for h in self._handles:
            h.remove()
            # torch marks a global hook registered ``with_kwargs`` in a dict its handle does not
            # clean: an entry per recorded stage per step (a leak, and torch.compile then warns
            # of global hooks that are gone)
            nn.modules.module._global_forward_hooks_with_kwargs.pop(h.id, None)
        self._handles.clear()

    def keys(self) -> set[int]:
        """Storage keys of what the program keeps, the input and the held tensors, whose
        storages live (without ``keep``, a dead one's key may be another storage's by now)."""
        alive = {k for k, h in self.held.items() if h.storage() is not None}
        if self.input_key is not None and self._input_storage() is not None:
            alive.add(self.input_key)
        return alive

    def versions(self) -> list[tuple[weakref.ref, int]]:
        """The input and the held tensors (weakly) with their versions when recorded: what
        ``written_later`` checks once the forward ends."""
        return ([(self._input_ref, self.input_version)] if self._input_ref is not None else []) + [
            (h.ref, h.version) for h in self.held.values()]

    def held_storages(self) -> dict[int, tuple[Any, int]]:
        """The held tensors' storages (while they live: ``None`` after) and bytes, by key (not the input)."""
        return {k: (h.storage(), h.nbytes) for k, h in self.held.items() if k != self.input_key}

    def let_go(self) -> bool:
        """Whether the model's code let go, inside the stage, of what a re-run would hold (its
        input, a held tensor): known where they are held weakly (without ``keep``)."""
        return ((self._input_ref is not None and self._input_ref() is None)
                or any(h.ref() is None for h in self.held.values()))

    def held_bytes(self) -> int:
        """Bytes the program holds besides the stage's input (distinct storages)."""
        return sum(h.nbytes for k, h in self.held.items() if k != self.input_key)

