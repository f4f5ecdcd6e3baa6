"""A transformers Switch Transformer (an encoder-decoder whose every other layer is a mixture of
experts routing each token to one) as the library writes it: its decoder stack keeps a copy
of the config of its own, whose ``use_cache`` it reads.  Routing without noise, dropout off
and a capacity no batch reaches keep what each stage saves fixed from step to step."""
from __future__ import annotations

import torch
from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration


def build(batch: int, seq: int = 16, layers: int = 2):
    config = SwitchTransformersConfig(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=layers,
                                      num_decoder_layers=layers, num_heads=4, num_experts=4, encoder_sparse_step=2,
                                      decoder_sparse_step=2, router_jitter_noise=0.0, dropout_rate=0.0,
                                      expert_capacity=batch * seq, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    ids = torch.randint(1, 128, (batch, seq))
    return SwitchTransformersForConditionalGeneration(config), {"input_ids": ids, "labels": ids.clone()}
