"""SLURM's requeue signal under a sharded strategy: 2 ranks of ``ModelParallelStrategy`` (FSDP2, gloo, CPU) launched
as ``srun`` would (the SLURM variables of each task), ``SLURMEnvironment(auto_requeue=True)``, a stand-in
``scontrol`` on ``PATH`` (the only fake).

SIGUSR1 to both ranks at step 4: Lightning's handler saves ``hpc_ckpt_1.ckpt`` through our plugin on every rank, a
sharded folder (each rank's shards, committed by its metadata), durable before the handler requeues the job, also
with ``async_save=True``. Then either SIGKILL at step 5 (the job ends before anything newer is saved: "last" is the
hpc folder) or SIGTERM at step 6 (the fast tier saves the step Lightning stops at: "last" is that newer folder). A
relaunch with ``fit(ckpt_path="last")`` resumes every rank from it, and ends in the state of an uninterrupted fit,
bit for bit (module and optimizer).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from helpers.launching import NOISY, SHARDED_NET, free_port
from lightning_ort_ckpt.format._store import store_for
from lightning_ort_ckpt._restore._registry import State, scan
from helpers.signals import RECORD, assert_same_state, finish, interrupted_at, scontrol, until_both

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

_RANKS = f"""
import json, os, sys, time, warnings
sys.path[:0] = [{TESTS_DIR!r}, {os.path.dirname(TESTS_DIR)!r}]  # this module's folder, and helpers/
import pytorch_lightning as pl
import torch
from pathlib import Path
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from pytorch_lightning.plugins.environments import SLURMEnvironment
from pytorch_lightning.strategies import ModelParallelStrategy
from lightning_ort_ckpt import LocalTier, OrtCheckpoint
from helpers.signals import Waits

root, phase, async_save, waits = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", sys.argv[4]
warnings.simplefilter("ignore")


""" + SHARDED_NET + NOISY + """

class Net(Noisy, ShardedNet):
    pass


""" + RECORD + """

def fit(where, callbacks, ckpt_path=None):
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    callback = OrtCheckpoint(where / "persistent", every_n_train_steps=100, async_save=async_save,
                             local=LocalTier(where / "fast", every_n_train_steps=100))
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", devices=2, num_nodes=1, logger=False,
                         strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                         callbacks=[*callbacks, callback], plugins=[SLURMEnvironment(auto_requeue=True)],
                         default_root_dir=where, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(Net(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4), ckpt_path=ckpt_path)


if phase == "first":
    fit(root, [Waits({int(k): v for k, v in (w.split(":") for w in waits.split(","))})])
else:
    fit(root, [Record("last")], ckpt_path="last")
    fit(root / "reference", [Record("reference")])  # (its own default_root_dir: no hpc folder to resume from)
print("finished", flush=True)
"""


def _start_ranks(tmp_path: Path, phase: str, env: dict[str, str], async_save: bool, waits: str) -> list[Any]:
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(_RANKS))
    common = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "SLURM_NTASKS": "2",
              "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK", "PL_GLOBAL_SEED"):
        common.pop(name, None)
    return [subprocess.Popen([sys.executable, str(script), str(tmp_path), phase, str(int(async_save)), waits],
                             cwd=str(tmp_path), text=True, env={**common, "SLURM_PROCID": str(r),
                                                                "SLURM_LOCALID": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]


@pytest.mark.parametrize("async_save,then", [(False, "kill"), (True, "kill"), (True, "sigterm")],
                         ids=["sync-kill", "async-kill", "async-sigterm"])
def test_sharded_requeue_resumes_every_rank_from_the_newest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            async_save: bool, then: str) -> None:
    with monkeypatch.context() as m:
        log = scontrol(tmp_path, m)
        env = dict(os.environ)
    waits, last_signal = ("4:requeued,5:sigterm", "training 5") if then == "kill" else \
        ("4:requeued,6:sigterm", "training 6")
    procs, out = _start_ranks(tmp_path, "first", env, async_save, waits), [[], []]
    try:
        until_both(procs, "training 4", out)
        for p in procs:
            p.send_signal(signal.SIGUSR1)
        until_both(procs, last_signal, out)
        for p in procs:
            p.send_signal(signal.SIGKILL if then == "kill" else signal.SIGTERM)
    finally:
        finish(procs, out)
    text = "".join(out[0] + out[1])
    assert log.read_text().split() == ["requeue", "4242"], text
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    assert hpc.is_dir(), text  # a sharded folder: every rank's shards
    (entry,) = [e for e in scan(str(tmp_path), store_for(str(tmp_path))) if os.path.basename(e.path) == hpc.name]
    assert entry.state is State.COMMITTED and entry.step == 4, (entry, text)
    if then == "kill":
        assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2, text
        assert not os.listdir(tmp_path / "fast")
        expected_path, expected_start = str(hpc), 4
    else:
        stopped = {interrupted_at("".join(o)) for o in out}
        assert len(stopped) == 1 and stopped <= {6, 7}, text
        step = stopped.pop()
        assert os.listdir(tmp_path / "fast") == [f"step={step}.ckpt"], text
        expected_path, expected_start = str(tmp_path / "fast" / f"step={step}.ckpt"), step
    procs, out = _start_ranks(tmp_path, "last", env, async_save, ""), [[], []]
    finish(procs, out)
    for r, p in enumerate(procs):
        assert p.returncode == 0, "".join(out[r])
        got = json.loads((tmp_path / f"last.rank{r}.json").read_text())
        assert (got["ckpt_path"], got["start"], got["end"]) == (expected_path, expected_start, 8), got
    assert_same_state(tmp_path / "last.pt", tmp_path / "reference.pt")
