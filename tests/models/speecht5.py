"""A transformers SpeechT5 (speech to text) as the library writes it: a convolutional front end,
an encoder whose relative position bias is built after its first layer's input and read by
every layer (its backward runs once theirs have given it its gradient, before the stage that
built it: part of that stage's unit is freed before its backward begins), a text decoder.
Small enough for a test: 1,600 samples (159 frames), width 32, one layer each."""
from __future__ import annotations

import torch
from transformers import SpeechT5Config, SpeechT5ForSpeechToText


def build(batch: int, samples: int = 1600, layers: int = 1):
    config = SpeechT5Config(vocab_size=32, hidden_size=32, encoder_layers=layers, decoder_layers=layers,
                            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                            decoder_ffn_dim=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, mask_time_prob=0.0,
                            encoder_layerdrop=0.0, decoder_layerdrop=0.0, speech_decoder_prenet_units=32,
                            speech_decoder_postnet_units=32)
    torch.manual_seed(0)
    model = SpeechT5ForSpeechToText(config)
    return model, {"input_values": torch.randn(batch, samples), "labels": torch.randint(3, 32, (batch, 8))}
