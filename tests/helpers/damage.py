"""Damage on purpose: one bit of a file flipped, a checkpoint copied with one tensor's last byte damaged
(tests/format/test_checksums.py, tests/checkpointing/test_tiers.py)."""

from __future__ import annotations

import os
from pathlib import Path

from lightning_ort_ckpt.format import open_checkpoint


def flip(path: str | os.PathLike[str], offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def damaged_copy(src: Path, dst: Path, tensor: str = "layer.weight") -> Path:
    dst.write_bytes(src.read_bytes())
    with open_checkpoint(dst) as reader:
        info = reader.trainable[tensor]
    flip(dst, info.offset + info.nbytes - 1, 3)
    return dst


FLIP_A_SHARD_BYTE = r'''
def flip_a_shard_byte(folder):
    """One byte inside the largest tensor of the first shard file of a sharded checkpoint folder, flipped."""
    shard = sorted(glob.glob(os.path.join(folder, "shard-*.odtc")))[0]
    with open_checkpoint(shard) as reader:
        info = max(reader.tensors(), key=lambda t: t.nbytes)
        raw = reader.numpy(info).tobytes()
    data = bytearray(open(shard, "rb").read())
    data[data.find(raw) + 3] ^= 0xFF
    with open(shard, "wb") as f:
        f.write(data)
'''
"""For the rank scripts, as script text (it needs ``glob``, ``os`` and ``open_checkpoint`` imported)."""
