"""Export at the end of fit as its own callback (``ExportBest``), which ``export_best_to=`` adds: used directly, it
exports the best checkpoint of the Trainer's ``OrtCheckpoint`` and logs the result (path, the largest difference
between ONNX Runtime and torch, the tolerance)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort_ckpt import ExportBest, OrtCheckpoint
from helpers.export import MODULE


def test_export_best_used_directly_exports_the_best_checkpoint_and_logs_it(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "demo_module_direct.py").write_text(MODULE)
    sys.path.insert(0, str(tmp_path))
    try:
        from demo_module_direct import Demo
    finally:
        sys.path.remove(str(tmp_path))
    pl.seed_everything(0)
    x = torch.randn(64, 8)
    data = TensorDataset(x, (x[:, :4].sum(1) > 0).long())
    checkpoint = OrtCheckpoint(dirpath=tmp_path / "ckpts", monitor="val_loss")
    export = ExportBest(tmp_path / "best.onnx")
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[export, checkpoint])
    with caplog.at_level("INFO", logger="pytorch_lightning.utilities.rank_zero"):
        trainer.fit(Demo(), DataLoader(data, batch_size=32), DataLoader(data, batch_size=64))
    report = export.report
    assert report is not None and report.checkpoint == checkpoint.best_model_path and (tmp_path / "best.onnx").is_file()
    assert report.max_abs_diff <= 1e-5
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("OrtCheckpoint: exported")]
    assert lines == [f"OrtCheckpoint: {report}, checked against ONNX Runtime"], lines
    assert f"exported {tmp_path / 'best.onnx'} from {checkpoint.best_model_path}" in lines[0]
