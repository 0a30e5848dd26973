"""The conformance zoo's models: realistic LightningModule shapes, each a few thousand parameters at most (one, the
frozen backbone, has the megabyte of frozen weights that frozen-tensor sharing needs to engage).

Adding a model shape is one :class:`Entry` in :data:`ZOO`: a LightningModule subclass of :class:`ZooModule` (its
``forward`` gives class logits, trained with cross-entropy, which is also the loss of ORT's training artifacts), how to
build it and make its data, and what ORT is expected to do with it. ``tests/conformance/test_zoo.py`` runs every entry
through resume, ORT training and export.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

BATCH = 4
SAMPLES = 16  # 4 optimizer steps per epoch


class Act(enum.Enum):
    """A hyperparameter JSON cannot spell: the checkpoint must give it back as the member, not as a string."""

    RELU = "relu"
    TANH = "tanh"

    def module(self) -> nn.Module:
        return nn.Tanh() if self is Act.TANH else nn.ReLU()


class ZooModule(pl.LightningModule):
    """Cross-entropy on ``self(x)``; a shuffled loader over the entry's data; subclasses give the optimizer."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)


class TiedTransformer(ZooModule):
    """Token embedding -> TransformerEncoderLayer (attention with dropout, LayerNorm) -> output head tied to the
    embedding, AdamW."""

    def __init__(self, vocab: int = 12, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, width)
        self.block = nn.TransformerEncoderLayer(width, 2, 16, dropout=0.1, batch_first=True)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.example_input_array = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)).mean(1))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01, eps=1e-6, weight_decay=0.0)


class FrozenStemCNN(ZooModule):
    """A frozen conv stem, BatchNorm, an activation chosen by an Enum hyperparameter, conv, head; SGD with momentum
    over the trainable parameters."""

    def __init__(self, act: Act = Act.RELU, channels: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Conv2d(1, channels, 3)
        self.stem.requires_grad_(False)
        self.bn = nn.BatchNorm2d(channels)
        self.act = act.module()
        self.conv = nn.Conv2d(channels, channels, 3)
        self.head = nn.Linear(channels, 3)
        self.example_input_array = torch.randn(2, 1, 7, 7, generator=torch.Generator().manual_seed(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(self.act(self.bn(self.stem(x)))).mean((2, 3)))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05, momentum=0.9)


class HeadOnly(ZooModule):
    """Fine-tuning the head only: the backbone and a learnable temperature keep ``requires_grad=True`` but no
    optimizer holds them (they never change in torch); Adam over the head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.example_input_array = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.backbone(x))) / self.temperature

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.head.parameters(), lr=0.01, eps=1e-6)


class FrozenBackbone(ZooModule):
    """Fine-tuning a frozen backbone: two frozen Linear layers (the second 1.25 MiB, enough for frozen-tensor
    sharing), a BatchNorm whose running statistics still move in training, and a small trainable head; AdamW."""

    def __init__(self, width: int = 1280) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.backbone = nn.Sequential(nn.Linear(6, 256), nn.ReLU(), nn.Linear(256, width))
        self.backbone.requires_grad_(False)
        self.bn = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, 3)
        self.example_input_array = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.backbone(x))))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.01, eps=1e-6)


class ParamContainers(ZooModule):
    """Weights in an ``nn.ParameterList``, biases in an ``nn.ParameterDict``, GELU; RMSprop."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(6, 8) * 0.3), nn.Parameter(torch.randn(8, 3) * 0.3)])
        self.biases = nn.ParameterDict({"hidden": nn.Parameter(torch.zeros(8)), "out": nn.Parameter(torch.zeros(3))})
        self.example_input_array = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = nn.functional.gelu(x @ self.weights[0] + self.biases["hidden"])
        return hidden @ self.weights[1] + self.biases["out"]

    def configure_optimizers(self) -> Any:
        return torch.optim.RMSprop(self.parameters(), lr=0.01)


class Bf16Mlp(ZooModule):
    """bfloat16 parameters (saved with ``ort_compatible=True``, as float32 ORT can load); the input is cast to the
    parameters' dtype, so a float32 copy of the module runs too. AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8, dtype=torch.bfloat16)
        self.fc2 = nn.Linear(8, 3, dtype=torch.bfloat16)
        self.example_input_array = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.to(self.fc1.weight.dtype)))).float()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01, eps=1e-6)


class TwoOptimizers(ZooModule):
    """Manual optimization with two optimizers, as a GAN has: Adam for the encoder, SGD for the head. ORT trains
    with one optimizer: the first one's parameters are trainable for it, the head is frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.encoder = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.Tanh())
        self.head = nn.Linear(8, 3)
        self.example_input_array = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        for opt in self.optimizers():
            opt.zero_grad()
            self.manual_backward(nn.functional.cross_entropy(self(x), y))
            opt.step()

    def configure_optimizers(self) -> Any:
        return (torch.optim.Adam(self.encoder.parameters(), lr=0.01, eps=1e-6),
                torch.optim.SGD(self.head.parameters(), lr=0.05, momentum=0.9))


class OneCycleMlp(ZooModule):
    """AdamW with a OneCycle schedule stepped per optimizer step; the entry trains it with gradient accumulation
    and clipping."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        self.example_input_array = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01, eps=1e-6, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=50)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class GroupNormCNN(ZooModule):
    """Conv -> GroupNorm (exported as InstanceNormalization, which ORT 1.19.2 cannot differentiate as it is) ->
    head; Adam."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.norm = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4, 3)
        self.example_input_array = torch.randn(2, 1, 6, 6, generator=torch.Generator().manual_seed(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.conv(x))).mean((2, 3)))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01, eps=1e-6)


