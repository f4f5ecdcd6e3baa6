"""A model ready to profile or train: the module, one example batch, and its loss.

The batch is what a training loop hands the model each step: positional tensors
(``model(x)``), keyword tensors (``model(input_ids=..., labels=...)``), or both.  The
loss turns the model's output into the scalar to differentiate; models that compute
their own (Hugging Face ``labels=``) give it as ``output.loss`` or ``output["loss"]``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from offload.errors import ModelError


def _describe(output: Any) -> str:
    leaves = tree_flatten(output)[0]
    kinds = sorted({f"{type(t).__name__}({t.dtype})" if isinstance(t, torch.Tensor) else type(t).__name__
                    for t in leaves})
    return f"{type(output).__name__} holding {len(leaves)} value(s): {', '.join(kinds) or 'none'}"


def output_loss(output: Any) -> torch.Tensor:
    """The loss a model computed itself: ``output.loss`` (Hugging Face ``ModelOutput``) or
    ``output["loss"]``; ``ModelError`` naming what the output holds otherwise."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is not None and not (isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.numel() == 1):
        raise ModelError(f"the model's output has a loss that is not a floating-point scalar tensor: "
                         f"{type(loss).__name__} {str(loss)[:60]!r}", "return a scalar loss tensor, or a loss_fn "
                         "from your model function")
    if loss is None:
        raise ModelError(f"the model's output has no loss: {_describe(output)}",
                         "pass labels to the model (Hugging Face), or return a loss_fn from your model function")
    return loss


def default_loss(output: Any) -> torch.Tensor:
    """``output_loss`` when the output carries a loss, else the mean of the squares of its
    floating-point tensors (a stand-in objective: the memory and time of a real one)."""
    given = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if given is not None:  # the model computed a loss: that one, or an error (never something else in silence)
        return output_loss(output)
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ModelError(f"the model's output holds no floating-point tensor to differentiate: {_describe(output)}",
                         "return a loss_fn as the third element of your model function")
    return sum(t.float().square().mean() for t in tensors)


def cache_configs(module: nn.Module) -> dict[str, Any]:
    """The configs of a transformers model that ask for a key/value cache (``use_cache=True``,
    their default), by the name of the first module holding each (``config`` for the model's
    own): in a training step the model then builds one and hands it to every block.  A stack
    may keep a copy of its own (Switch Transformers' decoder reads its copy's ``use_cache``)."""
    found: dict[int, tuple[str, Any]] = {}
    for name, sub in module.named_modules():
        config = getattr(sub, "config", None)
        if getattr(config, "use_cache", None) is True and id(config) not in found:
            found[id(config)] = (f"{name}.config" if name else "config", config)
    return dict(found.values())


def cache_off(module: nn.Module) -> None:
    """Turn a transformers model's key/value cache off, in every config it holds, as
    transformers does under gradient checkpointing."""
    for config in cache_configs(module).values():
        config.use_cache = False


def check_no_layer_drop(module: nn.Module, what: str) -> None:
    """Refuse a transformers model that skips whole layers at random in training (LayerDrop:
    ``layerdrop``, ``encoder_layerdrop``, ... above 0, a Wav2Vec2's default): one step's stages
    are then not the next's, and a schedule is made for one.  A profile might even pass (its
    draws kept every layer) and training fail at random later.

    Raises:
        ModelError: naming the config's rate and how to turn it off."""
    rates = dict(_layer_drops(getattr(module, "config", None), "config"))
    if rates:
        said = ", ".join(f"{k}={v}" for k, v in sorted(rates.items()))
        raise ModelError(f"{what} skips whole layers at random while training (LayerDrop: {said}): one step's "
                         "stages are not the next's, and a schedule is made for one sequence of them",
                         "set " + " and ".join(f"model.{k} = 0" for k in sorted(rates)) + " where the model "
                         "is built, for the profile and for training alike")


def _layer_drops(config: Any, path: str) -> Iterator[tuple[str, float]]:
    """``(path, rate)`` of each LayerDrop rate above 0 in ``config`` and the configs it holds
    (an encoder-decoder's ``config.encoder``)."""
    if config is None or not hasattr(config, "__dict__"):
        return
    for k, v in vars(config).items():
        if k.endswith("layerdrop") and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            yield f"{path}.{k}", v
        elif type(v).__name__.endswith("Config"):
            yield from _layer_drops(v, f"{path}.{k}")


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a nested value (a batch, an output)."""
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


@dataclass
class ModelSpec:
    """A module, one example batch (``args``, ``kwargs``) and the loss of its output."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss: Callable[[Any], torch.Tensor]
    description: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    autocast: str | None = None  # "bfloat16" | "float16": forward and loss run under torch.autocast
    set_to_none: bool = False  # the loop frees gradients between steps (zero_grad(set_to_none=True))

    def zero_grads(self, params: list[torch.Tensor]) -> None:
        """Between steps: the gradients freed, or zeroed in place (then they stay allocated)."""
        for p in params:
            if self.set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def autocasting(self) -> contextlib.AbstractContextManager:
        """The autocast the step's forward and loss run under (none unless ``autocast``)."""
        if self.autocast is None:
            return contextlib.nullcontext()
        device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
        return torch.autocast(device.type, dtype=getattr(torch, self.autocast))

    def tensors(self) -> list[torch.Tensor]:
        """The batch's tensors."""
        return tensors_in((self.args, self.kwargs))

    def batch(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A fresh copy of the batch, as a training loop hands the model a new one each step."""
        fresh = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, (self.args, self.kwargs))
        return fresh[0], fresh[1]

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move the module and the batch to ``device``; floating parameters and inputs to ``dtype``."""
        self.module.to(device=device, dtype=dtype)
        self.module.train()

        def move(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            return v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
        self.args, self.kwargs = tree_map(move, (self.args, self.kwargs))


PLAIN = (bool, int, float, str, type(None))  # values a batch may hand the forward beside its tensors


def signature(args: tuple, kwargs: dict) -> tuple[str, ...]:
    """``name:dtype[shape]`` of each tensor of a batch and ``name=value`` of each plain value
    (``return_loss=True``; positional ones named by position): what a chain's recipe records,
    and what every step's batch is checked against (such a value changes what the step runs)."""
    named = [(str(n), v) for n, v in enumerate(args)] + sorted(kwargs.items())
    return tuple(f"{name}:{str(v.dtype).removeprefix('torch.')}[{','.join(map(str, v.shape))}]"
                 if isinstance(v, torch.Tensor) else f"{name}={v!r}"
                 for name, v in named if isinstance(v, (torch.Tensor, *PLAIN)))
