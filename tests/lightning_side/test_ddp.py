"""``OrtCheckpoint`` under 2-process DDP on CPU (gloo), launched the way users launch it: ``python train.py``.

A standalone script (written to ``tmp_path``) trains with ``strategy="ddp", devices=2``; Lightning's launcher re-runs
the script for rank 1. One launch runs two fits back to back (the process group is set up once): the uninterrupted
run of 16 steps, and the first half (8 steps, one epoch) of an interrupted one. A second launch, in fresh processes,
resumes the interrupted run from ``ckpt_path="last"`` to step 16. Checked:

* one set of files, written once, by rank 0: exactly the expected names in each directory (no ``-v1`` duplicates, no
  leftovers), every file loads in ONNX Runtime's ``CheckpointState`` with the weights the run had when it saved;
* both ranks agree on ``best_model_path``, ``best_model_score``, ``last_model_path`` and the top-k;
* the resumed run ends with the same weights as the uninterrupted run (bit for bit: no dropout, no shuffling,
  a resume at the epoch boundary), and the callback's own state (best score and path, top-k, last path, the step of
  the ranked score, the unranked files it keeps) survives the resume and ends as in the uninterrupted run, with the
  same files in the directory;
* every validation value is ranked, also a mid-epoch one at a step where the step trigger saved first; the resumed
  run saves on the same schedule as the uninterrupted run (its step-10 save happens too).

``OrtCheckpoint(every_n_train_steps=2, monitor="val_loss", save_last=True)`` with validation every 4 steps: step 2
has no value yet (nothing saved); saves at 6, 10, 14 carry a stale ``val_loss`` and are kept unranked (the newest
one only); 4, 8, 12, 16 have a fresh value.
"""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_ort_ckpt import load_checkpoint
from lightning_ort_ckpt._restore._reading import read_lightning_checkpoint
from helpers.launching import launch_script
from helpers.ort_reference import ort_api, ort_parameters

STEPS, HALF = 16, 8  # 64 samples, batch 4, split over 2 ranks: 8 steps per epoch

SCRIPT = r'''
import json, os, sys, warnings
warnings.filterwarnings("ignore")
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning_ort_ckpt import OrtCheckpoint
from lightning_ort_ckpt._plugin import OrtCheckpointIO

IO_CALLS = []  # (method, file name) of every call into the plugin that writes or deletes, in this process


def counted(method, path_index):
    original = getattr(OrtCheckpointIO, method)

    def wrapper(self, *args, **kwargs):
        IO_CALLS.append((method, os.path.basename(os.fspath(args[path_index]))))
        return original(self, *args, **kwargs)

    setattr(OrtCheckpointIO, method, wrapper)


for method, path_index in (("save_checkpoint", 1), ("remove_checkpoint", 0), ("link", 1)):
    counted(method, path_index)

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def callback_state(cb):
    score = lambda v: None if v is None else float(v)
    return {"best_model_path": cb.best_model_path, "best_model_score": score(cb.best_model_score),
            "last_model_path": cb.last_model_path, "best_k_models": {k: score(v) for k, v in cb.best_k_models.items()},
            "kth_best_model_path": cb.kth_best_model_path, "current_score_step": cb.current_score_step,
            "saved": list(cb._saved)}


class Record(pl.Callback):
    """Per rank: the callback's state when training starts (after a resume restored it) and at the end, the
    validation losses by step, the best file before each step; the final weights."""

    def __init__(self, out, name):
        self.out, self.name, self.record = out, name, {"val_loss": {}}

    def on_train_start(self, trainer, pl_module):
        self.record["start_step"] = trainer.global_step
        self.record["start"] = callback_state(trainer.checkpoint_callback)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.record.setdefault("best_at", {})[trainer.global_step] = os.path.basename(
            trainer.checkpoint_callback.best_model_path)

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.record["val_loss"][trainer.global_step] = float(trainer.callback_metrics["val_loss"])

    def on_fit_end(self, trainer, pl_module):
        rank = trainer.global_rank
        self.record.update(end=callback_state(trainer.checkpoint_callback), end_step=trainer.global_step,
                           world_size=trainer.world_size, ckpt_path=trainer.ckpt_path, pid=os.getpid(),
                           io_calls=IO_CALLS[:])
        IO_CALLS.clear()
        with open(os.path.join(self.out, f"{self.name}.rank{rank}.json"), "w") as f:
            json.dump(self.record, f)
        torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                   os.path.join(self.out, f"{self.name}.rank{rank}.pt"))


def fit(out, name, max_steps, ckpt_path=None):
    pl.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = torch.sin(x).sum(1, keepdim=True)
    train = DataLoader(TensorDataset(x, y), batch_size=4)
    val = DataLoader(TensorDataset(x[:16] + 0.1, y[:16]), batch_size=4)
    cb = OrtCheckpoint(os.path.join(out, name.split("-")[0]), every_n_train_steps=2, monitor="val_loss",
                       save_last=True)
    trainer = pl.Trainer(max_steps=max_steps, strategy="ddp", accelerator="cpu", devices=2, logger=False,
                         callbacks=[Record(out, name), cb], val_check_interval=4, num_sanity_val_steps=0,
                         enable_progress_bar=False, enable_model_summary=False, deterministic=True)
    trainer.fit(Net(), train, val, ckpt_path=ckpt_path)


out, phase = sys.argv[1], sys.argv[2]
if phase == "first":
    fit(out, "full", STEPS)
    fit(out, "half", HALF)
else:
    fit(out, "half-resumed", STEPS, ckpt_path="last")
'''