class SoftplusHead(ZooModule):
    """A Softplus output, which ORT 1.19.2 cannot differentiate; AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.example_input_array = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.softplus(self.fc(x))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01, eps=1e-6)


class DropPath(nn.Module):
    """Stochastic depth as timm's ``DropPath`` and torchvision's ``StochasticDepth`` write it (neither is installed
    here: their wheels need a torchvision that cannot load next to this CPU torch): in training, each sample's
    residual branch is dropped with probability ``p`` by a ``torch.rand`` mask and kept ones are scaled by
    ``1 / (1 - p)``; in eval, the identity."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep = 1 - self.p
        mask = torch.floor(keep + torch.rand((x.shape[0],) + (1,) * (x.dim() - 1), dtype=x.dtype, device=x.device))
        return x * mask / keep


class SqueezeExcite(nn.Module):
    """Squeeze-excitation (EfficientNet, MobileNetV3): channels rescaled by a gate computed from their means."""

    def __init__(self, channels: int, reduced: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, reduced, 1)
        self.expand = nn.Conv2d(reduced, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.expand(torch.relu(self.reduce(x.mean((2, 3), keepdim=True)))))


class StochasticDepthCNN(ZooModule):
    """An EfficientNet-like residual block: conv stem, BatchNorm, a branch of conv, BatchNorm, SiLU and
    squeeze-excitation behind DropPath, head; AdamW. ORT's eval model must not keep the DropPath mask."""

    def __init__(self, channels: int = 4, drop_path: float = 0.5) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Conv2d(1, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.branch = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.SiLU(),
                                    SqueezeExcite(channels, 2))
        self.drop = DropPath(drop_path)
        self.head = nn.Linear(channels, 3)
        self.example_input_array = torch.randn(2, 1, 6, 6, generator=torch.Generator().manual_seed(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.stem(x)))
        return self.head((h + self.drop(self.branch(h))).mean((2, 3)))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01, eps=1e-6)


def features(*shape: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.randn(SAMPLES, *shape, generator=g)


def tokens(vocab: int, length: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.randint(0, vocab, (SAMPLES, length), generator=g)


@dataclass(frozen=True)
class Entry:
    """One model shape of the zoo.

    ``ort_error``: None when ORT trains the model, else what the ``ArtifactsError`` of ``make_training_artifacts``
    must say (a regular expression). ``float32_for_ort``: ORT trains (and ONNX Runtime runs) a float32 copy of the
    module, ``load_from_checkpoint(path).float()``; passing the class must raise. ``plugin``: ``OrtCheckpointIO``
    arguments.
    ``trained_by_ort``: ``state_dict`` keys ORT's training changes (checked to have moved); ``unchanged``: the keys
    it must leave alone (frozen or held by no optimizer).
    """

    name: str
    cls: type[ZooModule]
    inputs: Callable[[torch.Generator], torch.Tensor]
    classes: int
    kwargs: dict[str, Any] = field(default_factory=dict)
    ort_error: str | None = None
    trained_by_ort: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()
    adam_like: bool = True
    tolerance: float = 1e-5
    plugin: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)
    float32_for_ort: bool = False

    def build(self, seed: int) -> ZooModule:
        torch.manual_seed(seed)
        return self.cls(**self.kwargs)

    def data(self, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return self.inputs(g), torch.randint(0, self.classes, (SAMPLES,), generator=g)


ZOO = [
    Entry("tied_transformer", TiedTransformer, tokens(12, 5), 12, trained_by_ort=("embed.weight", "head.weight"),
          tolerance=1e-4),
    Entry("frozen_stem_cnn", FrozenStemCNN, features(1, 7, 7), 3, kwargs={"act": Act.TANH},
          trained_by_ort=("conv.weight", "bn.running_mean"), unchanged=("stem.weight", "stem.bias"), adam_like=False),
    Entry("head_only", HeadOnly, features(6), 3, trained_by_ort=("head.weight",),
          unchanged=("backbone.weight", "backbone.bias", "temperature")),
    Entry("frozen_backbone", FrozenBackbone, features(6), 3, trained_by_ort=("head.weight", "bn.running_mean"),
          unchanged=("backbone.2.weight", "backbone.0.bias")),
    Entry("param_containers", ParamContainers, features(6), 3, trained_by_ort=("weights.0", "biases.out"),
          adam_like=False),
    Entry("bf16_mlp", Bf16Mlp, features(6), 3, trained_by_ort=("fc1.weight",), plugin={"ort_compatible": True},
          float32_for_ort=True),
    Entry("two_optimizers_manual", TwoOptimizers, features(6), 3, trained_by_ort=("encoder.0.weight",),
          unchanged=("head.weight", "head.bias")),
    Entry("onecycle_accumulate_clip", OneCycleMlp, features(6), 3, trained_by_ort=("net.0.weight",),
          trainer={"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}),
    Entry("groupnorm_cnn", GroupNormCNN, features(1, 6, 6), 3, trained_by_ort=("norm.weight", "conv.weight")),
    Entry("stochastic_depth_se_cnn", StochasticDepthCNN, features(1, 6, 6), 3, kwargs={"drop_path": 0.25},
          trained_by_ort=("branch.3.reduce.weight", "bn.running_mean")),
    Entry("softplus_head", SoftplusHead, features(6), 3, ort_error="cannot differentiate the ONNX operator Softplus"),
]
