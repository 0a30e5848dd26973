"""Export of tied-weight models (an embedding and an output head sharing one tensor, the norm in language models):
``OrtCheckpoint(export_best_to=...)`` at the end of fit and ``ort-ckpt export``, each checked against ONNX Runtime."""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np
import onnxruntime
import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_ort_ckpt import OrtCheckpoint
from lightning_ort_ckpt._command._cli import main
from lightning_ort_ckpt.errors import CheckpointWarning
from lightning_ort_ckpt.export import ExportError, export_onnx
from helpers.zoo_models import BATCH, ZOO, ZooModule

VOCAB, WIDTH, LENGTH = 11, 8, 6


class GPT2Style(ZooModule):
    """GPT-2's shape: token and position embeddings, a pre-LayerNorm causal block, a final LayerNorm and a bias-free
    ``lm_head`` tied to ``transformer.wte``; the last position's logits classify."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab, width), "wpe": nn.Embedding(LENGTH, width),
            "h": nn.TransformerEncoderLayer(width, 2, 16, dropout=0.1, batch_first=True, norm_first=True),
            "ln_f": nn.LayerNorm(width)})
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight
        self.example_input_array = torch.randint(0, vocab, (2, LENGTH), generator=torch.Generator().manual_seed(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        h = t["wte"](x) + t["wpe"](torch.arange(x.shape[1]))
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.lm_head(t["ln_f"](t["h"](h, src_mask=mask, is_causal=True)))[:, -1]

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01, eps=1e-6)


TIED = ZOO[0]
MODELS = {"zoo_tied_transformer": (TIED.cls, lambda g: torch.randint(0, 12, (16, 5), generator=g), 12),
          "gpt2_style": (GPT2Style, lambda g: torch.randint(0, VOCAB, (16, LENGTH), generator=g), VOCAB)}


def _fit(name: str, root: Any) -> tuple[ZooModule, OrtCheckpoint]:
    cls, inputs, classes = MODELS[name]
    torch.manual_seed(0)
    model = cls()
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(inputs(g), torch.randint(0, classes, (16,), generator=g))
    callback = OrtCheckpoint(dirpath=root / "ckpts", export_best_to=root / "best.onnx", export_tolerance=1e-4)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=BATCH))
    return model, callback


def _onnx_output(path: Any, x: torch.Tensor) -> np.ndarray:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"input": x.numpy()})[0]


def _assert_ort_gives_torchs(path: Any, module: nn.Module) -> None:
    x = module.example_input_array
    module.eval()
    with torch.no_grad():
        expected = module(x).numpy()
    np.testing.assert_allclose(_onnx_output(path, x), expected, atol=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
def test_export_best_to_exports_a_tied_model_at_the_end_of_fit(name: str, tmp_path: Any) -> None:
    model, callback = _fit(name, tmp_path)
    tied = [n for n, _ in model.named_parameters(remove_duplicate=False) if n.endswith(("head.weight", "wte.weight",
                                                                                       "embed.weight"))]
    assert model.get_parameter(tied[0]) is model.get_parameter(tied[1])  # the tie held through training
    report = callback.export_report
    assert report is not None and report.path == str(tmp_path / "best.onnx")
    assert report.max_abs_diff <= 1e-4
    _assert_ort_gives_torchs(tmp_path / "best.onnx", model)


@pytest.mark.parametrize("name", list(MODELS))
def test_cli_export_of_a_tied_model(name: str, tmp_path: Any, capsys: Any) -> None:
    model, callback = _fit(name, tmp_path)
    cls = MODELS[name][0]
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = os.path.join(tests, "helpers/zoo_models.py" if cls is TIED.cls else "export_cli/test_export_tied.py")
    out = tmp_path / "cli.onnx"
    code = main(["export", callback.best_model_path, "--module", f"{spec}:{cls.__name__}", "--output", str(out),
                 "--tolerance", "1e-4"])
    assert code == 0, capsys.readouterr().err
    assert "max abs difference" in capsys.readouterr().out
    _assert_ort_gives_torchs(out, model)


def test_a_failing_comparison_with_the_trained_module_is_an_export_error(tmp_path: Any) -> None:
    """Whatever torch raises while running the trained module with the checkpoint's weights is our error, naming
    the checkpoint: nothing escapes from the callback's teardown as a bare torch error."""
    model, callback = _fit("gpt2_style", tmp_path)

    def broken(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("a torch error")

    model.forward = broken  # type: ignore[method-assign]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        with pytest.raises(ExportError, match="a torch error") as info:
            export_onnx(GPT2Style, callback.best_model_path, tmp_path / "m.onnx", tolerance=1e-4, reference=model)
    assert callback.best_model_path in str(info.value)
    assert not (tmp_path / "m.onnx").exists()
