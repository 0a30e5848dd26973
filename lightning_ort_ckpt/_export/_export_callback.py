"""Export at the end of fit, as a callback of its own: the best checkpoint (else the last) of an ``OrtCheckpoint``
becomes an ONNX model verified against ONNX Runtime (``lightning_ort_ckpt.export``).

``ExportBest(to=...)`` (``lightning_ort_ckpt.ExportBest``, for ``pytorch_lightning``) is a callback users may add
themselves; ``OrtCheckpoint(export_best_to=...)`` is the
shortcut that adds one in its ``setup``. The layers: this module is in layer 4 (it imports ``export``) and the
callback in layer 3 must not import it. So the shortcut is wired the other way round: importing this module hands
``OrtCheckpointMixin`` the factory it calls (:func:`_callback.use_exporter`), and the public entry points (the
package's ``OrtCheckpoint`` and ``lightning_ort_ckpt.lightning``) import this module with the callback, so the
shortcut works for every user of the public names. A callback of the right copy of Lightning is made for each
Trainer (``pytorch_lightning`` or ``lightning.pytorch``).
"""

from __future__ import annotations

import os
import warnings
from functools import cache
from typing import Any

from pytorch_lightning.callbacks import Callback

from .._callback import OrtCheckpointMixin, use_exporter
from .._lightning._namespaces import namespace_of
from ..errors import CheckpointWarning
from ..export import ExportReport, check_export_config, export_onnx


class ExportBestMixin:
    """Exports the best checkpoint of ``source`` (an ``OrtCheckpoint``; by default the Trainer's checkpoint
    callback) to ``to`` when fit ends, on global rank 0, after the ``OrtCheckpoint`` has waited for its files; the
    configuration is checked in ``setup``, before training. The report is in :attr:`report`."""

    def __init__(self, to: str | os.PathLike[str], tolerance: float = 1e-5,
                 source: OrtCheckpointMixin | None = None) -> None:
        super().__init__()
        self.to, self.tolerance, self.source = to, tolerance, source
        self.report: ExportReport | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            check_export_config(pl_module, self.tolerance)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or not trainer.is_global_zero:
            return
        source = self.source or trainer.checkpoint_callback
        path = source.best_model_path or source.last_model_path if source is not None else ""
        if not path:
            warnings.warn("export_best_to is set but no checkpoint was saved; nothing exported", CheckpointWarning)
            return
        if isinstance(source, OrtCheckpointMixin):
            source.checkpoint_io.wait()  # an asynchronous save: its file is durable first
        self.report = export_onnx(type(pl_module), path, self.to, tolerance=self.tolerance, reference=pl_module)
        namespace_of(trainer).attr("utilities.rank_zero_info")(f"OrtCheckpoint: {self.report}, checked against "
                                                                "ONNX Runtime")


@cache
def _callback_class(callback_base: type) -> type:
    if callback_base is Callback:
        return ExportBest
    return type("ExportBest", (ExportBestMixin, callback_base), {"__module__": __name__})


def export_best(trainer: Any, to: str | os.PathLike[str], tolerance: float, source: OrtCheckpointMixin) -> Any:
    """An ``ExportBest`` callback of ``trainer``'s copy of Lightning (``export_best_to=``'s factory)."""
    return _callback_class(namespace_of(trainer).attr("callbacks.Callback"))(to, tolerance, source)


use_exporter(export_best)


class ExportBest(ExportBestMixin, Callback):
    """Export at the end of fit, for ``pytorch_lightning`` Trainers (see :class:`ExportBestMixin`)."""
