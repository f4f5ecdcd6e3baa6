"""Hugging Face transformers models as users write them: built from small configs, random
weights (nothing is downloaded), dropout on as the library ships it, keyword inputs, and
the loss the model computes itself (``output.loss``, from ``labels=``).

They are the models nobody on this project wrote: a decoder (GPT-2), a Llama-style
decoder (rotary embeddings, grouped-query attention, the causal mask built inside
``forward``), an encoder with a padding mask (BERT), and two vision models (ViT, and
ConvNeXt for a timm-style CNN: timm itself needs torchvision, whose wheel here links a CUDA
build of torch).  ``use_cache=False``: a training step keeps no key/value cache (a cache's
state changes as the forward runs, so a block that takes it cannot be recomputed).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from offload.errors import ModelError

from .spec import ModelSpec, output_loss


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelError("the transformers package is not installed", "pip install 'transformers>=5,<6'") from None
    transformers.logging.set_verbosity_error()  # config warnings about special token ids of a toy vocabulary
    return transformers


def _tokens(batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


def _frozen(model: torch.nn.Module, blocks: torch.nn.ModuleList, count: int, embeddings: torch.nn.Module) -> torch.nn.Module:
    """Freeze the embeddings and the first ``count`` blocks (fine-tuning the top of a model)."""
    if count:
        for part in [embeddings, *blocks[:count]]:
            part.requires_grad_(False)
    return model


def gpt2(batch: int, layers: int = 4, width: int = 256, heads: int = 4, seq: int = 128, vocab: int = 1000,
         frozen: int = 0) -> ModelSpec:
    """GPT-2 (transformers GPT2LMHeadModel). Options: layers=4, width=256, heads=4, seq=128, vocab=1000, frozen=0
    (embeddings and that many first blocks frozen)."""
    tf = _transformers()
    config = tf.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=seq, vocab_size=vocab,
                           use_cache=False, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    ids = _tokens(batch, seq, vocab)
    model = tf.GPT2LMHeadModel(config)
    _frozen(model, model.transformer.h, frozen, model.transformer.wte)
    model.transformer.wpe.requires_grad_(not frozen)
    return ModelSpec(model, (), {"input_ids": ids, "labels": ids.clone()}, output_loss,
                     f"transformers GPT-2, {layers} layers, width {width}, sequence {seq}")


def llama(batch: int, layers: int = 4, width: int = 256, heads: int = 8, kv_heads: int = 2, seq: int = 128,
          vocab: int = 1000, frozen: int = 0, dropout: float = 0.1, cache: bool = False) -> ModelSpec:
    """Llama-style decoder (transformers LlamaForCausalLM: RoPE, GQA). Options: layers=4, width=256, heads=8,
    kv_heads=2, seq=128, vocab=1000, frozen=0, dropout=0.1 (attention dropout; 0 takes SDPA's fused kernel),
    cache=False (True: the key/value cache transformers configs default to, which keeps the blocks from being
    recomputed)."""
    tf = _transformers()
    config = tf.LlamaConfig(hidden_size=width, intermediate_size=int(width * 8 / 3) // 8 * 8, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                            max_position_embeddings=seq, use_cache=cache, attention_dropout=dropout,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0)
    ids = _tokens(batch, seq, vocab)
    model = tf.LlamaForCausalLM(config)
    _frozen(model, model.model.layers, frozen, model.model.embed_tokens)
    return ModelSpec(model, (), {"input_ids": ids, "labels": ids.clone()}, output_loss,
                     f"transformers Llama-style decoder, {layers} layers, width {width}, {heads}/{kv_heads} heads, "
                     f"sequence {seq}")


def bert(batch: int, layers: int = 4, width: int = 256, heads: int = 4, seq: int = 128, vocab: int = 1000,
         classes: int = 2, frozen: int = 0) -> ModelSpec:
    """BERT classifier (transformers BertForSequenceClassification, padded batch). Options: layers=4, width=256,
    heads=4, seq=128, vocab=1000, classes=2, frozen=0."""
    tf = _transformers()
    config = tf.BertConfig(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                           intermediate_size=4 * width, vocab_size=vocab, max_position_embeddings=seq,
                           num_labels=classes, use_cache=False, pad_token_id=0)
    ids = _tokens(batch, seq, vocab)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[:, seq - seq // 4:] = 0  # the last quarter is padding
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, classes, (batch,))}
    model = tf.BertForSequenceClassification(config)
    _frozen(model, model.bert.encoder.layer, frozen, model.bert.embeddings)
    return ModelSpec(model, (), kwargs, output_loss,
                     f"transformers BERT classifier, {layers} layers, width {width}, sequence {seq}")


def vit(batch: int, layers: int = 4, width: int = 192, heads: int = 3, image: int = 64, patch: int = 8,
        classes: int = 10, frozen: int = 0) -> ModelSpec:
    """Vision transformer (transformers ViTForImageClassification). Options: layers=4, width=192, heads=3,
    image=64, patch=8, classes=10, frozen=0."""
    tf = _transformers()
    config = tf.ViTConfig(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                          intermediate_size=4 * width, image_size=image, patch_size=patch, num_labels=classes)
    kwargs = {"pixel_values": torch.randn(batch, 3, image, image), "labels": torch.randint(0, classes, (batch,))}
    model = tf.ViTForImageClassification(config)
    _frozen(model, model.vit.layers, frozen, model.vit.embeddings)
    return ModelSpec(model, (), kwargs, output_loss,
                     f"transformers ViT, {layers} layers, width {width}, {image}x{image} images")


def convnext(batch: int, depths: str = "1-1-2-1", width: int = 32, image: int = 64, classes: int = 10) -> ModelSpec:
    """ConvNeXt (transformers ConvNextForImageClassification; timm-style CNN). Options: depths=1-1-2-1, width=32,
    image=64, classes=10."""
    tf = _transformers()
    stages = [int(d) for d in str(depths).split("-")]
    config = tf.ConvNextConfig(depths=stages, hidden_sizes=[width * 2 ** i for i in range(len(stages))],
                               num_stages=len(stages), image_size=image, num_labels=classes)
    kwargs = {"pixel_values": torch.randn(batch, 3, image, image), "labels": torch.randint(0, classes, (batch,))}
    return ModelSpec(tf.ConvNextForImageClassification(config), (), kwargs, output_loss,
                     f"transformers ConvNeXt, depths {depths}, width {width}, {image}x{image} images")


HF_ZOO: dict[str, Callable[..., ModelSpec]] = {"gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit,
                                               "convnext": convnext}
