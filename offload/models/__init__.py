"""Models to profile and train: the zoo (the literature's CNNs and a GPT decoder), small
transformers models as users write them (GPT-2, Llama, BERT, ViT, ConvNeXt), and the
``MODEL`` string that names one of them or the user's own function."""
from .resolve import ALL_ZOO, parse_options, resolve, zoo_help
from .spec import ModelSpec, default_loss, output_loss

__all__ = ["ALL_ZOO", "ModelSpec", "default_loss", "output_loss", "parse_options", "resolve", "zoo_help"]
