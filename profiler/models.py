"""Turn a ``MODEL`` string into a model to profile or train.

``MODEL`` is one of:

* a zoo name (``resnet50``, ``gpt``, … ; ``offload profile --list-models``);
* ``torchvision:NAME`` (``torchvision.models.get_model(NAME)``, random weights), when
  torchvision is installed;
* ``path/to/file.py:fn`` or ``package.module:fn``, where ``fn(batch_size, **options)``
  returns ``(module, example_input)`` or ``(module, example_input, loss_fn)``.  The example
  input is a tensor or a tuple of tensors; ``loss_fn(output)`` gives the scalar to
  differentiate (default: the mean of the squared outputs).

Every way this can go wrong ends in one ``ModelError`` that says what and what to do.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from solver.errors import OffloadError

from .zoo import ZOO, ModelSpec, image_batch


class ModelError(OffloadError):
    """The MODEL string is unknown, or building/running the model failed."""

    exit_code = 2


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_options(pairs: list[str] | None) -> dict[str, Any]:
    """``["layers=4", "seq=256"]`` → ``{"layers": 4, "seq": 256}``."""
    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ModelError(f"cannot read model option {pair!r}", "write options as KEY=VALUE, e.g. -O layers=4")
        options[key.strip()] = _parse_value(value.strip())
    return options


def _default_loss(output: Any) -> torch.Tensor:
    tensors = [t for t in (output if isinstance(output, (tuple, list)) else [output])
               if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ModelError("the model's output holds no floating-point tensor to differentiate",
                         "return a loss_fn as the third element of your model function")
    return sum(t.float().square().mean() for t in tensors)


def _call_builder(fn: Callable[..., Any], what: str, batch: int, options: dict[str, Any]) -> Any:
    try:
        sig = inspect.signature(fn)
        sig.bind(batch, **options)
    except TypeError as exc:
        raise ModelError(f"{what} does not accept these arguments: {exc}",
                         "see `offload profile --list-models` for each zoo model's options") from None
    except ValueError:
        pass  # builtins without a signature: just call them
    try:
        return fn(batch, **options)
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"building {what} failed: {type(exc).__name__}: {exc}",
                         "fix the model function or its options; run it by hand to see the traceback") from exc


def _from_user(result: Any, what: str) -> ModelSpec:
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise ModelError(f"{what} returned {type(result).__name__}, expected (module, example_input[, loss_fn])",
                         "return a tuple: the nn.Module and an example input tensor (or tuple of tensors)")
    module, example = result[0], result[1]
    loss = result[2] if len(result) == 3 else _default_loss
    if not isinstance(module, nn.Module):
        raise ModelError(f"{what} returned a {type(module).__name__} where an nn.Module was expected")
    inputs = example if isinstance(example, (tuple, list)) else (example,)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise ModelError(f"{what}: the example input must be a tensor or a tuple of tensors")
    if not callable(loss):
        raise ModelError(f"{what}: the third element (loss_fn) must be callable")
    return ModelSpec(module, tuple(inputs), loss, what)


def _load_function(ref: str) -> Callable[..., Any]:
    target, _, fname = ref.rpartition(":")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target)
        if not path.is_file():
            raise ModelError(f"model file not found: {path}", "give path/to/file.py:function")
        name = f"offload_user_model_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ModelError(f"cannot import {path} as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise ModelError(f"importing {path} failed: {type(exc).__name__}: {exc}",
                             "run `python FILE` to see the traceback") from exc
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:
            raise ModelError(f"cannot import module {target!r}: {type(exc).__name__}: {exc}",
                             "check that the package is installed in this environment, or give path/to/file.py:function") from exc
    fn = getattr(module, fname, None)
    if not callable(fn):
        raise ModelError(f"{ref}: no function {fname!r} in {target}", "name a function fn(batch_size) returning (module, input)")
    return fn


def _torchvision(name: str, batch: int, options: dict[str, Any]) -> ModelSpec:
    try:
        import torchvision  # noqa: F401  (optional dependency)
        from torchvision.models import get_model
    except ImportError:
        raise ModelError("torchvision is not installed", "pip install torchvision, or use a zoo model "
                         f"({', '.join(ZOO)})") from None
    image, classes = int(options.pop("image", 224)), int(options.pop("classes", 1000))
    try:
        module = get_model(name, weights=None, num_classes=classes, **options)
    except Exception as exc:
        raise ModelError(f"torchvision cannot build {name!r}: {exc}", "see torchvision.models.list_models()") from exc
    inputs, loss = image_batch(batch, image, classes)
    return ModelSpec(module, inputs, loss, f"torchvision {name}, {image}x{image} images")


def resolve(model: str, batch: int, options: dict[str, Any] | None = None, seed: int = 0) -> ModelSpec:
    """Build the model named by ``model`` for ``batch`` samples (random weights from ``seed``)."""
    if batch < 1:
        raise ModelError(f"--batch must be at least 1, got {batch}")
    options = dict(options or {})
    torch.manual_seed(seed)
    if model in ZOO:
        spec = _call_builder(ZOO[model], f"zoo model {model!r}", batch, options)
    elif model.startswith("torchvision:"):
        spec = _torchvision(model.split(":", 1)[1], batch, options)
    elif ":" in model:
        fn = _load_function(model)
        spec = _from_user(_call_builder(fn, model, batch, options), model)
    else:
        raise ModelError(f"unknown model {model!r}",
                         f"use a zoo model ({', '.join(ZOO)}), torchvision:NAME, path/file.py:fn or package.module:fn")
    spec.options = options
    return spec


def zoo_help() -> str:
    """One line per zoo model with its options (for ``--list-models``)."""
    return "\n".join(f"{name:<12} {(fn.__doc__ or '').strip().splitlines()[0]}" for name, fn in ZOO.items())