def launch(tmp_path: Path, phase: str, timeout: float = 900) -> None:
    script = tmp_path / "train.py"
    script.write_text(f"STEPS, HALF = {STEPS}, {HALF}\n" + textwrap.dedent(SCRIPT))
    launch_script(script, [str(tmp_path), phase], f"the DDP run ({phase})", timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The two launches (about a minute on two cores); the tests below check what they left."""
    tmp_path = tmp_path_factory.mktemp("ddp")
    launch(tmp_path, "first")
    shutil.copytree(tmp_path / "half", tmp_path / "half-before-resume", symlinks=True)
    launch(tmp_path, "resume")
    return tmp_path


def records(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((tmp_path / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1)]


def weights(tmp_path: Path, name: str, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(tmp_path / f"{name}.rank{rank}.pt", weights_only=True)


def step_name(step: int) -> str:
    return f"epoch={(step - 1) // HALF}-step={step}.ckpt"


def step_of_name(name: str) -> int:
    return int(name.split("step=")[1].removesuffix(".ckpt"))


def expected_files(val_loss: dict[str, float], max_steps: int) -> tuple[set[str], str]:
    """The files one run leaves (the best ranked save, the newest unranked one, last.ckpt), and the best one."""
    best_step = min(val_loss, key=lambda s: (val_loss[s], int(s)))  # ties: the first to reach it stays best
    unranked = max(s for s in range(2, max_steps + 1, 2) if s % 4)
    return {step_name(int(best_step)), step_name(unranked), "last.ckpt"}, step_name(int(best_step))


def assert_agree(ranks: list[dict[str, Any]], key: str) -> None:
    assert ranks[0][key] == ranks[1][key], f"{key}: rank 0 {ranks[0][key]} != rank 1 {ranks[1][key]}"


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], where: str) -> None:
    assert a.keys() == b.keys(), where
    for k in a:
        assert torch.equal(a[k], b[k]), f"{where}: {k} differs by {(a[k] - b[k]).abs().max().item()}"


def assert_loads_in_ort(path: Path, step: int) -> dict[str, torch.Tensor]:
    """ORT's CheckpointState reads the file: the same weights as ours, trainable (the plugin found the module on
    rank 0); the file holds ``step``. Returns the weights."""
    params = ort_parameters(ort_api().CheckpointState.load_checkpoint(str(path)))
    ours = read_lightning_checkpoint(path)
    assert ours["global_step"] == step, (path.name, ours["global_step"])
    for k, v in ours["state_dict"].items():
        assert params[k][0].tobytes() == v.numpy().tobytes() and params[k][1] is True, (path.name, k)
    extra = set(params) - set(ours["state_dict"])  # Lightning's other state travels as frozen "lightning:" tensors
    assert all(k.startswith("lightning:") and params[k][1] is False for k in extra), (path.name, sorted(extra))
    load_checkpoint(path)
    return ours["state_dict"]


def check_run(directory: Path, ranks: list[dict[str, Any]], val_loss: dict[str, float], max_steps: int,
              final: dict[str, torch.Tensor], files: Path | None = None) -> None:
    """One set of files, as expected, each loading in ORT; last.ckpt holds the final weights; the callback's end
    state names them. ``files``: where the files are now, if they were copied away from ``directory``."""
    want, best = expected_files(val_loss, max_steps)
    directory, saved_in = files or directory, directory
    assert sorted(os.listdir(directory)) == sorted(want), f"{directory.name}: {sorted(os.listdir(directory))}"
    for name in want:
        assert_loads_in_ort(directory / name, max_steps if name == "last.ckpt" else step_of_name(name))
    assert_same_weights(read_lightning_checkpoint(directory / "last.ckpt")["state_dict"], final, "last.ckpt")
    end = ranks[0]["end"]
    assert end["best_model_path"] == str(saved_in / best)
    assert end["last_model_path"] == str(saved_in / "last.ckpt")
    assert end["best_model_score"] == val_loss[str(step_of_name(best))]
    assert end["best_k_models"] == {str(saved_in / best): val_loss[str(step_of_name(best))]}


def relative(state: dict[str, Any], directory: Path) -> dict[str, Any]:
    return json.loads(json.dumps(state).replace(str(directory) + os.sep, ""))


# -- the tests ----------------------------------------------------------------------------------------------------
def test_ranks_agree(runs: Path) -> None:
    for name in ("full", "half", "half-resumed"):
        run = records(runs, name)
        assert [r["world_size"] for r in run] == [2, 2] and run[0]["pid"] != run[1]["pid"], name
        for key in ("start", "end", "val_loss", "best_at", "start_step", "end_step", "ckpt_path"):
            assert_agree(run, key)  # same best path and score, last path, top k, unranked files
        assert_same_weights(weights(runs, name, 0), weights(runs, name, 1), f"{name}: rank 0 vs rank 1")
    assert records(runs, "half-resumed")[0]["pid"] not in {r["pid"] for r in records(runs, "half")}


@pytest.mark.parametrize("name, max_steps", [("full", STEPS), ("half", HALF)])
def test_files_written_once_by_rank_zero(runs: Path, name: str, max_steps: int) -> None:
    ranks = records(runs, name)
    files = runs / "half-before-resume" if name == "half" else None
    check_run(runs / name, ranks, ranks[0]["val_loss"], max_steps, weights(runs, name), files)
    assert ranks[1]["io_calls"] == [], "rank 1 wrote or deleted files"
    saves = [path for method, path in ranks[0]["io_calls"] if method == "save_checkpoint"]
    step_files = [p for p in saves if p != "last.ckpt"]
    assert len(step_files) == len(set(step_files)), f"a file was written twice: {saves}"
    assert not [p for p in saves if "-v" in p], saves
    assert step_files == [step_name(s) for s in range(2, max_steps + 1, 2) if s > 2], saves  # no value at step 2
    assert saves.count("last.ckpt") == len(step_files), saves


def test_resume_continues_exactly(runs: Path) -> None:
    full, half, resumed = records(runs, "full"), records(runs, "half"), records(runs, "half-resumed")
    r = resumed[0]
    assert os.path.basename(r["ckpt_path"]) in {"last.ckpt", step_name(HALF)}
    assert r["start_step"] == HALF and r["end_step"] == STEPS
    assert r["start"] == half[0]["end"]  # the callback's state as the first half left it
    assert r["val_loss"] == {k: v for k, v in full[0]["val_loss"].items() if int(k) > HALF}
    final = weights(runs, "half-resumed")
    assert_same_weights(final, weights(runs, "full"), "resumed vs uninterrupted")
    assert_same_weights(read_lightning_checkpoint(runs / "half" / "last.ckpt")["state_dict"], final, "last.ckpt")
    assert_loads_in_ort(runs / "half" / "last.ckpt", STEPS)
    # best and last, top k, the step of the ranked score: as in the uninterrupted run
    end, full_end = relative(r["end"], runs / "half"), relative(full[0]["end"], runs / "full")
    for key in ("best_model_path", "best_model_score", "last_model_path", "best_k_models", "kth_best_model_path",
                "current_score_step"):
        assert end[key] == full_end[key], key
    assert resumed[1]["io_calls"] == []


def test_resumed_directory_equals_uninterrupted(runs: Path) -> None:
    full, resumed = records(runs, "full"), records(runs, "half-resumed")
    saved = relative(resumed[0]["end"], runs / "half")["saved"], relative(full[0]["end"], runs / "full")["saved"]
    assert saved[0] == saved[1], f"unranked files kept: resumed {saved[0]}, uninterrupted {saved[1]}"
    check_run(runs / "half", resumed, full[0]["val_loss"], STEPS, weights(runs, "half-resumed"))


def test_every_validation_value_is_ranked(runs: Path) -> None:
    full = records(runs, "full")[0]
    val_loss = {int(k): v for k, v in full["val_loss"].items()}
    best_at = {int(k): v for k, v in full["best_at"].items()}
    for step in sorted(val_loss):
        if step < STEPS:
            best = min((s for s in val_loss if s <= step), key=lambda s: (val_loss[s], s))
            assert best_at[step] == step_name(best), (step, best_at[step], val_loss)


def test_resumed_run_saves_on_the_same_schedule(runs: Path) -> None:
    def step_files(record: dict[str, Any]) -> list[str]:
        return [p for m, p in record["io_calls"] if m == "save_checkpoint" and p != "last.ckpt"]

    full, resumed = records(runs, "full")[0], records(runs, "half-resumed")[0]
    assert step_files(resumed) == [p for p in step_files(full) if step_of_name(p) > HALF]
