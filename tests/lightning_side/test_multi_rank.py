"""Several ranks and nodes (issue 26, point 5), and checkpoint folders in the callback's listing and retention.

The multi-node runs start two processes on 127.0.0.1, one per "node", with the variables a cluster's launcher sets
(``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``WORLD_SIZE``, ``LOCAL_RANK=0``): each runs
``Trainer(num_nodes=2, devices=1, strategy="ddp")`` on CPU (gloo), as Lightning's ``LightningEnvironment`` expects
processes a launcher created. Checked:

* a shared ``dirpath``: both ranks list the same files; ``ckpt_path="last"`` is resolved by rank 0 alone (it reads
  the chosen file once, rank 1 reads it once, for its load) and both ranks resume from it; where the newest file is
  damaged, rank 1 does not read it and loads the file rank 0 fell back to;
* a node-local ``dirpath`` (a ``memory://`` URL is one file system per process, as a local disk is one per node; or
  a directory per node): both ranks fail with one clear ``CheckpointConfigError`` at setup, before any training step
  or save, within the time limit: no silent restart from step 0, no half checkpoint, no hang.

Single process: a half-written checkpoint folder (no metadata) is skipped by "last" with a warning naming it and
deleted after the next save; a committed folder is one checkpoint for "last"; retention deletes a folder whole (no
hidden ``.old`` folder stays), locally and on ``memory://``, and a folder a killed process left hidden is swept.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import fsspec
import pytest
import pytorch_lightning as pl
import torch

from lightning_ort_ckpt import OrtCheckpoint, OrtCheckpointIO
from lightning_ort_ckpt._dcp._dcp_storage import METADATA_NAME, is_sharded_checkpoint, save_sharded
from lightning_ort_ckpt._restore._reading import read_lightning_checkpoint
from lightning_ort_ckpt.errors import CheckpointWarning
from lightning_ort_ckpt.format import open_checkpoint
from lightning_ort_ckpt.format import _atomic
from lightning_ort_ckpt.format._atomic import wait_for_cleanup

SCRIPT = r'''
import json, os, sys, warnings
warnings.filterwarnings("ignore")
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning_ort_ckpt._restore._resume as resume_module
import lightning_ort_ckpt._plugin as plugin_module
from lightning_ort_ckpt import OrtCheckpoint
from lightning_ort_ckpt.errors import CheckpointConfigError

READS = []  # the file names this process read in full (verified), in order


def counted(real):
    def read_contents(path, store=None):
        READS.append(os.path.basename(str(path)))
        return real(path, store)
    return read_contents


resume_module.read_contents = counted(resume_module.read_contents)
plugin_module.read_contents = counted(plugin_module.read_contents)


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class Record(pl.Callback):
    def __init__(self):
        self.record = {}

    def on_train_start(self, trainer, pl_module):
        self.record.update(start_step=trainer.global_step, ckpt_path=trainer.ckpt_path,
                           start_weights={k: v.tolist() for k, v in pl_module.state_dict().items()})

    def on_fit_end(self, trainer, pl_module):
        cb = trainer.checkpoint_callback
        self.record.update(end_step=trainer.global_step, listing=sorted(n for n in os.listdir(cb.dirpath) if not n.startswith(".")),
                           last_model_path=cb.last_model_path, world_size=trainer.world_size,
                           rank=trainer.global_rank, node=trainer.node_rank)


out, name, dirpath, max_steps, ckpt_path, save_last = sys.argv[1:7]
node = os.environ["NODE_RANK"]
dirpath = dirpath.replace("NODE", node)
pl.seed_everything(0)
g = torch.Generator().manual_seed(0)
x = torch.randn(32, 4, generator=g)
record = Record()
trainer = pl.Trainer(num_nodes=2, devices=1, strategy="ddp", accelerator="cpu", max_steps=int(max_steps),
                     logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                     callbacks=[record, OrtCheckpoint(dirpath, every_n_train_steps=2, save_top_k=-1,
                                                      save_last="link" if save_last == "link" else True,
                                                      enable_version_counter=save_last != "link")])
try:
    trainer.fit(Net(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4),
                ckpt_path=ckpt_path or None)
except CheckpointConfigError as e:
    record.record["error"] = str(e)
except Exception as e:  # a failed link: recorded, on every rank
    record.record["failure"] = f"{type(e).__name__}: {e}"
record.record["reads"] = READS
with open(os.path.join(out, f"{name}.node{node}.json"), "w") as f:
    json.dump(record.record, f)
# As a DDP program should end: left to the interpreter's exit, gloo's threads can abort the process
# ("terminate called without an active exception") when the other rank has already gone.
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp: Path, name: str, dirpath: str, max_steps: int, ckpt_path: str = "", save_last: str = "true",
            timeout: float = 900) -> tuple[list[dict[str, Any]], float]:
    """Both "nodes" of one run; each one's record, and the seconds the run took."""
    script = tmp / "node.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if k not in ("GLOBAL_RANK", "RANK", "PL_GLOBAL_SEED")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2", LOCAL_RANK="0",
               PYTHONWARNINGS="ignore")
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp), name, dirpath, str(max_steps), ckpt_path,
                               save_last],
                              env={**env, "NODE_RANK": str(node)}, cwd=str(tmp), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail(f"the two-node run {name} hung (over {timeout} s)")
    took = time.monotonic() - start
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]
    return [json.loads((tmp / f"{name}.node{node}.json").read_text()) for node in (0, 1)], took


