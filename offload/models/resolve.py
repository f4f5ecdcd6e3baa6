"""Turn a ``MODEL`` string into a model to profile or train.

``MODEL`` is one of:

* a zoo name (``resnet50``, ``gpt``, … and the transformers models ``gpt2``, ``llama``,
  ``bert``, ``vit``, ``convnext``; ``offload profile --list-models``);
* ``torchvision:NAME`` (``torchvision.models.get_model(NAME)``, random weights), when
  torchvision is installed;
* ``path/to/file.py:fn`` or ``package.module:fn``, where ``fn(batch_size, **options)``
  returns ``(module, example_input)`` or ``(module, example_input, loss_fn)``.  The example
  input is a tensor, a tuple of tensors (positional arguments) or a dict of tensors
  (keyword arguments, ``input_ids=…, labels=…``), plain values (``PLAIN``) beside them;
  ``loss_fn(output)`` gives the scalar to differentiate, by default ``output.loss`` /
  ``output["loss"]`` when the model computes one, else the mean of the squared floating
  outputs.

Every way this can go wrong ends in one ``ModelError`` that says what and what to do.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from offload.core.devices import available_host_bytes
from offload.errors import FormatError, ModelError
from offload.io.files import regular_file

from .hf import HF_ZOO
from .spec import PLAIN, ModelSpec, default_loss, tensors_in
from .zoo import ZOO, image_batch

ALL_ZOO: dict[str, Callable[..., ModelSpec]] = {**ZOO, **HF_ZOO}


def _parse_value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_options(pairs: list[str] | None) -> dict[str, Any]:
    """``["layers=4", "seq=256", "cache=true"]`` -> ``{"layers": 4, "seq": 256, "cache": True}``."""
    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ModelError(f"cannot read model option {pair!r}", "write options as KEY=VALUE, e.g. -O layers=4")
        options[key.strip()] = _parse_value(value.strip())
    return options


# What the zoo's options mean, as ranges: a value outside is refused before anything is built
# (``layers=-1`` built a chain "with -1 layers"; ``seq=1000000000`` allocated 11.5 GB first).
OPTION_RANGES: dict[str, tuple[float, float]] = {
    "layers": (1, 1024), "width": (1, 1 << 16), "heads": (1, 1024), "kv_heads": (1, 1024), "seq": (1, 1 << 20),
    "vocab": (2, 1 << 22), "image": (8, 1 << 13), "classes": (1, 1 << 20), "features": (1, 1 << 20),
    "patch": (1, 1024), "frozen": (0, 1024), "dropout": (0.0, 1.0),
}


def _check_options(fn: Callable[..., Any], what: str, options: dict[str, Any]) -> None:
    """Each zoo option of the type of its default and within its meaning's range."""
    defaults = {p.name: p.default for p in inspect.signature(fn).parameters.values()}
    for key, value in options.items():
        default = defaults.get(key, inspect.Parameter.empty)
        if default is inspect.Parameter.empty:
            continue  # the signature check names it
        kind = type(default)
        if kind is bool:
            ok = isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        low, high = OPTION_RANGES.get(key, (None, None))
        if not ok or (low is not None and not low <= value <= high):
            wanted = {bool: "true or false", int: "a whole number", float: "a number"}.get(kind, kind.__name__)
            span = f" from {low} to {high}" if low is not None else ""
            raise ModelError(f"{what}: option {key}={value!r}: give {wanted}{span}",
                             "see `offload profile --list-models` for each zoo model's options")


def _check_memory(fn: Callable[..., Any], what: str, batch: int, options: dict[str, Any]) -> None:
    """Build a zoo model on the ``meta`` device (no memory) and refuse it when its weights and
    example batch alone do not fit in this host's available memory."""
    try:
        with torch.device("meta"):
            spec = fn(batch, **options)
    except Exception:  # not every model builds on meta: then nothing is known before building it
        return
    tensors = [*spec.module.parameters(), *spec.module.buffers(), *tensors_in((spec.args, spec.kwargs))]
    need = sum(t.numel() * t.element_size() for t in tensors)
    available = available_host_bytes()
    if available is not None and need > available:
        raise ModelError(f"{what} with these options holds {need / 2**30:.1f} GiB of weights and batch before any "
                         f"activation; this host has {available / 2**30:.1f} GiB available",
                         "use smaller options (layers, width, seq, image, vocab) or a smaller batch")


def _bind(fn: Callable[..., Any], what: str, batch: int, options: dict[str, Any]) -> None:
    """Refuse options ``fn`` does not take."""
    try:
        inspect.signature(fn).bind(batch, **options)
    except TypeError as exc:
        raise ModelError(f"{what} does not accept these arguments: {exc}",
                         "see `offload profile --list-models` for each zoo model's options" if what.startswith("zoo")
                         else "its function's signature is fn(batch_size, **options): check the -O options") from None
    except ValueError:
        pass  # builtins without a signature: just call them


def _call_builder(fn: Callable[..., Any], what: str, batch: int, options: dict[str, Any]) -> Any:
    _bind(fn, what, batch, options)
    try:
        return fn(batch, **options)
    except ModelError:
        raise
    except (Exception, SystemExit) as exc:
        raise ModelError(f"building {what} failed: {type(exc).__name__}: {exc}",
                         "fix the model function or its options; run it by hand to see the traceback") from exc


