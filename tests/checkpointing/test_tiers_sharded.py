"""The fast tier with 2 ranks: 2 CPU processes (gloo), launched as users launch them.

``ModelParallelStrategy`` (FSDP2): one launch, three fits in the same two processes (each rank records what it
saw). Fit 1 trains 6 steps with ``OrtCheckpoint(persistent, every_n_train_steps=4, local=LocalTier(fast, 1,
keep=2))``: the fast tier holds the sharded folders of steps 5 and 6, each committed by its metadata, ``dirpath`` the
folder of step 4. Fit 2 resumes with ``ckpt_path="last"``: both ranks start at step 6 from the fast tier. Then rank
0 flips a byte of a tensor in a shard of the fast tier's newest folder (step 8); fit 3 resumes with "last": the load
fails on the checksum and every rank falls back together to the next newest checkpoint of any tier: ``dirpath``'s
folder of step 8.

DDP, async: the persistent save of step 4 is promoted (one save on every rank alike), and "last" resumes both ranks
from the fast tier.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from helpers.damage import FLIP_A_SHARD_BYTE
from helpers.launching import DDP_NET, SHARDED_NET, launch_script
from lightning_ort_ckpt import load_checkpoint

SCRIPT = r'''
import glob, json, os, sys, warnings
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from pytorch_lightning.strategies import ModelParallelStrategy
from lightning_ort_ckpt import LocalTier, OrtCheckpoint, open_checkpoint


''' + SHARDED_NET + r'''
Net = ShardedNet


class Record(pl.Callback):
    def __init__(self, name, after=None):
        self.name, self.after, self.start, self.ckpt_path = name, after, None, None

    def on_train_start(self, trainer, pl_module):
        self.start, self.ckpt_path = trainer.global_step, trainer.ckpt_path and str(trainer.ckpt_path)

    def on_fit_end(self, trainer, pl_module):
        trainer.strategy.barrier()
        listing = {d: sorted(os.listdir(os.path.join(OUT, d))) for d in ("fast", "persistent")}
        if self.after is not None and trainer.is_global_zero:
            self.after()
        trainer.strategy.barrier()
        with open(os.path.join(OUT, f"{self.name}.rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"start": self.start, "ckpt_path": self.ckpt_path, "end": trainer.global_step,
                       "listing": listing}, f)


def fit(name, max_steps, ckpt_path=None, after=None):
    pl.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    callback = OrtCheckpoint(os.path.join(OUT, "persistent"), every_n_train_steps=4, save_top_k=-1,
                             local=LocalTier(os.path.join(OUT, "fast"), every_n_train_steps=1, keep=2))
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=2, logger=False,
                         strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                         callbacks=[Record(name, after), callback], enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(Net(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4), ckpt_path=ckpt_path)


''' + FLIP_A_SHARD_BYTE + r'''

def flip_a_tensor_byte():
    flip_a_shard_byte(os.path.join(OUT, "fast", "step=8.ckpt"))


OUT = sys.argv[1]
warnings.simplefilter("ignore")
fit("first", 6)
fit("last", 8, ckpt_path="last", after=flip_a_tensor_byte)
fit("fallback", 9, ckpt_path="last")
'''


def record(tmp_path: Path, name: str, rank: int) -> dict[str, Any]:
    return json.loads((tmp_path / f"{name}.rank{rank}.json").read_text())


def test_the_fast_tier_holds_sharded_folders_and_every_rank_resumes_from_it(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    launch_script(script, [str(tmp_path)], "the sharded fast-tier runs", 600)
    fast = tmp_path / "fast"
    for rank in (0, 1):
        first = record(tmp_path, "first", rank)
        assert first["listing"] == {"fast": ["step=5.ckpt", "step=6.ckpt"], "persistent": ["epoch=0-step=4.ckpt"]}
        last = record(tmp_path, "last", rank)
        assert (last["start"], last["ckpt_path"], last["end"]) == (6, str(fast / "step=6.ckpt"), 8)
        assert last["listing"]["fast"] == ["step=7.ckpt", "step=8.ckpt"]
        fallback = record(tmp_path, "fallback", rank)
        # the next newest checkpoint of any tier: dirpath saved step 8 too
        assert (fallback["start"], fallback["ckpt_path"]) == (8, str(tmp_path / "persistent" / "epoch=0-step=8.ckpt"))
    for folder in ("step=5.ckpt", "step=6.ckpt"):
        assert not (fast / folder).exists()  # rotated out by the later fits


DDP_SCRIPT = r'''
import json, os, sys, warnings
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning_ort_ckpt import LocalTier, OrtCheckpoint

''' + DDP_NET + r'''

class Record(pl.Callback):
    def __init__(self, name):
        self.name, self.saves = name, {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.saves[trainer.global_step] = self.saves.get(trainer.global_step, 0) + 1

    def on_train_start(self, trainer, pl_module):
        self.start, self.ckpt_path = trainer.global_step, trainer.ckpt_path and str(trainer.ckpt_path)

    def write(self, rank):  # after fit: every queued save and deletion of this rank is done
        with open(os.path.join(OUT, f"{self.name}.rank{rank}.json"), "w") as f:
            json.dump({"start": self.start, "ckpt_path": self.ckpt_path, "saves": self.saves,
                       "fast": sorted(os.listdir(os.path.join(OUT, "fast")))}, f)


def fit(name, max_steps, ckpt_path=None):
    pl.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    callback = OrtCheckpoint(os.path.join(OUT, "persistent"), every_n_train_steps=4, save_top_k=-1, async_save=True,
                             local=LocalTier(os.path.join(OUT, "fast"), every_n_train_steps=1, keep=2))
    record = Record(name)
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                         callbacks=[record, callback], enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(Net(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4), ckpt_path=ckpt_path)
    record.write(trainer.global_rank)


OUT = sys.argv[1]
warnings.simplefilter("ignore")
fit("first", 6)
fit("last", 8, ckpt_path="last")
'''


def test_ddp_promotes_on_every_rank_alike_and_resumes_from_the_fast_tier(tmp_path: Path) -> None:
    """DDP: rank 0 writes, every rank takes part in each save's barrier. The promoted step 4 is one save on both
    ranks (a rank that saved again alone would wait in a barrier the other never enters: the launch would hang)."""
    script = tmp_path / "train.py"
    script.write_text(DDP_SCRIPT)
    launch_script(script, [str(tmp_path)], "the DDP fast-tier runs", 600)
    for rank in (0, 1):
        first = record(tmp_path, "first", rank)
        assert first["saves"] == {str(s): 1 for s in range(1, 7)}  # step 4's persistent save is the fast one
        if rank == 0:  # the rank that writes and deletes, once its fit returned
            assert first["fast"] == ["step=5.ckpt", "step=6.ckpt"]
        last = record(tmp_path, "last", rank)
        assert (last["start"], last["ckpt_path"]) == (6, str(tmp_path / "fast" / "step=6.ckpt"))
    load_checkpoint(tmp_path / "persistent" / "epoch=0-step=4.ckpt")
