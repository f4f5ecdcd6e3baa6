"""A transformers Mixtral of two layers (four experts, two per token): a mixture of experts
whose router sends each token where its weights say.  ``token``: every position of the
batch is that token (the router then sends them all to the same two experts); -1: random
tokens."""
from __future__ import annotations

import torch
from transformers import MixtralConfig, MixtralForCausalLM


def build(batch: int, layers: int = 2, seq: int = 32, token: int = -1):
    config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           use_cache=False)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    ids = torch.full((batch, seq), token) if token >= 0 else torch.randint(0, 128, (batch, seq))
    return model, {"input_ids": ids, "labels": ids.clone()}
