"""Peer copies of a sharded fast tier (``LocalTier(peer=True)`` under ``ModelParallelStrategy``): two simulated
nodes, one CPU process each (gloo), started as a cluster launcher starts them (``NODE_RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``), each in a working directory of its own, so that the fast tier's one path,
``/proc/self/cwd/fast``, is a folder of each node's own, as a node-local disk is.

Fit 1 trains 6 steps with moto's S3 (through the counting proxy) as the persistent tier (a sharded folder every 4
steps) and the fast tier every step (``keep=2``, ``async_save=True``): each node's ``step=N.ckpt`` folder holds its
own rank's shard file, node 0's the metadata too; each rank's partner holds verified copies of its files, byte for
byte, under ``peer-of-rank<r>/``. Then node 0's fast folder is emptied (a replaced machine) and fit 2 resumes with
``ckpt_path="last"``: step 6 is assembled whole in both nodes' folders (node 0's over the group, node 1's from its
own copies), and both ranks resume from it and end bit for bit where an uninterrupted fit does, without a single GET
of an object from the persistent store. Then node 1's folder is emptied and fit 3 resumes from step 8 in the same
way.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any


from helpers.launching import SHARDED_NET, launch_nodes
from helpers.peers import NODES_HEAD, SCRIPT_HEAD, new_bucket, object_reads, record, step_listing
from lightning_ort_ckpt import load_checkpoint

SCRIPT = SCRIPT_HEAD + SHARDED_NET + r'''
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from pytorch_lightning.strategies import ModelParallelStrategy
''' + NODES_HEAD + r'''
class Record(NodeRecord):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step in (6, 8, 10):  # every rank: the full state is gathered collectively
            full = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True,
                                                                                         cpu_offload=True))
            self.weights[trainer.global_step] = {k: v.flatten().tolist() for k, v in full.items()}


def fit(name, max_steps, peer=None, ckpt_path=None):
    loader, record = data(), Record()
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, num_nodes=2, logger=False,
                         strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                         default_root_dir=OUT, callbacks=callbacks(record, peer, FAST), enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         enable_checkpointing=peer is not None)
    trainer.fit(ShardedNet(), loader, ckpt_path=ckpt_path)
    with open(os.path.join(OUT, f"{name}.rank{trainer.global_rank}.json"), "w") as f:
        json.dump({**record.seen, "weights": record.weights, "end": trainer.global_step}, f)


warnings.simplefilter("ignore")
if PHASE == "first":
    fit("reference", 10)
    fit("fast-fit", 6, peer=True)
else:
    fit("fast-resume", 8, peer=True, ckpt_path="last")
    if NODE == 1:  # node 1 replaced: its fast folder empty
        shutil.rmtree(FAST)
    fit("fast-partner", 10, peer=True, ckpt_path="last")
'''


def test_a_wiped_node_takes_its_shards_back_from_the_partner_with_no_read_of_the_store(tmp_path: Path,
                                                                                       counted: Any) -> None:
    proxy = counted
    bucket = new_bucket(proxy, "peer-sharded", tmp_path)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    launch_nodes(script, [str(tmp_path), "first", proxy.url, bucket], nodes, "the sharded peer-copy fits", 900)

    # each node's folder of a step holds its own rank's shards (node 0's the metadata); the partner a copy of them
    fast0, fast1 = nodes[0] / "fast", nodes[1] / "fast"
    meta = "checkpoint.ort-meta"
    steps = ("step=5.ckpt", "step=6.ckpt")
    assert step_listing(fast0) == {s: [meta, "shard-00000"] for s in steps}
    assert step_listing(fast1) == {s: ["shard-00001"] for s in steps}
    assert step_listing(fast1 / "peer-of-rank0") == {s: [meta, "shard-00000"] for s in steps}
    assert step_listing(fast0 / "peer-of-rank1") == {s: ["shard-00001"] for s in steps}
    for own, copies in ((fast0, fast1 / "peer-of-rank0"), (fast1, fast0 / "peer-of-rank1")):
        for step in steps:
            for f in (own / step).iterdir():
                assert (copies / step / f.name).read_bytes() == f.read_bytes(), f
                if f.name.startswith("shard-"):
                    load_checkpoint(copies / step / f.name)  # every checksum verified

    # node 0 replaced: an empty fast folder. "last" is step 6, assembled on both nodes; no object of S3 is read
    shutil.rmtree(fast0)
    fast0.mkdir()
    proxy.requests.clear()
    launch_nodes(script, [str(tmp_path), "resume", proxy.url, bucket], nodes, "the resumes from peer copies", 900)
    assert object_reads(proxy.requests) == [], proxy.requests
    assert any("list-type=" in r for r in proxy.requests)  # it did look at the persistent tier
    for rank in (0, 1):
        resumed, reference = record(tmp_path, "fast-resume", rank), record(tmp_path, "reference", rank)
        assert (resumed["start"], resumed["ckpt_path"], resumed["end"]) == (6, "/proc/self/cwd/fast/step=6.ckpt", 8)
        assert resumed["weights"]["8"] == reference["weights"]["8"]  # bit for bit
        # node 1 replaced after that fit: its folder empty; both resume from step 8, as the fast tier left it
        partner = record(tmp_path, "fast-partner", rank)
        assert (partner["start"], partner["ckpt_path"], partner["end"]) == (8, "/proc/self/cwd/fast/step=8.ckpt", 10)
        assert partner["weights"]["10"] == reference["weights"]["10"]
    # and every folder is rotated to its newest 2 steps, copies included
    assert set(step_listing(fast0)) == set(step_listing(fast1)) == {"step=9.ckpt", "step=10.ckpt"}
    assert set(step_listing(fast1 / "peer-of-rank0")) == set(step_listing(fast0 / "peer-of-rank1")) == \
        {"step=9.ckpt", "step=10.ckpt"}


# -- the plan of a resume's assembly: pure functions of what every rank reported ----------------------------------
META = "checkpoint.ort-meta"


def _report(held: dict[str, dict[str, list[str]]], needs: dict[str, list[str]] | None = None) -> dict[str, Any]:
    return {"held": held, "names": {s: f"step={s}.ckpt" for place in held.values() for s in place},
            "needs": needs or {}}


def test_the_newest_step_held_whole_is_chosen_and_each_missing_file_comes_from_the_nearest_holder() -> None:
    from lightning_ort_ckpt._recovery._peer import plan
    from lightning_ort_ckpt._recovery._peer_folders import _newest_whole

    shards = ["shard-a-00000.odtc", "shard-a-00001.odtc"]
    later = ["shard-b-00000.odtc", "shard-b-00001.odtc"]
    # node 0 replaced (empty); node 1: its own shards of steps 5 and 6, and node 0's (with the metadata) of step 5
    # only: step 6's copy of node 0's shard never arrived
    reports = [_report({"": {}}),
               _report({"": {"5": [shards[1]], "6": [later[1]]}, "peer-of-rank0": {"5": [META, shards[0]]}},
                       {"5": shards})]
    assert _newest_whole(reports) == (5, shards)
    held = [r["held"] for r in reports]
    assert plan(held, "5", "step=5.ckpt", shards, [0, 1]) == [
        (1, 0, "peer-of-rank0/step=5.ckpt/" + shards[0]),  # over the group, from node 1's copy
        (1, 0, "step=5.ckpt/" + shards[1]),  # over the group, from node 1's own folder
        (1, 1, "peer-of-rank0/step=5.ckpt/" + shards[0]),  # on node 1, from its own copy
    ]
    assert plan(held, "5", "step=5.ckpt", [META], [0, 1]) == [(1, 0, f"peer-of-rank0/step=5.ckpt/{META}"),
                                                      (1, 1, f"peer-of-rank0/step=5.ckpt/{META}")]
    # a step whose metadata no rank holds, or one of whose shards no rank holds, is never chosen
    assert _newest_whole([_report({"": {"6": later}})]) is None
    assert _newest_whole([_report({"": {"6": [META, later[0]]}}, {"6": later})]) is None


def test_a_file_checkpoint_is_planned_to_every_rank_that_lacks_it() -> None:
    from lightning_ort_ckpt._recovery._peer import plan

    # DDP: rank 0 wrote step 6; rank 1 holds its copy; rank 2 (a third node) holds nothing
    held = [{"": {"6": "step=6.ckpt"}}, {"": {}, "peer-of-rank0": {"6": "step=6.ckpt"}}, {"": {}}]
    assert plan(held, "6", "step=6.ckpt", ["step=6.ckpt"], [0, 1, 2]) == [(1, 1, "peer-of-rank0/step=6.ckpt"),
                                                               (0, 2, "step=6.ckpt")]


def test_a_folder_several_ranks_share_is_filled_by_its_lowest_rank_alone(tmp_path: Path) -> None:
    """Two ranks of a node share its fast folder: its lowest rank (its keeper) alone commits into it, so that no
    two ranks commit the same file into one folder at once (``test_tiers_peer_nodes.py`` runs it)."""
    from lightning_ort_ckpt._recovery._peer import folder_identity, plan

    # DDP, 2 nodes of 2 ranks: node 0 (ranks 0, 1) replaced; node 1's folder (ranks 2, 3) holds rank 0's copy
    node1 = {"": {}, "peer-of-rank0": {"6": "step=6.ckpt"}}
    held = [{"": {}}, {"": {}}, node1, node1]
    assert plan(held, "6", "step=6.ckpt", ["step=6.ckpt"], [0, 0, 2, 2]) == [(2, 0, "peer-of-rank0/step=6.ckpt"),
                                                                             (2, 2, "peer-of-rank0/step=6.ckpt")]
    # which folder a path is: one folder by two paths is one; two folders are two
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert folder_identity(str(tmp_path / "link")) == folder_identity(str(tmp_path / "a"))
    assert folder_identity(str(tmp_path / "b")) != folder_identity(str(tmp_path / "a"))
