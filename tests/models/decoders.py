"""Decoders from transformers that the zoo does not build, each as its library writes it
(random weights, labels given, the loss from ``output.loss``, no key/value cache):

* ``qwen3``: Qwen3 (RoPE, GQA, a norm on each head's queries and keys), SDPA, attention dropout;
* ``neox``: GPT-NeoX (parallel attention and MLP residuals, partial rotary), SDPA, attention
  and hidden dropout;
* ``gemma2``: Gemma 2 (sliding-window and global layers in turn, logit soft-capping, four
  norms a layer), eager attention (soft-capping), attention dropout;
* ``mamba``: Mamba (a selective state-space scan instead of attention; on a CPU without
  ``mamba_ssm`` transformers runs its reference scan, a Python loop of small ops over the
  sequence: many small saved tensors a layer).

``dropout`` (0.1) is each architecture's attention (and NeoX's hidden) dropout; at 0 SDPA
saves its query, key and value, which NeoX makes as views of one fused projection.
``checkpointing=1``: every layer under transformers' own activation checkpointing, as its
users turn it on (``activation_checkpointing_enable()``, non-reentrant).
"""
from __future__ import annotations

import torch
import transformers as tf

ARCHS = ("qwen3", "neox", "gemma2", "mamba")


def _config(arch: str, layers: int, width: int, vocab: int, dropout: float):
    common = {"vocab_size": vocab, "hidden_size": width, "num_hidden_layers": layers, "use_cache": False}
    if arch == "qwen3":
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(
            **common, intermediate_size=4 * width, num_attention_heads=8, num_key_value_heads=2,
            head_dim=width // 8, attention_dropout=dropout, attn_implementation="sdpa")
    if arch == "neox":
        return tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(
            **common, intermediate_size=4 * width, num_attention_heads=8, attention_dropout=dropout,
            hidden_dropout=dropout, attn_implementation="sdpa")
    if arch == "gemma2":
        return tf.Gemma2ForCausalLM, tf.Gemma2Config(
            **common, intermediate_size=4 * width, num_attention_heads=8, num_key_value_heads=2, head_dim=width // 8,
            sliding_window=32, attention_dropout=dropout, attn_implementation="eager")
    if arch == "mamba":
        return tf.MambaForCausalLM, tf.MambaConfig(**common, state_size=16)
    raise ValueError(f"arch {arch!r}: choose one of {', '.join(ARCHS)}")


def build(batch: int, arch: str = "qwen3", layers: int = 4, width: int = 128, seq: int = 64, vocab: int = 512,
          dropout: float = 0.1, checkpointing: int = 0):
    cls, config = _config(arch, layers, width, vocab, dropout)
    torch.manual_seed(0)
    model = cls(config)
    if checkpointing:  # transformers 5.17 (the GPU machines') names it gradient_checkpointing_enable
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable()
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, vocab, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}
