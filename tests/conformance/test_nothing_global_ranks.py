"""Nothing global (issue 40, point 1) in each rank of 2-rank runs (gloo on loopback, launched as users launch them):
DDP, ModelParallel (FSDP2) and FSDP (FSDP1), sharded saves, sync and async. In each rank's process, a fit with
Lightning's ``ModelCheckpoint`` first (the process group and torch's and Lightning's first-use state are made then),
then, with the collector off, the snapshot of ``helpers.snapshot`` before and after a fit of ``ModelCheckpoint``, one
of ``OrtCheckpoint`` and one of ``ModelCheckpoint`` with ``plugins=[OrtCheckpointIO()]`` and ``BindCheckpointIO``
(the plugin made inside the snapshots), each with its teardown: ours changes nothing the plain one does not (threads, open files and
sockets, hooks, ``atexit`` callbacks, Lightning's classes). Then, as ``test_nothing_global`` does in one process, what
is left for the collector once the fits are over (their Trainers let go): no object of ours lies on a reference cycle.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from helpers.launching import launch_script
from helpers.sharded import DEFINITIONS

KINDS = ("ddp", "ddp-async", "mp-sharded", "mp-sharded-async", "fsdp-sharded", "fsdp-sharded-async")
MAIN = r'''
import gc
from pytorch_lightning.callbacks import ModelCheckpoint
from helpers.snapshot import cyclic_garbage, described, ours_on_cycles, snapshot
from lightning_ort_ckpt import BindCheckpointIO, OrtCheckpointIO
from lightning_ort_ckpt.format._store import wait_for_cleanup


def one(kind, name, where):
    pl.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    y = torch.sin(x).sum(1, keepdim=True)
    async_save = kind.endswith("-async")
    callbacks = ([OrtCheckpoint(where, every_n_train_steps=2, async_save=async_save)] if name == "ours"
                 else [ModelCheckpoint(where, every_n_train_steps=2)] + [BindCheckpointIO()] * (name == "bound"))
    plugins = [OrtCheckpointIO(async_save=async_save)] if name == "bound" else None
    trainer = pl.Trainer(max_steps=4, strategy="ddp" if kind.startswith("ddp") else strategy(kind, 2), devices=2,
                         accelerator="cpu", logger=False, callbacks=callbacks, plugins=plugins, num_sanity_val_steps=0,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(Net(kind.startswith("mp")), DataLoader(TensorDataset(x, y), batch_size=4))
    wait_for_cleanup()
    for attr in ("log", "log_dict"):  # Lightning's back-references to the module, on every callback
        [vars(callback).pop(attr, None) for callback in trainer.callbacks]


out, kinds = sys.argv[1], sys.argv[2].split(",")
warnings.simplefilter("ignore")
found = {}
for kind in kinds:
    one(kind, "plain", os.path.join(out, kind, "warm-up"))
    gc.collect()
    gc.disable()
    runs = {}
    for name in ("plain", "ours", "bound"):  # what Lightning's own fit leaves (a device mesh's groups), then ours
        before = snapshot()
        one(kind, name, os.path.join(out, kind, name))
        after = snapshot()
        runs[name] = described(before, after)
        runs[name + " files added"] = len(set(after["open files"]) - set(before["open files"]))
    garbage = cyclic_garbage()  # both fits' (the plain one has no object of ours)
    runs["ours on cycles"] = ours_on_cycles(garbage)
    del garbage
    found[kind] = runs
    gc.enable()
with open(os.path.join(out, f"differences{os.environ.get('LOCAL_RANK', '0')}.json"), "w") as f:
    json.dump(found, f)
'''


@pytest.fixture(scope="module")
def differences(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    """One launch, every kind in turn; each rank's differences, by kind."""
    tmp_path = tmp_path_factory.mktemp("ranks")
    script = tmp_path / "train.py"
    script.write_text(DEFINITIONS + MAIN)
    tests = Path(__file__).parents[1]
    launch_script(script, [str(tmp_path), ",".join(KINDS)], "the 2-rank snapshots", 1200,
                  PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")]))
    return [json.loads((tmp_path / f"differences{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("kind", KINDS)
def test_a_fit_of_ours_leaves_each_rank_as_it_found_it(differences: list[dict[str, dict[str, Any]]],
                                                       kind: str) -> None:
    """Ours (the callback, and the plugin bound by ``BindCheckpointIO``, which lets go of the setter wrap in
    ``setup``) leaves what a fit with ``ModelCheckpoint`` leaves: nothing, but under ModelParallel the groups of the
    device mesh Lightning makes at every fit (its sockets and pipes)."""
    for rank, found in enumerate(differences):
        plain = found[kind]["plain"]
        assert set(plain) <= {"open files"}, (kind, rank, plain)
        for name in ("ours", "bound"):
            assert set(found[kind][name]) <= set(plain), (kind, rank, name, found[kind][name], plain)
            assert found[kind][name + " files added"] <= found[kind]["plain files added"], (kind, rank, name)


@pytest.mark.parametrize("kind", KINDS)
def test_no_object_of_ours_is_left_on_a_reference_cycle_in_any_rank(differences: list[dict[str, dict[str, Any]]],
                                                                     kind: str) -> None:
    """With the collector off, after the fit, its teardown and the Trainer let go, no object of ours lies on a
    reference cycle in either rank (one of its own, or one through Lightning's objects: the strategy the plugin
    serves, its wrapped methods); the cycle of each class found, as type names, otherwise."""
    for rank, found in enumerate(differences):
        assert found[kind]["ours on cycles"] == {}, (kind, rank, found[kind]["ours on cycles"])
