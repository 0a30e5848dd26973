"""Puts our DCP storage where PyTorch's own DCP tests look for ``FileSystemWriter`` / ``FileSystemReader``.

``scripts/upstream_dcp.sh`` puts this folder on ``PYTHONPATH``, so Python imports it at start-up in the test runner
AND in every process a ``MultiProcessTestCase`` spawns (they inherit the environment). ``UPSTREAM_DCP_STORAGE``:
``ours`` swaps in subclasses of ``OrtStorageWriter`` / ``OrtStorageReader`` that take ``FileSystemWriter``'s and
``FileSystemReader``'s arguments; ``stock`` (the control run) keeps DCP's own. In both, a test gated on N GPUs
(``skip_if_lt_x_gpu``) is skipped before its processes are spawned rather than in each of them (the same verdict,
minutes sooner on a small machine). ``UPSTREAM_DCP_CPU=1`` lifts those gates instead, so that the DTensor cases
written for GPUs run on CPU with gloo; tests that need CUDA itself still fail or skip there.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def _swap() -> None:
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.filesystem  # noqa: F401 - every module that holds the names, imported
    import torch.distributed.checkpoint.format_utils  # noqa: F401
    import torch.distributed.checkpoint.state_dict_loader  # noqa: F401
    import torch.distributed.checkpoint.state_dict_saver  # noqa: F401

    from lightning_ort_ckpt.dcp import OrtStorageReader, OrtStorageWriter

    class FileSystemWriter(OrtStorageWriter):
        """``FileSystemWriter``'s arguments, onto ours: ``overwrite`` and ``thread_count`` mean the same; the rest
        are options our writer has no use for (docs/dcp.md says why), accepted so that the tests construct it."""

        def __init__(self, path: str | os.PathLike[str], single_file_per_rank: bool = True, sync_files: bool = True,
                     thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000,
                     cache_staged_state_dict: bool = False, overwrite: bool = True, _extensions: Any = None,
                     serialization_format: Any = None, **kwargs: Any) -> None:
            super().__init__(path, overwrite=overwrite, thread_count=thread_count)

    class FileSystemReader(OrtStorageReader):
        """``FileSystemReader``'s arguments, onto ours (extensions are never needed: we write none)."""

        def __init__(self, path: str | os.PathLike[str], _extension_registry: Any = None, **kwargs: Any) -> None:
            super().__init__(path)

    stock = {
        "FileSystemWriter": dcp.FileSystemWriter,
        "_FileSystemWriter": torch.distributed.checkpoint.filesystem._FileSystemWriter,
        "FileSystemReader": dcp.FileSystemReader,
    }
    ours = {"FileSystemWriter": FileSystemWriter, "_FileSystemWriter": FileSystemWriter,
            "FileSystemReader": FileSystemReader}
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed.checkpoint") or module is None:
            continue
        for attr, cls in stock.items():
            if getattr(module, attr, None) is cls:
                setattr(module, attr, ours[attr])


def _gate_gpus(lift: bool) -> None:
    """``skip_if_lt_x_gpu`` as unittest's own skip (seen by the runner before ``setUp`` spawns the ranks), or,
    ``lift``, as nothing."""
    import unittest

    import torch
    import torch.testing._internal.common_distributed as common_distributed
    import torch.testing._internal.distributed._tensor.common_dtensor as common_dtensor

    def skip_if_lt_x_gpu(n: int) -> Any:
        if lift:
            return lambda func: func
        return unittest.skipIf(torch.cuda.device_count() < n, f"Need at least {n} CUDA devices")

    for module in (common_distributed, common_dtensor):
        module.skip_if_lt_x_gpu = skip_if_lt_x_gpu  # type: ignore[attr-defined]


if os.environ.get("UPSTREAM_DCP_STORAGE") in ("ours", "stock"):
    _gate_gpus(lift=os.environ.get("UPSTREAM_DCP_CPU") == "1")
if os.environ.get("UPSTREAM_DCP_STORAGE") == "ours":
    _swap()
