"""The portable I/O path: plain reads and writes, fsync and rename, with every Linux-only trick off.

The round-trip and crash-safety tests that touch files (and the checksum round trip) run on both paths where they
are: the ``io_path`` fixture (``tests/conftest.py``) runs them once as they are and once with
``LIGHTNING_ORT_CKPT_PORTABLE_IO=1``. Here, a test removes the Linux-only calls from ``os``, ``mmap`` and ``ctypes`` altogether, as
on Windows, and checks that a save and a load still give the same bytes through feature detection alone.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest
import torch

from lightning_ort_ckpt.format import (CheckpointContents, OptimizerGroup, load_checkpoint, open_checkpoint, save_checkpoint)
from lightning_ort_ckpt.format import _diskio as diskio
from lightning_ort_ckpt.format._platform import PORTABLE_IO_ENV, portable_io


@pytest.fixture(autouse=True)
def _portable(monkeypatch):
    monkeypatch.setenv(PORTABLE_IO_ENV, "1")
    assert portable_io()


def _state() -> CheckpointContents:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(1024, 1024, generator=g)  # 4 MiB: several write steps and read chunks
    return CheckpointContents(trainable={"w": w, "b": torch.randn(7, generator=g)}, frozen={"n": torch.tensor(5)},
                      optimizer_groups={"group0": OptimizerGroup(2, 1e-3, {"w": {"momentum0": torch.randn_like(w)}})})


def test_the_switch_turns_the_tricks_off(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"x" * (1 << 20))
    with open(path, "r+b", buffering=0) as f:
        assert diskio.WriteBehind.open(f) is None  # no sync_file_range write-behind
    assert type(diskio.fresh_memory(diskio._HUGE_PAGE * 2).base) is not mmap.mmap  # no huge-page mapping


@pytest.mark.parametrize("mode", ["never", "params", "all"])
def test_without_any_linux_only_call(tmp_path, monkeypatch, mode):
    """As on Windows: no preadv, writev, O_NONBLOCK, O_DIRECT, RWF_NOWAIT, posix_fadvise, MADV_HUGEPAGE, and a
    ctypes.CDLL(None) that fails. O_DIRECTORY stays: atomic.py's directory fsync is made portable separately."""
    monkeypatch.delenv(PORTABLE_IO_ENV)  # feature detection alone
    for name in ("preadv", "writev", "O_NONBLOCK", "O_DIRECT", "RWF_NOWAIT", "posix_fadvise"):
        monkeypatch.delattr(os, name, raising=False)
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    monkeypatch.setattr(diskio, "_libc_sync_file_range", None)

    def no_cdll(name, *args, **kwargs):
        if name is None:
            raise TypeError("LoadLibrary() argument 1 must be str, not None")  # what Windows says
        return real_cdll(name, *args, **kwargs)

    real_cdll = ctypes.CDLL
    monkeypatch.setattr(ctypes, "CDLL", no_cdll)
    ck = _state()
    path = tmp_path / "p.ckpt"
    save_checkpoint(ck, path, external_data=mode)
    back = load_checkpoint(path)
    assert torch.equal(back.trainable["w"], ck.trainable["w"]) and torch.equal(back.frozen["n"], ck.frozen["n"])
    assert torch.equal(back.optimizer_groups["group0"].states["w"]["momentum0"],
                       ck.optimizer_groups["group0"].states["w"]["momentum0"])
    with open_checkpoint(path, verify=True) as reader:
        assert np.array_equal(reader.numpy(reader.trainable["w"]), ck.trainable["w"].numpy())
    os.mkfifo(tmp_path / "fifo.ckpt")  # without O_NONBLOCK, stat before open keeps a FIFO from hanging the open
    with pytest.raises(Exception, match="regular file"):
        load_checkpoint(tmp_path / "fifo.ckpt")
