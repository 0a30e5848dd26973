"""Our sharded checkpoint storage for ``torch.distributed.checkpoint`` (DCP), for use without Lightning.

Plain FSDP2 loops, torchtitan and other trainers that call DCP themselves pass these in place of DCP's
``FileSystemWriter`` / ``FileSystemReader``::

    import torch.distributed.checkpoint as dcp
    from lightning_ort_ckpt.dcp import OrtStorageReader, OrtStorageWriter

    dcp.save(state, storage_writer=OrtStorageWriter("s3://bucket/run/step-400"))
    dcp.load(state, storage_reader=OrtStorageReader("s3://bucket/run/step-400"))
    future = dcp.async_save(state, storage_writer=OrtStorageWriter(path))   # the step waits for the staging copy

``dcp.save(..., checkpoint_id=other)`` saves to ``other`` with the same writer (``reset``); ``use_collectives=False``
writes one metadata file per rank (loads at the same world size, as DCP's). What they keep that DCP's file-system
storage lacks: no pickle anywhere (tensors in ORT ``CheckpointState`` files, one per rank; the metadata in JSON;
``bytes``, ``io.BytesIO`` and other values such as optimizer ``param_groups`` stored as typed uint8 tensors and
JSON), a checksum on every tensor verified on load, an atomic replace of an existing checkpoint (the new metadata
replaces the old in one step; the old save's files go after it), and any fsspec URL (``storage_options``). Every
difference from ``FileSystemWriter`` is listed, with its reason, in docs/dcp.md.
"""

from __future__ import annotations

from ._dcp._dcp_reader import OrtStorageReader
from ._dcp._dcp_writer import OrtStorageWriter

__all__ = ["OrtStorageReader", "OrtStorageWriter"]
