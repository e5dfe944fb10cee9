"""Model zoo by name, randomly initialised (no weights are ever downloaded)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["MODEL_NAMES", "build_model", "conv_input"]


def conv_input(x: torch.Tensor) -> torch.Tensor:
    """A batch of images (N, C, H, W) on the CPU in channels-last memory, anything else as
    it is: oneDNN's convolutions and max-pools there run ~1.4× faster on it (LeNet-5 on
    32×32, `experiments/RESULTS.md` "Issue 37"); the values differ only by rounding."""
    if x.dim() == 4 and x.device.type == "cpu":
        return x.contiguous(memory_format=torch.channels_last)
    return x


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    hidden: Sequence[int] = (64,),
) -> nn.Module:
    """A fresh `name` model for samples of `input_shape`; `hidden` sets the mlp's layer widths.

    logreg and mlp take any shape (flattened); conv models need (C, H, W) with H, W >= 4.
    All but resnet18 use only Opacus-friendly layers (no BatchNorm).
    """
    builder = _BUILDERS.get(name)
    if builder is None:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
    if name in _CONV_MODELS and (len(input_shape) != 3 or min(input_shape[1:]) < 4):
        raise ValueError(
            f"model {name!r} needs image input (C, H, W) with H, W >= 4, got {input_shape}; "
            "for digits load the dataset with flat=False"
        )
    return builder(tuple(input_shape), num_classes, tuple(hidden))


def _logreg(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...]) -> nn.Module:
    """Multinomial logistic regression: one linear layer on the flattened input."""
    del hidden  # no hidden layers
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


def _mlp(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...]) -> nn.Module:
    """Fully connected ReLU network with one hidden layer per entry of `hidden`."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for out in hidden:
        layers += [nn.Linear(width, out), nn.ReLU()]
        width = out
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def _cnn(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...]) -> nn.Module:
    """Two conv3x3-ReLU-maxpool blocks (16, 32 channels) and a linear classifier."""
    del hidden  # fixed architecture
    channels, height, width = input_shape
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (height // 4) * (width // 4), num_classes),
    )


def _lenet5(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...]) -> nn.Module:
    """LeNet-5 with ReLU and max-pooling; conv1 is padded so 28x28 gives the classic 16x5x5.

    Inputs too small for the unpadded 5x5 conv2 (digits' 8x8) pad it too, and an adaptive
    max-pool brings the feature map to at most 5x5, so 32x32 works unchanged.
    """
    del hidden  # fixed architecture
    channels, height, width = input_shape
    pad2 = 0 if min(height, width) // 2 >= 5 else 2
    conv_h, conv_w = height // 2 + 2 * pad2 - 4, width // 2 + 2 * pad2 - 4
    pooled = (min(5, conv_h), min(5, conv_w))
    return nn.Sequential(
        nn.Conv2d(channels, 6, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5, padding=pad2),
        nn.ReLU(),
        nn.AdaptiveMaxPool2d(pooled),
        nn.Flatten(),
        nn.Linear(16 * pooled[0] * pooled[1], 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, num_classes),
    )


def _resnet18(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...]) -> nn.Module:
    """torchvision's ResNet-18, untrained; inputs up to 32 px get the CIFAR stem.

    The CIFAR stem is a 3x3 stride-1 conv1 and no max-pool.

    Has BatchNorm, so differential privacy with Opacus needs it swapped for GroupNorm.
    """
    del hidden  # fixed architecture
    channels, height, width = input_shape
    from torchvision.models import resnet18  # lazy: torchvision costs ~1.5 s to import

    model = resnet18(weights=None, num_classes=num_classes)
    if max(height, width) <= 32:
        model.conv1 = nn.Conv2d(channels, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif channels != 3:
        model.conv1 = nn.Conv2d(channels, 64, 7, stride=2, padding=3, bias=False)
    return model


_BUILDERS: dict[str, Callable[[tuple[int, ...], int, tuple[int, ...]], nn.Module]] = {
    "logreg": _logreg,
    "mlp": _mlp,
    "cnn": _cnn,
    "lenet5": _lenet5,
    "resnet18": _resnet18,
}
_CONV_MODELS = frozenset({"cnn", "lenet5", "resnet18"})
MODEL_NAMES = tuple(_BUILDERS)
