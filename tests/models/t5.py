"""A transformers T5 (encoder-decoder) of ``layers`` encoder and ``layers`` decoder blocks,
random weights, labels given (the model computes its loss): every decoder block reads the
encoder's output, and every block of a stack returns the attention bias beside its hidden
state, so several values cross each block boundary."""
from __future__ import annotations

import torch
from transformers import T5Config, T5ForConditionalGeneration


def build(batch: int, layers: int = 2, seq: int = 32, width: int = 64, dropout: float = 0.0):
    config = T5Config(vocab_size=128, d_model=width, d_kv=16, d_ff=2 * width, num_layers=layers,
                      num_decoder_layers=layers, num_heads=4, dropout_rate=dropout, use_cache=False,
                      decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    ids = torch.randint(1, 128, (batch, seq))
    return model, {"input_ids": ids, "labels": torch.randint(1, 128, (batch, seq))}
