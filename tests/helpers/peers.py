"""What the peer-copy tests share (``test_tiers_peer.py``, ``test_tiers_peer_sharded.py``,
``test_tiers_peer_nodes.py``): the head of their child scripts, and reading back what the ranks recorded, what the
persistent store was asked and what the fast folders hold."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import fsspec

SCRIPT_HEAD = r'''
import json, os, shutil, sys, threading, warnings
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning_ort_ckpt import LocalTier, OrtCheckpoint

OUT, PHASE, ENDPOINT, BUCKET = sys.argv[1:5]
OPTIONS = {"key": "x", "secret": "y", "client_kwargs": {"endpoint_url": ENDPOINT}}


def data():
    """The run's data, after seeding every generator (the module is made next)."""
    pl.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def callbacks(record, peer, fast):
    """``record``, and with ``peer`` (True or False) the callback: S3 every 4 steps, the fast tier every step."""
    if peer is None:
        return [record]
    return [record, OrtCheckpoint(f"s3://{BUCKET}/run", every_n_train_steps=4, save_top_k=-1, async_save=True,
                                  storage_options=OPTIONS,
                                  local=LocalTier(fast, every_n_train_steps=1, keep=2, peer=peer))]

'''
"""Script text: the imports, the arguments every peer script takes (its output folder, its phase, the S3 endpoint
and bucket), its data and its callbacks."""

NODES_HEAD = r'''
NODE = int(os.environ["NODE_RANK"])
FAST = "/proc/self/cwd/fast"  # one path on every node, each node's own folder


class NodeRecord(pl.Callback):  # where a fit started, and its weights at some steps (on_train_batch_end's to say)
    def __init__(self):
        self.seen, self.weights = {}, {}

    def on_train_start(self, trainer, pl_module):
        self.seen.update(start=trainer.global_step, ckpt_path=trainer.ckpt_path and str(trainer.ckpt_path))

'''
"""Script text after :data:`SCRIPT_HEAD` for a simulated node (``helpers.launching.launch_nodes``): its number, the
fast tier's one path, and a record of the fit."""


def record(tmp_path: Path, name: str, rank: int) -> dict[str, Any]:
    """What rank ``rank`` of the fit ``name`` recorded."""
    return json.loads((tmp_path / f"{name}.rank{rank}.json").read_text())


def object_reads(requests: list[str]) -> list[str]:
    """GETs of an object's bytes (a listing is a GET of the bucket: ``list-type=``)."""
    return [r for r in requests if r.startswith("GET ") and "list-type=" not in r and r.split("?")[0].count("/") > 1]


def new_bucket(proxy: Any, prefix: str, tmp_path: Path) -> str:
    """A bucket of this test's own, made through the counting proxy."""
    bucket = f"{prefix}-{os.getpid()}-{id(tmp_path) % 100000}"
    fsspec.filesystem("s3", key="x", secret="y", client_kwargs={"endpoint_url": proxy.url}).mkdir(bucket)
    return bucket


def step_listing(folder: Path) -> dict[str, list[str]]:
    """Each step folder's files, the save id left out (``shard-<id>-00001.odtc`` as ``shard-00001``)."""
    return {d.name: sorted(f.name if not f.name.startswith("shard-") else f"shard-{f.name[-10:-5]}"
                           for f in d.iterdir()) for d in sorted(folder.iterdir()) if d.name.startswith("step=")}
