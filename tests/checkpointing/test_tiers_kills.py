"""A 2-rank job killed with SIGKILL resumes from the fast tier bit for bit (issue 39).

2 CPU ranks on gloo, started as a launcher starts them (``helpers.launching.start_ranks``), fit 12 steps with
``OrtCheckpoint(persistent, every_n_train_steps=4, local=LocalTier(fast, every_n_train_steps=1, keep=2))`` under
``DDPStrategy`` (rank 0 writes one file) or ``ModelParallelStrategy`` (FSDP2: a folder of each rank's shards). The
ranks draw random numbers of their own every step (under DDP too, where rank 0 writes every rank's random states
into its file) and shuffle through the ``DistributedSampler``, so a resume that misses a rank's random state or a
data position differs. Once both ranks said they are at step 6, the test SIGKILLs both (no handler runs, the kill
lands wherever the ranks are: a step, a save, a background write; a rank that reaches step 8 waits there, so that
the kill always comes before the fit ends). A relaunch with ``fit(ckpt_path="last")`` starts both ranks from the
fast tier, at most one step before the kill (a fit may have finished a step more than it said), and ends in the
state of an uninterrupted fit, bit for bit (module and optimizer). The lost work over many kills is measured by
``benchmarks/tiers_ranks.py``.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from helpers.launching import DDP_NET, NOISY, SHARDED_NET, start_ranks
from helpers.signals import RECORD, assert_same_state, finish, until_both

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = f"""
import json, os, sys, warnings
sys.path.insert(0, {TESTS_DIR!r})  # helpers/
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from pytorch_lightning.strategies import DDPStrategy, ModelParallelStrategy
from lightning_ort_ckpt import LocalTier, OrtCheckpoint
from helpers.signals import Waits

root, phase, strategy, async_save = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
warnings.simplefilter("ignore")

""" + DDP_NET + SHARDED_NET + NOISY + """

""" + RECORD + """

def fit(where, callbacks, ckpt_path=None):
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    callback = OrtCheckpoint(os.path.join(where, "persistent"), every_n_train_steps=4, save_top_k=-1,
                             async_save=async_save, local=LocalTier(os.path.join(where, "fast"), 1, keep=2))
    if strategy == "ddp":
        how, net = DDPStrategy(), type("Model", (Noisy, Net), {})
    else:
        how = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        net = type("Model", (Noisy, ShardedNet), {})
    trainer = pl.Trainer(max_steps=12, accelerator="cpu", devices=2, strategy=how, logger=False,
                         callbacks=[*callbacks, callback], enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    trainer.fit(net(), loader, ckpt_path=ckpt_path)


if phase == "first":
    fit(root, [Waits({8: "sigterm"})])  # held at step 8 (no SIGTERM comes): the kill lands in steps 6 to 8
else:
    fit(root, [Record("last")], ckpt_path="last")
    fit(os.path.join(root, "reference"), [Record("reference")])
print("finished", flush=True)
"""

KILL_AT = 6


@pytest.mark.parametrize("strategy", ["ddp", "mp"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_killed_two_rank_job_resumes_from_the_fast_tier_bit_for_bit(tmp_path: Path, strategy: str,
                                                                     async_save: bool) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    args = [str(tmp_path), "first", strategy, str(int(async_save))]
    procs, out = start_ranks(script, args, 2, PYTHONWARNINGS="ignore"), [[], []]
    try:
        until_both(procs, f"training {KILL_AT}", out)
        for p in procs:  # the whole job, as a scheduler kills it
            p.send_signal(signal.SIGKILL)
    finally:
        finish(procs, out)
    text = "".join(out[0] + out[1])
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2, text
    args[1] = "last"
    procs, out = start_ranks(script, args, 2, PYTHONWARNINGS="ignore"), [[], []]
    finish(procs, out)
    starts = set()
    for r, p in enumerate(procs):
        assert p.returncode == 0, "".join(out[r])
        got = json.loads((tmp_path / f"last.rank{r}.json").read_text())
        assert os.path.dirname(got["ckpt_path"]) == str(tmp_path / "fast"), got
        assert KILL_AT - 1 <= got["start"] <= 8 and got["end"] == 12, got
        starts.add(got["start"])
    assert len(starts) == 1, starts  # both ranks from the same step
    assert_same_state(tmp_path / "last.pt", tmp_path / "reference.pt")
