"""Tests for fl.world.models: output shapes, parameter counts and layer choices."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fl.world.models import MODEL_NAMES, build_model, conv_input

IMAGE_SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32)]
FLAT_MODELS = ["logreg", "mlp"]
CONV_MODELS = ["cnn", "lenet5", "resnet18"]


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", FLAT_MODELS)
@pytest.mark.parametrize("shape", [(64,), (20,), *IMAGE_SHAPES])
def test_flat_models_map_any_shape_to_logits(name: str, shape: tuple[int, ...]) -> None:
    out = build_model(name, shape, 7)(torch.randn(3, *shape))
    assert out.shape == (3, 7)


@pytest.mark.parametrize("name", CONV_MODELS)
@pytest.mark.parametrize("shape", IMAGE_SHAPES)
def test_conv_models_map_images_to_logits(name: str, shape: tuple[int, ...]) -> None:
    out = build_model(name, shape, 10).eval()(torch.randn(2, *shape))
    assert out.shape == (2, 10)


@pytest.mark.parametrize("name", CONV_MODELS)
def test_conv_models_reject_flat_input(name: str) -> None:
    with pytest.raises(ValueError, match=r"needs image input \(C, H, W\)"):
        build_model(name, (64,), 10)


@pytest.mark.parametrize(
    ("shape", "hidden", "classes", "expected"),
    [
        ((64,), [64], 10, 4810),
        ((20,), [32], 2, 738),
        ((20,), [], 2, 42),
        ((4,), [8, 8], 3, 139),
    ],
)
def test_mlp_parameter_count(
    shape: tuple[int, ...], hidden: list[int], classes: int, expected: int
) -> None:
    assert _num_params(build_model("mlp", shape, classes, hidden=hidden)) == expected


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        ("logreg", (1, 28, 28), 7850),
        ("cnn", (1, 28, 28), 20490),
        ("lenet5", (1, 28, 28), 61706),  # the classic LeNet-5 count
        ("lenet5", (3, 32, 32), 62006),  # the usual CIFAR LeNet-5 count
    ],
)
def test_fixed_architectures_have_known_sizes(
    name: str, shape: tuple[int, ...], expected: int
) -> None:
    assert _num_params(build_model(name, shape, 10)) == expected


@pytest.mark.parametrize("name", ["logreg", "mlp", "cnn", "lenet5"])
def test_dp_models_have_no_batchnorm(name: str) -> None:
    model = build_model(name, (3, 32, 32), 10)
    assert not any(isinstance(m, _BatchNorm) for m in model.modules())


def test_resnet18_small_input_gets_cifar_stem_and_channel_count() -> None:
    model = build_model("resnet18", (1, 28, 28), 10)
    conv1 = model.get_submodule("conv1")
    assert isinstance(conv1, nn.Conv2d)
    assert (conv1.in_channels, conv1.kernel_size, conv1.stride) == (1, (3, 3), (1, 1))
    assert isinstance(model.get_submodule("maxpool"), nn.Identity)


def test_resnet18_large_input_keeps_imagenet_stem() -> None:
    model = build_model("resnet18", (1, 64, 64), 10)
    conv1 = model.get_submodule("conv1")
    assert isinstance(conv1, nn.Conv2d)
    assert (conv1.in_channels, conv1.kernel_size, conv1.stride) == (1, (7, 7), (2, 2))
    assert isinstance(model.get_submodule("maxpool"), nn.MaxPool2d)
    assert model(torch.randn(2, 1, 64, 64)).shape == (2, 10)


def test_unknown_model_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="logreg, mlp, cnn, lenet5, resnet18"):
        build_model("vgg16", (3, 32, 32), 10)
    assert MODEL_NAMES == ("logreg", "mlp", "cnn", "lenet5", "resnet18")


def test_images_train_in_channels_last_memory_with_the_same_gradients():
    """conv_input lays an image batch out channels-last (faster oneDNN kernels on the CPU)
    and leaves other inputs alone; LeNet-5's loss and gradients stay those of the plain
    layout up to rounding."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    fast = conv_input(x)
    assert fast.is_contiguous(memory_format=torch.channels_last) and torch.equal(fast, x)
    flat = torch.randn(8, 20)
    assert conv_input(flat) is flat
    model = build_model("lenet5", (3, 32, 32), 10)
    grads = []
    for batch in (x, fast):
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(batch), y)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, channels_last in zip(*grads, strict=True):
        torch.testing.assert_close(channels_last, plain, rtol=1e-5, atol=1e-7)
