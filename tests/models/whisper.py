"""A transformers Whisper (speech encoder-decoder) of ``layers`` encoder and ``layers``
decoder blocks, random weights, labels given (the model computes its loss): a convolutional
front end before the encoder's blocks, sinusoidal positions added outside any module call,
and every decoder block reads the encoder's output through its cross-attention, so that
value crosses each decoder block boundary."""
from __future__ import annotations

import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration


def build(batch: int, layers: int = 2, width: int = 64, frames: int = 128, tokens: int = 16, dropout: float = 0.0):
    config = WhisperConfig(vocab_size=128, d_model=width, encoder_layers=layers, decoder_layers=layers,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=4 * width,
                           decoder_ffn_dim=4 * width, num_mel_bins=16, max_source_positions=frames // 2,
                           max_target_positions=tokens, dropout=dropout, use_cache=False, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config)
    features = torch.randn(batch, 16, frames)
    return model, {"input_features": features, "labels": torch.randint(3, 128, (batch, tokens))}