def _from_user(result: Any, what: str) -> ModelSpec:
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise ModelError(f"{what} returned {type(result).__name__}, expected (module, example_input[, loss_fn])",
                         "return a tuple: the nn.Module and an example input (a tensor, a tuple of tensors, or a "
                         "dict of keyword tensors)")
    module, example = result[0], result[1]
    loss = result[2] if len(result) == 3 else default_loss
    if not isinstance(module, nn.Module):
        raise ModelError(f"{what} returned a {type(module).__name__} where an nn.Module was expected")
    if isinstance(example, Mapping):
        args, kwargs = (), dict(example)
    else:
        args, kwargs = (tuple(example) if isinstance(example, (tuple, list)) else (example,)), {}
    values = list(args) + list(kwargs.values())
    if not any(isinstance(v, torch.Tensor) for v in values) or not all(
            isinstance(v, (torch.Tensor, *PLAIN)) for v in values):
        found = ", ".join(sorted({type(v).__name__ for v in values})) or "nothing"
        raise ModelError(f"{what}: the example input must be a tensor, a tuple of tensors or a dict of tensors, "
                         f"with plain values ({', '.join(t.__name__ for t in PLAIN)}) beside them as options; "
                         f"found {found}",
                         "return the batch's tensors as the model's forward takes them (a model's own config "
                         "belongs in the module)")
    if not callable(loss):
        raise ModelError(f"{what}: the third element (loss_fn) must be callable")
    return ModelSpec(module, args, kwargs, loss, what)


def file_reference(model: str) -> tuple[Path, str] | None:
    """``(path, function)`` of a ``path/to/file.py:fn`` reference (the path as written, relative
    to the working directory), ``None`` for the other kinds of ``MODEL``."""
    target, _, fname = model.rpartition(":")
    if model in ALL_ZOO or model.startswith("torchvision:") or not target:
        return None
    return (Path(target), fname) if target.endswith(".py") or "/" in target or "\\" in target else None


def file_sha256(path: Path) -> str:
    """The hash of a model file's bytes: the same model, wherever the file is (``offload train``
    takes a copy of the file the chain was profiled from)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load_function(ref: str) -> Callable[..., Any]:
    target, _, fname = ref.rpartition(":")
    if file_reference(ref) is not None:
        try:
            path = regular_file(target, "model")
        except FormatError as exc:
            raise ModelError(str(exc), "give path/to/file.py:function") from None
        name = f"offload_user_model_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ModelError(f"cannot import {path} as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:
            raise ModelError(f"importing {path} failed: {type(exc).__name__}: {exc}",
                             "run `python FILE` to see the traceback") from exc
    else:
        try:
            module = importlib.import_module(target)
        except (Exception, SystemExit) as exc:
            here = Path(*target.split(".")).with_suffix(".py")
            raise ModelError(f"cannot import module {target!r}: {type(exc).__name__}: {exc}",
                             f"{here} is a file here: give {here}:{fname} (a module name is imported from "
                             "the installed packages, not the working directory)" if here.is_file() else
                             "check that the package is installed in this environment, or give "
                             "path/to/file.py:function") from exc
    fn = getattr(module, fname, None)
    if not callable(fn):
        raise ModelError(f"{ref}: no function {fname!r} in {target}",
                         "name a function fn(batch_size) returning (module, input)")
    return fn


def _torchvision(name: str, batch: int, options: dict[str, Any]) -> ModelSpec:
    try:
        from torchvision.models import get_model  # optional dependency
    except (ImportError, RuntimeError) as exc:
        raise ModelError(f"torchvision cannot be imported ({type(exc).__name__})",
                         "pip install a torchvision that matches your torch, or use a zoo model "
                         f"({', '.join(ALL_ZOO)})") from None
    # (the options as given stay the recipe's: a trainer rebuilds the model from them)
    image, classes = int(options.get("image", 224)), int(options.get("classes", 1000))
    rest = {k: v for k, v in options.items() if k not in ("image", "classes")}
    try:
        module = get_model(name, weights=None, num_classes=classes, **rest)
    except Exception as exc:
        raise ModelError(f"torchvision cannot build {name!r}: {exc}", "see torchvision.models.list_models()") from exc
    inputs, loss = image_batch(batch, image, classes)
    return ModelSpec(module, inputs, {}, loss, f"torchvision {name}, {image}x{image} images")


def resolve(model: str, batch: int, options: dict[str, Any] | None = None, seed: int = 0) -> ModelSpec:
    """Build the model named by ``model`` for ``batch`` samples (random weights and inputs from ``seed``)."""
    if batch < 1:
        raise ModelError(f"--batch must be at least 1, got {batch}")
    options = dict(options or {})
    torch.manual_seed(seed)
    if model in ALL_ZOO:
        fn, what = ALL_ZOO[model], f"zoo model {model!r}"
        _bind(fn, what, batch, options)
        _check_options(fn, what, options)
        _check_memory(fn, what, batch, options)
        torch.manual_seed(seed)
        spec = _call_builder(fn, what, batch, options)
    elif model.startswith("torchvision:"):
        spec = _torchvision(model.split(":", 1)[1], batch, options)
    elif ":" in model:
        fn = _load_function(model)
        spec = _from_user(_call_builder(fn, model, batch, options), model)
    else:
        raise ModelError(f"unknown model {model!r}",
                         f"use a zoo model ({', '.join(ALL_ZOO)}), torchvision:NAME, path/file.py:fn or "
                         "package.module:fn")
    spec.options = options
    return spec


def zoo_help() -> str:
    """One line per zoo model with its options (for ``--list-models``)."""
    return "\n".join(f"{name:<12} {' '.join((fn.__doc__ or '').split())}" for name, fn in ALL_ZOO.items())
