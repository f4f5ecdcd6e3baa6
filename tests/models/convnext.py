"""A transformers ConvNeXt image classifier with stochastic depth (drop_path), small enough
for the CPU.  Its classification loss sets ``config.problem_type`` on its first call, so a
compiled step recompiles once: the second step compiles again and allocates 8 B per
stochastic-depth block that stay from then on, which a metered compiled step must come after."""
from __future__ import annotations

import torch
from transformers import ConvNextConfig, ConvNextForImageClassification


def build(batch: int, image: int = 64, drop_path: float = 0.1):
    config = ConvNextConfig(num_channels=3, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=10,
                            image_size=image, drop_path_rate=drop_path)
    torch.manual_seed(0)
    model = ConvNextForImageClassification(config)
    return model, {"pixel_values": torch.randn(batch, 3, image, image), "labels": torch.randint(0, 10, (batch,))}
