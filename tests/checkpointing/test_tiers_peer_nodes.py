"""Peer copies of the fast tier (``LocalTier(peer=True)``) across simulated nodes, launched as a cluster launcher
launches them (``helpers.launching.launch_nodes``: ``NODE_RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``; Lightning starts
no process): 2 nodes of 2 ranks each under DDP and under ``ModelParallelStrategy`` (sharded folders), and 2 nodes
of 1 rank under ``FSDPStrategy(state_dict_type="full")`` (one file, as DDP's). The ranks of a node share its
working directory, so the fast tier's one path, ``/proc/self/cwd/fast``, is one folder a node, as a node-local disk
is; each rank's partner is on the other node (rank ``r`` sends to ``(r + devices) % world_size``).

Fit 1 trains 6 steps with moto's S3 (through the counting proxy) as the persistent tier (every 4 steps) and the
fast tier every step (``keep=2``, ``async_save=True``). Then node 0's fast folder is emptied (a replaced machine)
and fit 2 resumes with ``ckpt_path="last"`` to step 8; then node 1's is emptied and fit 3 resumes to step 10. Every
rank of both resumes starts from the newest fast step in its own node's folder and ends bit for bit where an
uninterrupted fit of the same length ends, and neither reads one object of the persistent store. Each node's folder
is filled by one of its ranks (the lowest), never by two at once.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from collections.abc import Callable
from typing import Any

from helpers.launching import DDP_NET, SHARDED_NET, launch_nodes
from helpers.peers import NODES_HEAD, SCRIPT_HEAD, new_bucket, object_reads, record, step_listing
from helpers.sharded import CPU_FSDP
from lightning_ort_ckpt import load_checkpoint

SCRIPT = SCRIPT_HEAD + DDP_NET + SHARDED_NET + CPU_FSDP + r'''
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from pytorch_lightning.strategies import ModelParallelStrategy
from lightning_ort_ckpt.errors import CheckpointWarning
''' + NODES_HEAD + r'''
KIND = os.environ["PEER_KIND"]  # "ddp", "mp" (ModelParallel: sharded folders) or "fsdp-full"
WORLD = int(os.environ["WORLD_SIZE"])
LOCAL = int(os.environ["LOCAL_RANK"])


class Record(NodeRecord):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step in (8, 10):  # every rank: the full state is gathered collectively
            full = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True))
            self.weights[trainer.global_step] = {k: v.flatten().tolist() for k, v in full.items()}


class RankOrderSums(pl.Callback):
    """DDP's gradients summed in rank order. torch's reducer on gloo sums them in an order that depends on where a
    gradient lies in its bucket, and it lays its buckets out again after the first step of every new DDP module: at
    world size > 2 a fit resumed in a new process differs in the last bits from the uninterrupted one (with any
    checkpoint, or none: a module wrapped again in one process does it too). Summed in rank order, it does not."""

    def on_fit_start(self, trainer, pl_module):
        def in_rank_order(state, bucket):
            every = [torch.empty_like(bucket.buffer()) for _ in range(WORLD)]
            dist.all_gather(every, bucket.buffer())
            total = every[0].clone()
            for other in every[1:]:
                total += other
            done = torch.futures.Future()
            done.set_result(total / WORLD)
            return done

        trainer.strategy.model.register_comm_hook(None, in_rank_order)


def strategy():
    if KIND == "mp":
        return ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    if KIND == "fsdp-full":
        return CPUFSDPStrategy(state_dict_type="full", auto_wrap_policy={nn.Linear})
    return "ddp"


def fit(name, max_steps, peer=None, ckpt_path=None):
    loader, record = data(), Record()
    hooks = [RankOrderSums()] if KIND == "ddp" else []
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=WORLD // 2, num_nodes=2,
                         strategy=strategy(), logger=False, default_root_dir=OUT,
                         callbacks=callbacks(record, peer, FAST) + hooks, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         enable_checkpointing=peer is not None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        trainer.fit(ShardedNet() if KIND == "mp" else Net(), loader, ckpt_path=ckpt_path)
    said = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    with open(os.path.join(OUT, f"{name}.rank{trainer.global_rank}.json"), "w") as f:
        json.dump({**record.seen, "weights": record.weights, "end": trainer.global_step, "said": said}, f)


warnings.simplefilter("ignore")
if PHASE == "first":
    fit("reference", 10)
    fit("fast-fit", 6, peer=True)
else:  # node 0's folder was emptied before this launch
    fit("fast-resume", 8, peer=True, ckpt_path="last")
    if NODE == 1 and LOCAL == 0:  # node 1 replaced: its fast folder empty
        shutil.rmtree(FAST)
    dist.barrier()  # (the fit's process group is still up) before any rank of node 1 looks at its folder
    fit("fast-partner", 10, peer=True, ckpt_path="last")
'''

META = "checkpoint.ort-meta"
STEPS = ("step=5.ckpt", "step=6.ckpt")


def _fits(tmp_path: Path, proxy: Any, kind: str, per_node: int, first: Callable[[Path, Path], None]) -> None:
    """Fit 1; ``first`` checks the two nodes' fast folders it left; node 0's emptied; fits 2 and 3 (node 1's
    emptied between them): each rank starts from its own node's newest fast step and ends bit for bit where the
    uninterrupted fit does, and no object of S3 is read."""
    bucket = new_bucket(proxy, f"peer-{kind}", tmp_path)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    launch_nodes(script, [str(tmp_path), "first", proxy.url, bucket], nodes, f"the {kind} fits", 900,
                 per_node=per_node, PEER_KIND=kind)
    assert any(r.startswith("PUT ") and "/run/epoch%3D0-step%3D4.ckpt" in r for r in proxy.requests)  # in S3
    fast0, fast1 = nodes[0] / "fast", nodes[1] / "fast"
    first(fast0, fast1)

    shutil.rmtree(fast0)  # node 0 replaced: an empty fast folder
    fast0.mkdir()
    proxy.requests.clear()
    launch_nodes(script, [str(tmp_path), "resume", proxy.url, bucket], nodes, f"the {kind} resumes", 900,
                 per_node=per_node, PEER_KIND=kind)
    assert object_reads(proxy.requests) == [], proxy.requests
    assert any("list-type=" in r for r in proxy.requests)  # it did look at the persistent tier
    for rank in range(2 * per_node):
        reference = record(tmp_path, "reference", rank)
        assert len(reference["weights"]["8"]) == 4, rank  # every rank gathered the whole module
        resumed, partner = record(tmp_path, "fast-resume", rank), record(tmp_path, "fast-partner", rank)
        assert (resumed["start"], resumed["ckpt_path"], resumed["end"]) == (6, "/proc/self/cwd/fast/step=6.ckpt", 8)
        assert resumed["weights"]["8"] == reference["weights"]["8"], rank  # bit for bit
        assert (partner["start"], partner["ckpt_path"], partner["end"]) == (8, "/proc/self/cwd/fast/step=8.ckpt", 10)
        assert partner["weights"]["10"] == reference["weights"]["10"], rank
        # DDP at 4 ranks says, once, that its first steps may sum in another order (this test's hook sums in rank
        # order, so here they are bitwise): rank 0 alone, at each resume
        for fit in (resumed, partner):
            said = [m for m in fit["said"] if "resumed under DDP" in m]
            if kind == "ddp" and rank == 0:
                assert len(said) == 1 and said[0].startswith(f"{fit['ckpt_path']}: resumed under DDP with 4 "
                                                              "processes"), fit["said"]
            else:
                assert said == [], (rank, said)


def test_ddp_with_two_ranks_a_node(tmp_path: Path, counted: Any) -> None:
    """Rank 0 writes the fast tier in node 0's folder; rank 2, its partner, holds the copies in node 1's; ranks 1
    and 3 send and hold nothing."""
    def first(fast0: Path, fast1: Path) -> None:
        assert _names(fast0) == list(STEPS)
        assert _names(fast1) == ["peer-of-rank0"]
        for step in STEPS:
            assert (fast1 / "peer-of-rank0" / step).read_bytes() == (fast0 / step).read_bytes()
            load_checkpoint(fast1 / "peer-of-rank0" / step)  # every checksum verified

    _fits(tmp_path, counted, "ddp", 2, first)
    fast0, fast1 = tmp_path / "node0" / "fast", tmp_path / "node1" / "fast"
    assert _names(fast0) == ["step=10.ckpt", "step=9.ckpt"]
    assert _names(fast1 / "peer-of-rank0") == ["step=10.ckpt", "step=9.ckpt"]


def test_model_parallel_with_two_ranks_a_node(tmp_path: Path, counted: Any) -> None:
    """Each node's step folder holds its own two ranks' shards (node 0's the metadata, committed by rank 0); each
    rank's partner on the other node holds a copy of its own files: the metadata only rank 0's."""
    def first(fast0: Path, fast1: Path) -> None:
        assert step_listing(fast0) == {s: [META, "shard-00000", "shard-00001"] for s in STEPS}
        assert step_listing(fast1) == {s: ["shard-00002", "shard-00003"] for s in STEPS}
        assert step_listing(fast1 / "peer-of-rank0") == {s: [META, "shard-00000"] for s in STEPS}
        assert step_listing(fast1 / "peer-of-rank1") == {s: ["shard-00001"] for s in STEPS}
        assert step_listing(fast0 / "peer-of-rank2") == {s: ["shard-00002"] for s in STEPS}
        assert step_listing(fast0 / "peer-of-rank3") == {s: ["shard-00003"] for s in STEPS}
        for step in STEPS:
            for own, copies in ((fast0, fast1), (fast1, fast0)):
                for f in (own / step).iterdir():
                    rank = 0 if f.name == META else int(f.name[-10:-5])
                    assert (copies / f"peer-of-rank{rank}" / step / f.name).read_bytes() == f.read_bytes(), f

    _fits(tmp_path, counted, "mp", 2, first)
    fast0, fast1 = tmp_path / "node0" / "fast", tmp_path / "node1" / "fast"
    last = ("step=10.ckpt", "step=9.ckpt")  # and every folder rotated to its newest 2 steps, copies included
    assert step_listing(fast0) == {s: [META, "shard-00000", "shard-00001"] for s in last}
    assert step_listing(fast1) == {s: ["shard-00002", "shard-00003"] for s in last}
    assert step_listing(fast1 / "peer-of-rank0") == {s: [META, "shard-00000"] for s in last}
    assert step_listing(fast1 / "peer-of-rank1") == {s: ["shard-00001"] for s in last}
    assert step_listing(fast0 / "peer-of-rank2") == {s: ["shard-00002"] for s in last}


def test_fsdp_full_state_across_two_nodes(tmp_path: Path, counted: Any) -> None:
    """FSDP (FSDP1 on CPU: ``helpers.sharded.CPU_FSDP``) with full state: one file written by rank 0, copied as
    DDP's is."""
    def first(fast0: Path, fast1: Path) -> None:
        assert _names(fast0) == list(STEPS)
        assert _names(fast1) == ["peer-of-rank0"]
        for step in STEPS:
            assert (fast1 / "peer-of-rank0" / step).read_bytes() == (fast0 / step).read_bytes()

    _fits(tmp_path, counted, "fsdp-full", 1, first)
    assert _names(tmp_path / "node1" / "fast" / "peer-of-rank0") == ["step=10.ckpt", "step=9.ckpt"]


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())
