"""Devices, dtypes, optimizers and what lives across steps: the conventions the profiler and
the executor must share so that a chain describes the training step that runs.

* ``pick_device``: ``cuda`` when available; a CUDA device is made the current one (events,
  streams and the caching allocator default to the current device).
* ``OPTIMIZERS``: the optimizers a chain can be profiled with; their state is constant
  memory (``base_bytes``).
* ``persistent_tensors``: weights, buffers, gradients, optimizer state and plain tensor
  attributes of the modules: the constant ``base_bytes``, never part of a unit.
* ``running``: the user's model failing becomes one ``ModelError`` with a hint.
* ``deterministic_kernels``: CUDA's deterministic algorithms, for the gradient check (the
  profiler reads the memory of a step under them too: their workspaces differ).
* ``available_host_bytes``: host memory this process may still take (its container's too).
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from offload.errors import ModelError, OffloadError, first_line
from offload.step import names

DTYPES = {name: getattr(torch, name) for name in names.DTYPES}

OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer] | None] = names.table(
    names.OPTIMIZERS, {
        "adam": lambda p, lr: torch.optim.Adam(p, lr=lr),
        "adamw": lambda p, lr: torch.optim.AdamW(p, lr=lr),
        "sgd": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
        "none": None,
    }, "optimizers")


CUDA_BLOCK = 512  # PyTorch's CUDA caching allocator rounds every allocation up to a multiple of this


def allocated_bytes(nbytes: int, device: torch.device) -> int:
    """What a storage of ``nbytes`` takes from ``device``'s allocator (its counters count that)."""
    return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK if device.type == "cuda" else nbytes


def make_optimizer(name: str, params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer | None:
    """The optimizer ``name`` over ``params`` (``None`` for ``none`` or no trainable parameter)."""
    if name not in OPTIMIZERS:
        raise ModelError(f"unknown optimizer {name!r}", f"use one of {', '.join(OPTIMIZERS)}")
    make = OPTIMIZERS[name]
    return make(params, lr) if make is not None and params else None


def pick_device(name: str | None) -> torch.device:
    """``name`` (``cpu``, ``cuda``, ``cuda:1``) checked, or CUDA when available; CUDA becomes current."""
    if name is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(name)
        except RuntimeError as exc:
            raise ModelError(f"unknown device {name!r}: {exc}", "use cpu or cuda (cuda:1 for a second GPU)") from None
    if device.type not in ("cpu", "cuda"):
        raise ModelError(f"device type {device.type!r} is not supported", "use cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelError("--device cuda, but this PyTorch sees no CUDA GPU",
                             f"use --device cpu (torch {torch.__version__}, CUDA build: {torch.version.cuda is not None})")
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


_MODULE_STATE = frozenset(vars(nn.Module()))  # every module's own attributes (``_compiled_call_impl``: None)


class ModuleTensors:
    """The parameters, buffers and plain tensor attributes of a module tree, read again at every
    step from the modules and attribute names found when it was made (``scan``): a step walks
    lists, not ``named_modules``' recursion and every module's ``__dict__`` (0.5 ms on a
    ResNet-50).  An attribute that holds ``None`` is one too: a cache that the module's first
    call fills (Wav2Vec2-Conformer's rotary table, made once and read by every layer)."""

    def __init__(self, module: nn.Module) -> None:
        self.modules = list(module.modules())
        self.scan()

    def scan(self) -> None:
        """Find the attributes again (after a first call, which may have set new ones)."""
        self.attributes = [(sub, name) for sub in self.modules for name, v in vars(sub).items()
                           if isinstance(v, torch.Tensor) or (v is None and name not in _MODULE_STATE)]

    def now(self) -> list[torch.Tensor]:
        """The tensors as they are now (a parameter replaced since is the new one)."""
        out = [t for sub in self.modules for held in (sub._parameters, sub._buffers) for t in held.values()
               if t is not None]
        return out + self.held()

    def held(self) -> list[torch.Tensor]:
        """The tensors the attributes hold now."""
        return [v for sub, name in self.attributes if isinstance(v := getattr(sub, name, None), torch.Tensor)]


def persistent_tensors(module: nn.Module, optimizer: torch.optim.Optimizer | None,
                       device: torch.device) -> list[torch.Tensor]:
    """Every tensor that lives across steps on ``device``: weights, buffers, gradients, optimizer
    state and plain tensor attributes (the constant ``base_bytes``, never part of a unit)."""
    out = ModuleTensors(module).now()
    out += [p.grad for p in module.parameters() if p.grad is not None]
    if optimizer is not None:
        out += [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return [t for t in out if t.device.type == device.type]


@contextlib.contextmanager
def running(what: str, hint: str = "check that the model runs forward and backward on this input; run it by "
                                   "hand for the traceback") -> Iterator[None]:
    """Turn a failure of the user's model into one clear ``ModelError``."""
    try:
        yield
    except OffloadError:
        raise
    except torch.cuda.OutOfMemoryError as exc:
        raise ModelError(f"{what}: out of GPU memory ({first_line(exc)})",
                         "the step must fit once without offloading to be profiled: use a smaller --batch (times "
                         "and bytes scale about linearly with it) or --dtype bfloat16") from None
    except Exception as exc:
        raise ModelError(f"{what} failed: {type(exc).__name__}: {first_line(exc, 300)}", hint) from exc


CGROUP = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current")  # cgroup v2: limit, usage


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def available_host_bytes() -> int | None:
    """Host memory available without swapping: the kernel's ``MemAvailable``, or less when this
    process's cgroup (a container's limit) leaves less."""
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    limit, usage = (_read_int(p) for p in CGROUP)
    if limit is not None and usage is not None:
        available = min(available, limit - usage) if available is not None else limit - usage
    return available


@contextlib.contextmanager
def deterministic_kernels(device: torch.device) -> Iterator[bool]:
    """On CUDA, deterministic kernels for this block (cuDNN's, cuBLAS's with a fixed workspace,
    torch's deterministic algorithms, warning where an op has none), so that two runs of one
    step give the same bits; the settings are put back after.  Yields whether it changed
    anything (the CPU's kernels are deterministic already).  ``CUBLAS_WORKSPACE_CONFIG`` takes
    effect where cuBLAS starts after it: at the start of ``offload train``."""
    if device.type != "cuda":
        yield False
        return
    cudnn = torch.backends.cudnn
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             cudnn.deterministic, cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    cudnn.deterministic, cudnn.benchmark = True, False
    try:
        yield True
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        cudnn.deterministic, cudnn.benchmark = saved[2], saved[3]
        if saved[4] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
