"""The conformance zoo with architectures nobody here wrote: Hugging Face transformers built from tiny configs
(nothing downloaded), and OmegaConf (Hydra) hyperparameters. Each test skips, with the reason, only where its
optional package is absent (the ``dev`` extra installs both). torchvision and timm are not used: the torchvision
wheel for this torch cannot load next to it; their shapes (stochastic depth, squeeze-excitation, BatchNorm) are
``zoo_models.StochasticDepthCNN``."""

from __future__ import annotations

import json
import warnings
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

pytest.importorskip("onnxruntime.training")

import lightning_ort_ckpt
from lightning_ort_ckpt import OrtCheckpoint
from lightning_ort_ckpt.artifacts import ArtifactsError, make_training_artifacts
from lightning_ort_ckpt.errors import CheckpointWarning
from lightning_ort_ckpt.export import export_onnx
from helpers.ort_reference import ort_api
from helpers.zoo import assert_same_state, fit, loader
from helpers.zoo_models import Entry, ZooModule, tokens

TINY_BERT = {"vocab_size": 20, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
             "intermediate_size": 16, "max_position_embeddings": 8, "num_labels": 3}


def transformers_or_skip() -> Any:
    return pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[dev])")


class BertClassifier(ZooModule):
    """``BertForSequenceClassification`` from a config dict hyperparameter (dropout in embeddings, attention and
    head; LayerNorm; GELU); AdamW."""

    def __init__(self, config: dict[str, Any] = TINY_BERT) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import BertConfig, BertForSequenceClassification

        self.bert = BertForSequenceClassification(BertConfig(**config))
        self.example_input_array = torch.randint(0, config["vocab_size"], (2, 6),
                                                 generator=torch.Generator().manual_seed(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=x).logits

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01, eps=1e-6)


BERT = Entry("bert", BertClassifier, tokens(20, 6), 3)


def test_bert_resumes_bitwise_trains_in_ort_and_exports(tmp_path: Any) -> None:
    transformers_or_skip()
    t, _ = fit(BERT, BERT.build(0), max_epochs=1)
    start = str(tmp_path / "epoch1.ckpt")
    t.save_checkpoint(start)
    straight = BERT.build(0)
    fit(BERT, straight, max_epochs=2)
    resumed = BERT.build(7)
    t, warned = fit(BERT, resumed, start, max_epochs=2)
    assert not warned, warned
    assert_same_state(resumed.state_dict(), straight.state_dict(), "bert")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        art = make_training_artifacts(BertClassifier, start, tmp_path / "art")
        torch_model = lightning_ort_ckpt.load_from_checkpoint(BertClassifier, start).eval()
        report = export_onnx(BertClassifier, start, tmp_path / "bert.onnx", tolerance=1e-4)
    assert report.max_abs_diff <= 1e-4
    x, y = BERT.data(seed=5)
    x, y = x[:4], y[:4]
    api = ort_api()
    state = api.CheckpointState.load_checkpoint(art.checkpoint)
    module = api.Module(art.training_model, state, art.eval_model)
    module.eval()
    losses = [float(module(x.numpy(), y.numpy())) for _ in range(2)]
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(torch_model(x), y).item()
    assert losses[0] == losses[1] and abs(losses[0] - expected) < 1e-4  # eval: no dropout, torch's answer
    optimizer = api.Optimizer(art.optimizer_model, module)
    before = dict(state.parameters)["bert.classifier.weight"].data.copy()
    module.train()
    module(x.numpy(), y.numpy())
    optimizer.step()
    assert not np.array_equal(dict(state.parameters)["bert.classifier.weight"].data, before)


