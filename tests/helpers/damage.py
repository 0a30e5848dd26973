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