def _step_file(step: int) -> str:
    return f"epoch=0-step={step}.ckpt"


def _weights(path: Path) -> dict[str, Any]:
    return {k: v.tolist() for k, v in read_lightning_checkpoint(path)["state_dict"].items()}


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step run of two nodes on a shared dirpath (saves at steps 2 and 4, and last.ckpt); a copy of what it
    left is kept in ``first``, untouched by the tests that resume."""
    tmp = tmp_path_factory.mktemp("nodes")
    ranks, _ = _launch(tmp, "first", str(tmp / "shared"), 4)
    assert [(r["rank"], r["node"], r["world_size"]) for r in ranks] == [(0, 0, 2), (1, 1, 2)]
    assert ranks[0]["listing"] == ranks[1]["listing"] == sorted([_step_file(2), _step_file(4), "last.ckpt"])
    assert ranks[0]["last_model_path"] == ranks[1]["last_model_path"] == str(tmp / "shared" / "last.ckpt")
    shutil.copytree(tmp / "shared", tmp / "first", symlinks=True)
    return tmp


def test_shared_dirpath_resumes_from_last_read_once_by_rank_zero(first: Path) -> None:
    ranks, _ = _launch(first, "resumed", str(first / "shared"), 8, "last")
    chosen = ranks[0]["ckpt_path"]
    assert os.path.basename(chosen) in {"last.ckpt", _step_file(4)} and ranks[1]["ckpt_path"] == chosen
    assert [r["start_step"] for r in ranks] == [4, 4] and [r["end_step"] for r in ranks] == [8, 8]
    for r in ranks:  # every rank loaded the file rank 0 chose
        assert r["start_weights"] == _weights(first / "first" / os.path.basename(chosen)), r["node"]
    # rank 0: one full read, to resolve "last", held for its load; rank 1: one, its load (no read to resolve)
    assert ranks[0]["reads"] == ranks[1]["reads"] == [os.path.basename(chosen)]
    assert ranks[0]["listing"] == ranks[1]["listing"]


def test_rank_one_loads_the_file_rank_zero_fell_back_to(first: Path) -> None:
    """The newest file is damaged: rank 0 reads it, warns and resumes from the next newest; rank 1 never reads the
    damaged file (it resolves nothing itself) and loads rank 0's choice, which both Trainers name as their
    ``ckpt_path``."""
    directory = first / "damaged"
    shutil.copytree(first / "first", directory, symlinks=True)
    for name in ("last.ckpt", "last.ckpt.data"):
        if os.path.lexists(directory / name):
            os.remove(directory / name)
    newest = directory / _step_file(4)
    with open_checkpoint(newest) as reader:  # a byte of a tensor: the file lists fine, its full read fails
        offset = reader.trainable["layer.weight"].offset
    raw = bytearray(newest.read_bytes())
    raw[offset] ^= 0xFF
    newest.write_bytes(bytes(raw))
    os.utime(newest, (time.time() + 60, time.time() + 60))  # the newest, whatever the copy's times
    ranks, _ = _launch(first, "fell-back", str(directory), 6, "last")
    assert ranks[0]["reads"][:2] == [_step_file(4), _step_file(2)], ranks[0]["reads"]
    assert ranks[1]["reads"] == [_step_file(2)], ranks[1]["reads"]
    assert [os.path.basename(r["ckpt_path"]) for r in ranks] == [_step_file(2)] * 2  # each Trainer names it
    assert [r["start_step"] for r in ranks] == [2, 2] and [r["end_step"] for r in ranks] == [6, 6]
    for r in ranks:
        assert r["start_weights"] == _weights(first / "first" / _step_file(2)), r["node"]


def test_node_local_dirpath_fails_clearly_at_setup(first: Path) -> None:
    """``memory://`` is one file system per process: the same dirpath names another place on each "node"."""
    ranks, took = _launch(first, "memory", "memory://node-local/ckpts", 4)
    for r in ranks:
        assert "not one directory for all ranks" in r["error"] and "global rank(s) 1 (node 1)" in r["error"], r
        assert "start_step" not in r, "training started"
    print(f"node-local dirpath: both ranks failed {took:.1f} s after launch")


