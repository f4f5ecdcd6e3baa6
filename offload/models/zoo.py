"""The model zoo: the networks of the offloading literature, with random weights.

Nothing is downloaded.  The CNNs follow the torchvision architectures (ResNet, VGG-16,
DenseNet-121, a GoogLeNet-style Inception net) with dropout left out; the GPT decoder is a
pre-LayerNorm GPT-2 block stack.  Each builder takes the batch size and its options (image
size, depth, width, …) and returns a ``ModelSpec`` with synthetic inputs and a loss
(cross-entropy against random labels).  Models as users write them, dropout included,
come from transformers (``hf``).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .spec import ModelSpec


class _ClassifierLoss:
    """Cross-entropy against fixed labels (one per row, or one per position of a sequence),
    moved to the logits' device on the first call only: a copy from pageable host memory at
    every step would make the host wait for the device inside the step."""

    def __init__(self, labels: torch.Tensor) -> None:
        self.labels = labels

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.labels.device != logits.device:
            self.labels = self.labels.to(logits.device)
        return F.cross_entropy(logits.float().flatten(0, -2), self.labels.flatten())


def image_batch(batch: int, image: int, classes: int) -> tuple[tuple[torch.Tensor, ...], Callable]:
    x = torch.randn(batch, 3, image, image)
    return (x,), _ClassifierLoss(torch.randint(0, classes, (batch,)))


# ----------------------------------------------------------------------------- ResNet
class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(cin, width, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.downsample(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, width * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(cin, width * 4, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.downsample(x))


def _downsample(cin: int, cout: int, stride: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    def __init__(self, block: type, layers: list[int], classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin, stages = 64, []
        for i, n in enumerate(layers):
            width = 64 * 2 ** i
            blocks = []
            for j in range(n):
                blocks.append(block(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


_RESNETS = {18: (BasicBlock, [2, 2, 2, 2]), 34: (BasicBlock, [3, 4, 6, 3]), 50: (Bottleneck, [3, 4, 6, 3]),
            101: (Bottleneck, [3, 4, 23, 3]), 152: (Bottleneck, [3, 8, 36, 3])}


def _resnet(depth: int) -> Callable[..., ModelSpec]:
    def build(batch: int, image: int = 224, classes: int = 1000) -> ModelSpec:
        block, layers = _RESNETS[depth]
        inputs, loss = image_batch(batch, image, classes)
        return ModelSpec(ResNet(block, layers, classes), inputs, {}, loss, f"ResNet-{depth}, {image}x{image} images")
    build.__doc__ = f"ResNet-{depth} (torchvision layout). Options: image=224, classes=1000."
    return build


# -------------------------------------------------------------------------------- VGG
class VGG16(nn.Module):
    CFG = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for v in self.CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU(inplace=True)]
                cin = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(7)
        self.classifier = nn.Sequential(nn.Linear(512 * 49, 4096), nn.ReLU(inplace=True),
                                        nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Linear(4096, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def vgg16(batch: int, image: int = 224, classes: int = 1000) -> ModelSpec:
    """VGG-16 (configuration D, no dropout). Options: image=224, classes=1000."""
    inputs, loss = image_batch(batch, image, classes)
    return ModelSpec(VGG16(classes), inputs, {}, loss, f"VGG-16, {image}x{image} images")


# --------------------------------------------------------------------------- DenseNet
class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int, bn_size: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.BatchNorm2d(cin), nn.Conv2d(cin, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, 1)
        x = self.conv1(F.relu(self.norm1(x)))
        return self.conv2(F.relu(self.norm2(x)))


class DenseBlock(nn.Module):
    def __init__(self, layers: int, cin: int, growth: int, bn_size: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(cin + i * growth, growth, bn_size) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.norm, self.conv, self.pool = nn.BatchNorm2d(cin), nn.Conv2d(cin, cout, 1, bias=False), nn.AvgPool2d(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.conv(F.relu(self.norm(x))))


class DenseNet(nn.Module):
    def __init__(self, blocks: tuple[int, ...] = (6, 12, 24, 16), growth: int = 32, init: int = 64,
                 bn_size: int = 4, classes: int = 1000) -> None:
        super().__init__()
        self.conv0, self.norm0 = nn.Conv2d(3, init, 7, 2, 3, bias=False), nn.BatchNorm2d(init)
        self.pool0 = nn.MaxPool2d(3, 2, 1)
        parts: list[nn.Module] = []
        c = init
        for i, n in enumerate(blocks):
            parts.append(DenseBlock(n, c, growth, bn_size))
            c += n * growth
            if i < len(blocks) - 1:
                parts.append(Transition(c, c // 2))
                c //= 2
        self.features = nn.Sequential(*parts)
        self.norm5 = nn.BatchNorm2d(c)
        self.classifier = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool0(F.relu(self.norm0(self.conv0(x))))
        x = F.relu(self.norm5(self.features(x)))
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def densenet121(batch: int, image: int = 224, classes: int = 1000) -> ModelSpec:
    """DenseNet-121 (growth 32, blocks 6-12-24-16). Options: image=224, classes=1000."""
    inputs, loss = image_batch(batch, image, classes)
    return ModelSpec(DenseNet(classes=classes), inputs, {}, loss, f"DenseNet-121, {image}x{image} images")


# -------------------------------------------------------------------------- Inception
def _conv_bn(cin: int, cout: int, k: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class InceptionModule(nn.Module):
    def __init__(self, cin: int, c1: int, c3r: int, c3: int, c5r: int, c5: int, cp: int) -> None:
        super().__init__()
        self.b1 = _conv_bn(cin, c1, 1)
        self.b2 = nn.Sequential(_conv_bn(cin, c3r, 1), _conv_bn(c3r, c3, 3))
        self.b3 = nn.Sequential(_conv_bn(cin, c5r, 1), _conv_bn(c5r, c5, 3), _conv_bn(c5, c5, 3))
        self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), _conv_bn(cin, cp, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)


class Inception(nn.Module):
    """GoogLeNet's layout (inception 3a-5b) with batch norm and 5x5 branches as two 3x3."""

    CFG = {"3a": (192, 64, 96, 128, 16, 32, 32), "3b": (256, 128, 128, 192, 32, 96, 64), "pool3": None,
           "4a": (480, 192, 96, 208, 16, 48, 64), "4b": (512, 160, 112, 224, 24, 64, 64),
           "4c": (512, 128, 128, 256, 24, 64, 64), "4d": (512, 112, 144, 288, 32, 64, 64),
           "4e": (528, 256, 160, 320, 32, 128, 128), "pool4": None,
           "5a": (832, 256, 160, 320, 32, 128, 128), "5b": (832, 384, 192, 384, 48, 128, 128)}

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(_conv_bn(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1), _conv_bn(64, 64, 1),
                                  _conv_bn(64, 192, 3), nn.MaxPool2d(3, 2, 1))
        self.blocks = nn.Sequential(*(nn.MaxPool2d(3, 2, 1) if cfg is None else InceptionModule(*cfg)
                                      for cfg in self.CFG.values()))
        self.fc = nn.Linear(1024, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def inception(batch: int, image: int = 224, classes: int = 1000) -> ModelSpec:
    """An Inception-style net (GoogLeNet layout, batch norm). Options: image=224, classes=1000."""
    inputs, loss = image_batch(batch, image, classes)
    return ModelSpec(Inception(classes), inputs, {}, loss, f"Inception (GoogLeNet layout), {image}x{image} images")


# -------------------------------------------------------------------------------- GPT
class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size(0), x.size(1), x.size(2)
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLPBlock(nn.Module):
    def __init__(self, width: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class DecoderBlock(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), CausalSelfAttention(width, heads)
        self.ln_2, self.mlp = nn.LayerNorm(width), MLPBlock(width, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, seq: int, vocab: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.h = nn.ModuleList(DecoderBlock(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt(batch: int, layers: int = 12, width: int = 768, heads: int = 12, seq: int = 1024, vocab: int = 50257,
        dropout: float = 0.0) -> ModelSpec:
    """GPT-style decoder (pre-LN, causal SDPA). Options: layers=12, width=768, heads=12, seq=1024, vocab=50257,
    dropout=0.0 (on each block's MLP output)."""
    if width % heads:
        raise ValueError(f"width ({width}) must be a multiple of heads ({heads})")
    tokens = torch.randint(0, vocab, (batch, seq + 1))
    loss = _ClassifierLoss(tokens[:, 1:].contiguous())
    return ModelSpec(GPT(layers, width, heads, seq, vocab, dropout), (tokens[:, :-1].contiguous(),), {}, loss,
                     f"GPT decoder, {layers} layers, width {width}, {heads} heads, sequence {seq}")


# -------------------------------------------------------------------------------- MLP
def mlp(batch: int, layers: int = 8, width: int = 4096, features: int = 1024, classes: int = 1000) -> ModelSpec:
    """A ReLU MLP. Options: layers=8 (hidden), width=4096, features=1024, classes=1000."""
    dims = [features] + [width] * layers
    mods: list[nn.Module] = []
    for a, b in zip(dims, dims[1:]):
        mods += [nn.Linear(a, b), nn.ReLU()]
    module = nn.Sequential(*mods, nn.Linear(dims[-1], classes))
    x = torch.randn(batch, features)
    return ModelSpec(module, (x,), {}, _ClassifierLoss(torch.randint(0, classes, (batch,))),
                     f"MLP, {layers} hidden layers of width {width}")


ZOO: dict[str, Callable[..., ModelSpec]] = {
    "resnet18": _resnet(18), "resnet34": _resnet(34), "resnet50": _resnet(50), "resnet101": _resnet(101),
    "resnet152": _resnet(152), "vgg16": vgg16, "densenet121": densenet121, "inception": inception,
    "gpt": gpt, "mlp": mlp,
}