class T5Logits(torch.nn.Module):
    """``T5ForConditionalGeneration`` with two inputs (encoder and decoder tokens), logits flattened for
    cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration

        self.t5 = T5ForConditionalGeneration(T5Config(
            vocab_size=20, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1, num_heads=2,
            relative_attention_num_buckets=4, decoder_start_token_id=0, pad_token_id=0))

    def forward(self, inputs: torch.Tensor, decoder_inputs: torch.Tensor) -> torch.Tensor:
        return self.t5(input_ids=inputs, decoder_input_ids=decoder_inputs).logits.reshape(-1, 20)


def test_t5_which_ort_cannot_train_is_an_artifacts_error_naming_the_operation(tmp_path: Any) -> None:
    """ORT's gradient graph of T5's relative position bias fails when run: the trial step finds it, not the user."""
    transformers_or_skip()
    from lightning_ort_ckpt.format import save_checkpoint
    from lightning_ort_ckpt._translation.lightning_dict import ModuleInfo, to_ort

    torch.manual_seed(0)
    model = T5Logits()
    path = str(tmp_path / "t5.ckpt")
    save_checkpoint(to_ort({"state_dict": model.state_dict()},
                           ModuleInfo({n for n, _ in model.named_parameters()}, [])), path)
    g = torch.Generator().manual_seed(1)
    example = (torch.randint(0, 20, (2, 5), generator=g), torch.randint(0, 20, (2, 4), generator=g))
    with pytest.raises(ArtifactsError, match=r"could not run a training step .* node \S+SelfAttention\S+_Grad\S* "
                                             r"\(\w+\) failed: .*limit of onnxruntime-training 1.19.2's gradient "
                                             r"graph for the torch operation at \S+SelfAttention"):
        make_training_artifacts(model, path, tmp_path / "art", example_input=example)


class HydraModule(ZooModule):
    """A Hydra user's module: one ``DictConfig`` hyperparameter, with an interpolation and a nested list."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.fc = torch.nn.Linear(cfg.model.inputs, cfg.model.width)
        self.out = torch.nn.Linear(cfg.model.width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(x)))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.cfg.optim.lr)


def test_omegaconf_hyperparameters_come_back_as_dictconfig(tmp_path: Any) -> None:
    omegaconf = pytest.importorskip("omegaconf", reason="omegaconf is not installed (pip install -e .[dev])")
    cfg = omegaconf.OmegaConf.create({"model": {"inputs": 6, "width": 8, "layers": [8, "${model.width}"]},
                                      "optim": {"lr": 0.05}})
    entry = Entry("hydra", HydraModule, lambda g: torch.randn(16, 6, generator=g), 3)
    callback = OrtCheckpoint(dirpath=tmp_path)
    t = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                   enable_model_summary=False, callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)  # nothing saved as a placeholder
        t.fit(HydraModule(cfg), loader(entry))
        loaded = lightning_ort_ckpt.load_from_checkpoint(HydraModule, callback.best_model_path)
    restored = loaded.hparams.cfg
    assert isinstance(restored, omegaconf.DictConfig)
    assert restored.model.layers[1] == 8 and restored.optim.lr == 0.05
    assert omegaconf.OmegaConf.to_container(restored, resolve=True) == omegaconf.OmegaConf.to_container(
        cfg, resolve=True)
    assert loaded.fc.out_features == 8


def test_omegaconf_encoding_keeps_interpolations_and_missing_values() -> None:
    """The pickle-free encoding itself keeps a config as written (``load_from_checkpoint`` hands Lightning the
    hyperparameters through ``apply_to_collection``, which resolves interpolations)."""
    omegaconf = pytest.importorskip("omegaconf", reason="omegaconf is not installed (pip install -e .[dev])")
    from lightning_ort_ckpt._translation import values

    cfg = omegaconf.OmegaConf.create({"a": 1, "b": "${a}", "c": "???", "d": [1, {"e": 2.5}]})
    encoded = json.loads(json.dumps(values.encode({"cfg": cfg, "list": cfg.d}, lambda path, t: None)))
    decoded = values.decode(encoded, lambda ref: None)
    assert isinstance(decoded["cfg"], omegaconf.DictConfig) and isinstance(decoded["list"], omegaconf.ListConfig)
    assert omegaconf.OmegaConf.to_container(decoded["cfg"]) == omegaconf.OmegaConf.to_container(cfg)
    assert decoded["cfg"].b == 1 and omegaconf.OmegaConf.is_missing(decoded["cfg"], "c")