def test_node_local_dirpath_never_restarts_from_step_zero(first: Path) -> None:
    """A directory per node: node 0 has the checkpoints, node 1 an empty folder. Resuming from "last" fails on both
    ranks before any step (node 1 alone would have started again at step 0)."""
    shutil.copytree(first / "first", first / "node0", symlinks=True)
    (first / "node1").mkdir()
    ranks, _ = _launch(first, "per-node", str(first / "nodeNODE"), 8, "last")
    for r in ranks:
        assert 'ckpt_path="last"' in r["error"] and "global rank(s) 1" in r["error"], r
        assert "start_step" not in r, "training started"
    assert "(this rank: none)" in ranks[1]["error"]
    assert sorted(os.listdir(first / "node1")) == []  # nothing written on node 1


def test_a_link_that_fails_on_rank_zero_fails_on_every_rank(first: Path) -> None:
    """``save_last="link"`` where ``last.ckpt`` cannot be replaced (a non-empty folder of that name): rank 0's
    error, and rank 1 raises too instead of waiting for rank 0 at the barrier after the link."""
    directory = first / "link"
    (directory / "last.ckpt" / "inside").mkdir(parents=True)
    ranks, _ = _launch(first, "link", str(directory), 4, save_last="link")
    assert ranks[0]["failure"].startswith(f"CheckpointSaveError: {directory / 'last.ckpt'}: cannot link it to"), \
        ranks[0]["failure"]
    assert ranks[1]["failure"].startswith("CheckpointSaveError") and "global rank 0 could not link" in \
        ranks[1]["failure"], ranks[1]


# -- one process: checkpoint folders ------------------------------------------------------------------------------
class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g)),
                                           batch_size=4)


def _trainer(dirpath: str, max_steps: int) -> pl.Trainer:
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False,
                      callbacks=[OrtCheckpoint(dirpath, every_n_train_steps=2, save_top_k=-1)])


def _dirpath(tmp_path: Path, where: str) -> str:
    return str(tmp_path / "ckpts") if where == "local" else f"memory://folders-{tmp_path.name}/ckpts"


def _everything(dirpath: str) -> list[str]:
    """Every entry below ``dirpath``, hidden ones and folders included."""
    fs, root = fsspec.core.url_to_fs(dirpath)
    prefix = root.rstrip("/") + "/"
    return sorted(p[len(prefix):] for p in fs.find(root, withdirs=True) if p.startswith(prefix))


def _folder(dirpath: str, name: str, committed: bool) -> str:
    """A checkpoint folder: a sharded save's (``committed``), or one whose save did not finish (a shard file and no
    metadata); either with a ``.ckpt`` file in a sub-folder, which is no checkpoint of its own."""
    fs, root = fsspec.core.url_to_fs(dirpath)
    folder = f"{root}/{name}"
    if committed:
        save_sharded({"layer": {"weight": torch.ones(3, 4)}, "global_step": 4}, f"{dirpath}/{name}")
    else:
        fs.makedirs(folder, exist_ok=True)
        fs.pipe_file(f"{folder}/shard-0000000000000000-00000.odtc", b"shard 0" * 100)
    fs.makedirs(f"{folder}/nested", exist_ok=True)
    fs.pipe_file(f"{folder}/nested/x.ckpt", b"a file inside a checkpoint is no checkpoint")
    return f"{dirpath}/{name}"


@pytest.mark.parametrize("where", ["local", "memory"])
def test_half_written_folder_is_skipped_by_last_and_deleted_after_the_next_save(tmp_path: Path, where: str) -> None:
    dirpath = _dirpath(tmp_path, where)
    _trainer(dirpath, 4).fit(_Tiny())
    half = _folder(dirpath, "epoch=0-step=5.ckpt", committed=False)
    if where == "local":
        os.utime(half, (time.time() + 60, time.time() + 60))  # the newest entry
    trainer = _trainer(dirpath, 6)
    with pytest.warns(CheckpointWarning, match=r"epoch=0-step=5\.ckpt: checkpoint folder\(s\) without "
                                               r"checkpoint\.ort-meta \(a save that did not finish\)"):
        trainer.fit(_Tiny(), ckpt_path="last")
    assert trainer.ckpt_path == f"{dirpath}/{_step_file(4)}" and trainer.global_step == 6
    wait_for_cleanup()
    assert _everything(dirpath) == [_step_file(2), _step_file(4), _step_file(6)]  # no hidden leftover either


