"""Peer copies of the fast tier (``LocalTier(peer=True)``): 2 CPU processes (gloo, DDP), launched as users launch
them, each rank with a fast folder of its own (``fast0``, ``fast1``: two nodes' local disks on one machine).

Fit 1 trains 6 steps with moto's S3 (through the counting proxy) as the persistent tier, saving step 4 there, and
the fast tier every step (``keep=2``, ``async_save=True``): rank 0 writes steps 5 and 6 in ``fast0``, and its
partner, rank 1, holds verified copies of both in ``fast1/peer-of-rank0/``. Then ``fast0`` is emptied (the node of
rank 0 replaced) and fit 2 resumes with ``ckpt_path="last"``: rank 0 takes step 6 back from rank 1 over the process
group, resumes from it in its own fast folder, and ends bit for bit where an uninterrupted fit of 8 steps ends,
without a single GET of an object from the persistent store; so does a resume with rank 1's folder emptied instead
(it held only rank 0's copies, which it holds again after); a fit that does not resume takes nothing back. With
``peer=False`` no process group is made, and none made for the copies, nor any thread, outlives the fit. With one
process there is no partner: a warning, and the fast tier saves as without peer copies. (A sharded strategy's
folders: test_tiers_peer_sharded.py.)
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from helpers.fits import files_after_fit, fit
from helpers.launching import DDP_NET, launch_script
from helpers.peers import NODES_HEAD, SCRIPT_HEAD, new_bucket, object_reads, record
from lightning_ort_ckpt import LocalTier, OrtCheckpoint, load_checkpoint
from lightning_ort_ckpt.errors import CheckpointConfigError, CheckpointWarning

SCRIPT = SCRIPT_HEAD + DDP_NET + r'''
import torch.distributed as dist

RANK = int(os.environ.get("LOCAL_RANK", "0"))  # one node: the local rank is the global one


def groups():
    return len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0


class Record(pl.Callback):
    def __init__(self):
        self.seen = {}

    def on_train_start(self, trainer, pl_module):
        self.seen.update(start=trainer.global_step, ckpt_path=trainer.ckpt_path and str(trainer.ckpt_path),
                         groups_in_fit=groups())


def fit(name, max_steps, peer=None, ckpt_path=None):
    loader, record = data(), Record()
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                         callbacks=callbacks(record, peer, os.path.join(OUT, name.split("-")[0] + str(RANK))),
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, enable_checkpointing=peer is not None)
    threads = {t.name for t in threading.enumerate()}
    trainer.fit(Net(), loader, ckpt_path=ckpt_path)
    weights = {k: v.flatten().tolist() for k, v in trainer.lightning_module.state_dict().items()}
    with open(os.path.join(OUT, f"{name}.rank{trainer.global_rank}.json"), "w") as f:
        json.dump({**record.seen, "weights": weights, "groups_after": groups(), "end": trainer.global_step,
                   "new_threads": sorted({t.name for t in threading.enumerate()} - threads),
                   "fast_folder": peer and sorted(os.listdir(os.path.join(OUT, "fast" + str(RANK))))}, f)


warnings.simplefilter("ignore")
if PHASE == "first":
    fit("reference", 8)
    fit("off-fit", 6, peer=False)
    fit("fast-fit", 6, peer=True)
elif PHASE == "resume":
    fit("fast-resume", 8, peer=True, ckpt_path="last")
    fit("fast-again", 10, peer=True, ckpt_path="last")  # nothing wiped: each rank's folder as it was left
else:
    fit("fast-fresh", 0, peer=True)  # a fit that does not resume: nothing taken back
    fit("fast-partner", 12, peer=True, ckpt_path="last")
'''


def test_a_wiped_fast_folder_is_restored_from_the_partner_with_no_read_of_the_store(tmp_path: Path,
                                                                                    counted: Any) -> None:
    proxy = counted
    bucket = new_bucket(proxy, "peer", tmp_path)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    launch_script(script, [str(tmp_path), "first", proxy.url, bucket], "the peer-copy fits", 900)

    # (a) rank 1 holds a verified copy of each of rank 0's fast saves, byte for byte; rank 0 holds none of rank 1's
    fast0, fast1 = tmp_path / "fast0", tmp_path / "fast1"
    assert sorted(p.name for p in fast0.iterdir()) == ["step=5.ckpt", "step=6.ckpt"]
    copies = fast1 / "peer-of-rank0"
    assert sorted(p.name for p in fast1.iterdir()) == ["peer-of-rank0"]
    assert sorted(p.name for p in copies.iterdir()) == ["step=5.ckpt", "step=6.ckpt"]
    for name in ("step=5.ckpt", "step=6.ckpt"):
        assert (copies / name).read_bytes() == (fast0 / name).read_bytes()
        load_checkpoint(copies / name)  # every checksum verified
    # (c, d) peer off: no process group beyond the fit's own; peer on: one more, during the fit only; no thread
    # of either outlives the fit
    for rank in (0, 1):
        off, on = record(tmp_path, "off-fit", rank), record(tmp_path, "fast-fit", rank)
        assert on["groups_in_fit"] == off["groups_in_fit"] + 1
        assert on["groups_after"] == off["groups_after"]
        assert on["new_threads"] == []  # (the first fit on S3, peer off, started fsspec's event loop thread)
    assert sorted(p.name for p in (tmp_path / "off0").iterdir()) == ["step=5.ckpt", "step=6.ckpt"]
    assert list((tmp_path / "off1").iterdir()) == []  # rank 1 writes nothing without peer copies

    # (b) rank 0's node replaced: an empty fast folder. "last" takes step 6 back from rank 1, reading no object
    for path in fast0.iterdir():
        path.unlink()
    proxy.requests.clear()
    launch_script(script, [str(tmp_path), "resume", proxy.url, bucket], "the resume from a peer copy", 900)
    assert object_reads(proxy.requests) == [], proxy.requests
    assert any("list-type=" in r for r in proxy.requests)  # it did look at the persistent tier
    resumed = record(tmp_path, "fast-resume", 0)
    assert (resumed["start"], resumed["ckpt_path"], resumed["end"]) == (6, str(fast0 / "step=6.ckpt"), 8)
    for rank in (0, 1):
        assert record(tmp_path, "fast-resume", rank)["start"] == 6
        assert record(tmp_path, "fast-resume", rank)["weights"] == record(tmp_path, "reference", rank)["weights"]
    # and nothing wiped: the fast tier and its copies as they were (nothing to take back), "last" the fast step 8
    again = record(tmp_path, "fast-again", 0)
    assert (again["start"], again["ckpt_path"], again["end"]) == (8, str(fast0 / "step=8.ckpt"), 10)
    assert record(tmp_path, "fast-again", 1)["start"] == 8
    assert sorted(p.name for p in fast0.iterdir()) == ["step=10.ckpt", "step=9.ckpt"]
    assert sorted(p.name for p in copies.iterdir()) == ["step=10.ckpt", "step=9.ckpt"]

    # rank 1's node replaced instead: it held only rank 0's copies. A fit that does not resume takes nothing back;
    # then rank 0 resumes from its own fast tier, reading no object, and rank 1 holds copies again
    shutil.rmtree(fast1)
    fast1.mkdir()
    proxy.requests.clear()
    launch_script(script, [str(tmp_path), "partner", proxy.url, bucket], "the resume with the partner wiped", 900)
    assert record(tmp_path, "fast-fresh", 1)["fast_folder"] == []
    assert record(tmp_path, "fast-fresh", 0)["fast_folder"] == ["step=10.ckpt", "step=9.ckpt"]
    assert object_reads(proxy.requests) == [], proxy.requests
    partner = record(tmp_path, "fast-partner", 0)
    assert (partner["start"], partner["ckpt_path"], partner["end"]) == (10, str(fast0 / "step=10.ckpt"), 12)
    assert sorted(p.name for p in copies.iterdir()) == ["step=11.ckpt", "step=12.ckpt"]


def test_peer_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(CheckpointConfigError, match="LocalTier.peer"):
        LocalTier(tmp_path, peer="yes")  # type: ignore[arg-type]


def test_one_process_warns_and_saves_as_without_peer_copies(tmp_path: Path) -> None:
    fast = tmp_path / "fast"
    tier = LocalTier(fast, every_n_train_steps=2, keep=2, peer=True)
    with pytest.warns(CheckpointWarning, match="no partner rank"):
        fit(OrtCheckpoint(tmp_path / "persistent", every_n_train_steps=4, save_top_k=-1, local=tier), 2)
    assert files_after_fit(fast) == {"step=6.ckpt", "step=8.ckpt"}  # and no peer folder


NODES_SCRIPT = SCRIPT_HEAD + DDP_NET + NODES_HEAD + r'''
class Record(NodeRecord):
    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step in (8, 10):
            self.weights[trainer.global_step] = {k: v.flatten().tolist() for k, v in pl_module.state_dict().items()}


def fit(name, max_steps, peer=None, ckpt_path=None):
    loader, record = data(), Record()
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, num_nodes=2, strategy="ddp",
                         logger=False, default_root_dir=OUT, callbacks=callbacks(record, peer, FAST),
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, enable_checkpointing=peer is not None)
    trainer.fit(Net(), loader, ckpt_path=ckpt_path)
    with open(os.path.join(OUT, f"{name}.rank{trainer.global_rank}.json"), "w") as f:
        json.dump({**record.seen, "weights": record.weights, "end": trainer.global_step,
                   "fast": sorted(os.listdir(FAST)) if os.path.isdir(FAST) else []}, f)


warnings.simplefilter("ignore")
if PHASE == "first":
    fit("nodes-reference", 10)
    fit("nodes-fit", 6, peer=True)
else:
    fit("nodes-resume", 8, peer=True, ckpt_path="last")
    if NODE == 0:  # node 0 replaced: its fast folder empty
        shutil.rmtree(FAST)
    fit("nodes-replaced", 10, peer=True, ckpt_path="last")
'''


def test_ddp_across_two_nodes_resumes_each_node_from_its_own_fast_folder(tmp_path: Path, counted: Any) -> None:
    """DDP, two simulated nodes (one process each, a working directory each, the fast tier at one path that is each
    node's own folder, as ``test_tiers_peer_sharded.py`` launches them). Rank 0 alone writes the fast tier; node 1
    holds copies. At ``setup`` the newest step is committed in node 1's own folder from its copy, so that each node
    resumes from its own folder by the one path rank 0 chose; after node 0 is replaced, it takes the step back from
    node 1. Both resumes are bit for bit the uninterrupted fit, and read no object of the persistent store."""
    from helpers.launching import launch_nodes

    proxy = counted
    bucket = new_bucket(proxy, "peer-nodes", tmp_path)
    script = tmp_path / "train.py"
    script.write_text(NODES_SCRIPT)
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    launch_nodes(script, [str(tmp_path), "first", proxy.url, bucket], nodes, "the DDP fits on two nodes", 900)
    fast0, fast1 = nodes[0] / "fast", nodes[1] / "fast"
    assert sorted(p.name for p in fast0.iterdir()) == ["step=5.ckpt", "step=6.ckpt"]
    assert sorted(p.name for p in fast1.iterdir()) == ["peer-of-rank0"]  # node 1 wrote none, holds copies

    proxy.requests.clear()
    launch_nodes(script, [str(tmp_path), "resume", proxy.url, bucket], nodes, "the DDP resumes on two nodes", 900)
    assert object_reads(proxy.requests) == [], proxy.requests
    for rank in (0, 1):
        reference = record(tmp_path, "nodes-reference", rank)
        resumed, replaced = record(tmp_path, "nodes-resume", rank), record(tmp_path, "nodes-replaced", rank)
        assert (resumed["start"], resumed["ckpt_path"], resumed["end"]) == (6, "/proc/self/cwd/fast/step=6.ckpt", 8)
        assert resumed["weights"]["8"] == reference["weights"]["8"]  # bit for bit
        assert (replaced["start"], replaced["ckpt_path"], replaced["end"]) == \
            (8, "/proc/self/cwd/fast/step=8.ckpt", 10)
        assert replaced["weights"]["10"] == reference["weights"]["10"]
    assert "step=6.ckpt" in record(tmp_path, "nodes-resume", 1)["fast"]  # node 1's own copy of the step resumed
    assert sorted(p.name for p in (fast1 / "peer-of-rank0").iterdir()) == ["step=10.ckpt", "step=9.ckpt"]