def test_last_takes_a_committed_folder_as_one_checkpoint(tmp_path: Path) -> None:
    """The newest entry is a committed checkpoint folder: "last" is the folder (the strategy that wrote it loads
    it), not a file inside it, and no IsADirectoryError."""
    dirpath = _dirpath(tmp_path, "local")
    _trainer(dirpath, 2).fit(_Tiny())
    folder = _folder(dirpath, "epoch=0-step=4.ckpt", committed=True)
    os.utime(folder, (time.time() + 60, time.time() + 60))
    callback = OrtCheckpoint(dirpath)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        assert callback._find_last_checkpoints(trainer) == {folder}
    # a newer folder whose metadata is damaged is skipped, with a warning naming it, and kept
    damaged = _folder(dirpath, "epoch=0-step=6.ckpt", committed=True)
    Path(damaged, METADATA_NAME).write_text("{}")
    os.utime(Path(damaged, METADATA_NAME), (time.time() + 120, time.time() + 120))
    with pytest.warns(CheckpointWarning, match=r"epoch=0-step=6\.ckpt cannot be resumed from \(a checkpoint folder "
                                               r"whose checkpoint\.ort-meta is damaged\)"):
        assert callback._find_last_checkpoints(trainer) == {folder}
    assert callback._preservation.ledger.waiting == set() and os.path.isdir(damaged)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_retention_deletes_a_checkpoint_folder_whole(tmp_path: Path, where: str) -> None:
    """The plugin's remove_checkpoint (what retention calls) takes the folder and everything in it; no hidden copy
    stays (it used to stay as ``.<name>.<token>.old`` for good)."""
    dirpath = _dirpath(tmp_path, where)
    _folder(dirpath, "epoch=0-step=2.ckpt", committed=True)
    kept = _everything(dirpath)
    gone = _folder(dirpath, "epoch=0-step=4.ckpt", committed=True)
    assert len(_everything(dirpath)) == 2 * len(kept) and is_sharded_checkpoint(gone)
    OrtCheckpointIO().remove_checkpoint(gone)
    assert not is_sharded_checkpoint(gone)
    wait_for_cleanup()
    assert _everything(dirpath) == kept


def test_a_folder_a_killed_process_left_hidden_is_swept_by_the_next_save(tmp_path: Path) -> None:
    """A crash between the removal's rename and the deletion leaves the folder under its hidden name: the next save
    in the directory deletes it (the process that hid it is gone)."""
    dirpath = _dirpath(tmp_path, "local")
    os.makedirs(dirpath)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    token = f"{_atomic._HOST}-{_atomic._BOOT}.{int(dead.stdout)}.0123abcd"
    hidden = _atomic._hidden_name(os.path.join(dirpath, "epoch=0-step=4.ckpt"), token, "old")
    os.makedirs(os.path.join(hidden, "nested"))
    Path(hidden, "nested", "shard.odtc").write_bytes(b"x" * 1000)
    _trainer(dirpath, 2).fit(_Tiny())
    wait_for_cleanup()
    assert _everything(dirpath) == [_step_file(2)]


def test_stores_delete_the_metadata_file_of_a_folder_first() -> None:
    """The stores know the file that commits a checkpoint folder (the format layer cannot import its owner)."""
    assert _atomic.FOLDER_COMMIT_NAME == METADATA_NAME


def test_lightnings_last_resolution_takes_a_committed_folder_on_memory(tmp_path: Path) -> None:
    """F1 on ``memory://`` (one process: a memory file system is per process): Lightning's own rule asks the file
    system for each candidate's modification time, which a folder there does not have: the callback answers with a
    local file dated as the committed folder (not the half one), and the Trainer's load of it loads the folder."""
    from pytorch_lightning.trainer.states import TrainerFn

    dirpath = _dirpath(tmp_path, "memory")
    folder = _folder(dirpath, "epoch=0-step=4.ckpt", committed=True)
    _folder(dirpath, "epoch=0-step=6.ckpt", committed=False)
    fs, root = fsspec.core.url_to_fs(folder)
    with pytest.raises(OSError):
        fs.modified(root)  # what Lightning's rule would ask
    callback = OrtCheckpoint(dirpath)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[callback])
    with pytest.warns(CheckpointWarning, match=r"epoch=0-step=6\.ckpt: checkpoint folder\(s\) without"):
        found = trainer._checkpoint_connector._parse_ckpt_path(TrainerFn.FITTING, "last", model_provided=True,
                                                               model_connected=True)
    assert os.path.isfile(found) and os.path.basename(found) == "epoch=0-step=4.ckpt"  # a local stand-in
    loads: list[str] = []
    wrap = callback._stand_in.loading(trainer, None)
    assert not os.path.exists(found) and wrap is not None  # deleted once Lightning dated it
    assert wrap(lambda path: loads.append(path))(found) is None and loads == [folder]
    assert trainer.ckpt_path == folder
