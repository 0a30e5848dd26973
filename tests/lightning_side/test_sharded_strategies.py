"""``OrtCheckpoint`` under Lightning's sharded strategies, 2 CPU processes (gloo), launched as users launch them.

A standalone script (written to ``tmp_path``) trains a tiny module (a frozen layer, a buffer, two trained layers,
AdamW over the trained ones, per-rank random noise in every step: each rank's random states decide the run) with
``ModelParallelStrategy`` (FSDP2 ``fully_shard``, on CPU) and ``FSDPStrategy`` (FSDP1), each in both save modes:
sharded (``save_distributed_checkpoint=True``, ``state_dict_type="sharded"``: a directory, every rank writing its
own shards) and full (``save_distributed_checkpoint=False``, ``state_dict_type="full"``: Lightning gathers the full
state, rank 0 writes one ORT file), and the sharded modes with ``async_save=True``. One launch runs, per mode, the
uninterrupted run (8 steps, 2 epochs) and the first half of an interrupted one (4 steps, saved at step 4); a second
launch, in fresh processes, resumes the half run from its step-4 checkpoint, resumes a copy of the sharded half
runs' folders with ``ckpt_path="last"`` and ``save_top_k=1`` (retention of checkpoint directories), and runs async
saves that fail; a third resumes the sharded ones at world size 1 (``runs``: every test below reads what these
three launches left). Checked:

* resume at the same world size is bitwise the uninterrupted run: weights, optimizer state, loop position, and each
  rank's own random states at every step after the resume;
* so is a resume from a save that validation follows (``VALIDATED``: ModelParallel, sharded and full, a validation
  that draws random numbers after the step-4 save), which runs that validation;
* the full-state file is a real ORT checkpoint: ORT's ``CheckpointState`` loads it with the trained layers trainable
  and the frozen layer and buffer frozen, the optimizer state is the run's, and no rank warns that the plugin is not
  attached;
* a world-size-2 sharded checkpoint resumes at world size 1 with the same weights and optimizer state (resharded);
* the strategy's own ``save_checkpoint`` / ``load_checkpoint`` are back once fit is over;
* rank 0's peak memory during a full-state save stays under the gathered state plus a small constant (its own
  launch, a larger module);
* DeepSpeed is refused with a ``CheckpointConfigError`` naming the supported strategies, before anything trains.

Lightning refuses ``FSDPStrategy`` on CPU and torch runs FSDP1 on CPU only when told the device; the script's
``CPUFSDPStrategy`` and ``cpu_tolerant_full_state`` (test only, documented there) get past both without touching
the save and load code: Lightning's ``FSDPStrategy`` builds the checkpoint dicts, ours saves and loads them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_ort_ckpt._dcp._dcp_storage import is_sharded_checkpoint
from lightning_ort_ckpt._restore._reading import read_contents
from helpers.launching import launch_script
from helpers.ort_reference import ort_api, ort_parameters
from helpers.sharded import (ASYNC, CKPT, MODES, SCRIPT, SHARDED, VALIDATED, assert_same_state, record,
                             state)


def launch(tmp_path: Path, steps: dict[str, tuple[str, ...]], timeout: float = 1200, **extra_env: str) -> None:
    """One launch of the script (2 ranks, fresh processes) running ``steps`` (phase: kinds) in order. The bound
    covers the imports and every fit of the launch on a loaded machine: it catches a hang, not a slow start."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    args = [f"{phase}={','.join(kinds)}" for phase, kinds in steps.items()]
    launch_script(script, [str(tmp_path), *args], f"the run ({' '.join(args)})", timeout, **extra_env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three launches for every test of this module, sync and async kinds together: (1) the uninterrupted runs and
    the half runs; (2) in fresh processes, rank 0's memory during full-state saves (first, in processes that have
    saved nothing yet; every allocation of 64 KiB or more mapped on its own, see ``memory_of_full_saves``), the
    resumes of the half runs, "last" in a copy of each sharded half run's folder, and last the async saves that fail
    (they leave the file size limit of the processes lowered for a while); (3) the sharded half runs resumed at
    world size 1."""
    tmp_path = tmp_path_factory.mktemp("sharded")
    launch(tmp_path, {"first": MODES + ASYNC + VALIDATED})
    for kind in SHARDED + ASYNC:
        shutil.copytree(tmp_path / kind / "half", tmp_path / kind / "last")
    launch(tmp_path, {"memory": ("mp-full",), "resume": MODES + ASYNC + VALIDATED, "last": SHARDED + ASYNC, "fail": ASYNC},
           MALLOC_MMAP_THRESHOLD_=str(1 << 16))
    launch(tmp_path, {"one": SHARDED})
    return tmp_path


@pytest.mark.parametrize("mode", MODES)
def test_resume_is_bitwise_the_uninterrupted_run(runs: Path, mode: str) -> None:
    assert_same_state(state(runs, f"{mode}-full", "end"), state(runs, f"{mode}-resumed", "end"), mode)
    for rank in (0, 1):
        full, resumed = record(runs, f"{mode}-full", rank), record(runs, f"{mode}-resumed", rank)
        assert (resumed["start"], resumed["end"]) == (4, 8)
        # each rank draws its own random numbers after the resume, as in the uninterrupted run
        assert resumed["rng"] == {k: v for k, v in full["rng"].items() if int(k) >= 4}, (mode, rank)
    assert record(runs, f"{mode}-full", 0)["rng"]["4"] != record(runs, f"{mode}-full", 1)["rng"]["4"]


@pytest.mark.parametrize("mode", VALIDATED)
def test_a_save_before_validation_resumes_bitwise(runs: Path, mode: str) -> None:
    """The step-4 save comes before the validation at the end of epoch 0, whose ``validation_step`` draws random
    numbers on each rank: the resumed fit runs that validation (``_validation_resume``), sharded folder or
    full-state file, so every rank's random states, and the weights, are the uninterrupted run's."""
    assert_same_state(state(runs, f"{mode}-full", "end"), state(runs, f"{mode}-resumed", "end"), mode)
    for rank in (0, 1):
        full, resumed = record(runs, f"{mode}-full", rank), record(runs, f"{mode}-resumed", rank)
        assert (resumed["start"], resumed["end"]) == (4, 8)
        assert resumed["rng"] == {k: v for k, v in full["rng"].items() if int(k) >= 4}, (mode, rank)


@pytest.mark.parametrize("mode", SHARDED)
def test_last_resumes_a_sharded_folder_and_retention_removes_folders_whole(runs: Path, mode: str) -> None:
    """``fit(ckpt_path="last")`` in the half run's folder finds its step-4 checkpoint directory and ends as the
    uninterrupted run; ``save_top_k=1`` then deletes the step-6 directory completely (nothing hidden left), keeping
    the step-8 one, committed."""
    assert_same_state(state(runs, f"{mode}-full", "end"), state(runs, f"{mode}-last", "end"), mode)
    for rank in (0, 1):
        assert (record(runs, f"{mode}-last", rank)["start"], record(runs, f"{mode}-last", rank)["end"]) == (4, 8)
    folder = runs / mode / "last"
    assert sorted(p.name for p in folder.iterdir()) == [CKPT, "epoch=1-step=8.ckpt"]
    assert is_sharded_checkpoint(str(folder / "epoch=1-step=8.ckpt"))


@pytest.mark.parametrize("mode", SHARDED)
def test_sharded_checkpoint_is_a_directory(runs: Path, mode: str) -> None:
    path = runs / mode / "half" / CKPT
    assert path.is_dir() and is_sharded_checkpoint(str(path))
    assert sorted(p.name for p in (runs / mode / "half").iterdir()) == [CKPT]


@pytest.mark.parametrize("mode", ["mp-full", "fsdp-full"])
def test_full_state_file_trains_in_ort(runs: Path, mode: str) -> None:
    path = runs / mode / "half" / CKPT
    contents = read_contents(path)
    assert sorted(contents.trainable) == ["l1.bias", "l1.weight", "l2.bias", "l2.weight"]
    assert {"l0.weight", "l0.bias", "scale"} <= set(contents.frozen)
    assert sorted(contents.optimizer_groups["group0"].states) == sorted(contents.trainable)
    params = ort_parameters(ort_api().CheckpointState.load_checkpoint(str(path)))
    saved = state(runs, f"{mode}-half", "end")
    for name, tensor in saved["model"].items():
        assert params[name][0].tobytes() == tensor.numpy().tobytes(), name
        assert params[name][1] is (name in contents.trainable), name
    for name, moments in contents.optimizer_groups["group0"].states.items():  # the run's, moment by moment
        for ours, torch_name in (("momentum0", "exp_avg"), ("momentum1", "exp_avg_sq")):
            expected = saved["optim"]["state"][name][torch_name]
            assert np.asarray(moments[ours]).tobytes() == expected.numpy().tobytes(), (name, ours)
    for rank in (0, 1):
        warned = record(runs, f"{mode}-half", rank)["warnings"]
        assert not [w for w in warned if "not attached" in w], warned


@pytest.mark.parametrize("mode", ["mp-sharded", "fsdp-sharded"])
def test_world_size_one_resumes_a_world_size_two_sharded_checkpoint(runs: Path, mode: str) -> None:
    assert_same_state(state(runs, f"{mode}-half", "end"), state(runs, f"{mode}-resumed1", "start"), "ws 1")
    assert record(runs, f"{mode}-resumed1", 0)["end"] == 8


@pytest.mark.parametrize("mode", MODES)
def test_strategy_methods_are_lightnings_after_fit(runs: Path, mode: str) -> None:
    for rank in (0, 1):
        assert json.loads((runs / f"{mode}-resumed.wrapped{rank}.json").read_text()) == []


@pytest.mark.parametrize("mode", MODES + ASYNC)
def test_no_global_optimizer_hook_outlives_a_fit(runs: Path, mode: str) -> None:
    """torch's global optimizer step hooks, counted in each process after each fit (several fits run in one
    process, sync and async): none of ours is left, not even one from the plugin's first binding (when Lightning
    gave it the strategy) that the callback's binding replaced; nor a hook on the fit's own optimizers, nor a wrap
    of Lightning's loader or "last" resolution, though the callback still exists (issue 40)."""
    counted = sorted(runs.glob(f"{mode}-*.hooks*.json"))
    assert {p.name.split(".")[0] for p in counted} >= {f"{mode}-full", f"{mode}-half", f"{mode}-resumed"}
    for path in counted:
        assert json.loads(path.read_text()) == [0, 0, 0, []], path.name


def test_deepspeed_is_refused_before_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pytorch_lightning as pl
    import torch.distributed as dist
    from pytorch_lightning.demos.boring_classes import BoringModel
    from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy

    from lightning_ort_ckpt import OrtCheckpoint
    from lightning_ort_ckpt.errors import CheckpointConfigError

    class CPUDeepSpeed(DeepSpeedStrategy):
        """Test only: Lightning refuses DeepSpeed without the deepspeed package (in ``__init__``) and without CUDA
        (in ``setup_environment``); this one sets up as DDP on CPU, everything else is DeepSpeedStrategy's."""

        __init__ = DDPStrategy.__init__
        setup_environment = DDPStrategy.setup_environment
        setup_distributed = DDPStrategy.setup_distributed

    class Counting(BoringModel):
        steps = 0

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            Counting.steps += 1
            return super().training_step(batch, batch_idx)

    for name in ("MASTER_ADDR", "MASTER_PORT"):  # Lightning sets them in this process: put back after the test
        monkeypatch.delenv(name, raising=False)
    own = not dist.is_initialized()
    trainer = pl.Trainer(strategy=CPUDeepSpeed(), accelerator="cpu", devices=1, logger=False, max_steps=2,
                         callbacks=[OrtCheckpoint(tmp_path)], enable_progress_bar=False)
    try:
        with pytest.raises(CheckpointConfigError, match="ModelParallelStrategy.*FSDPStrategy") as e:
            trainer.fit(Counting())
    finally:
        if own and dist.is_initialized():  # its group of one (and the port it listens on) ends with the test
            dist.destroy_process_group()
    assert "CPUDeepSpeed" in str(e.value) and "DeepSpeed" in str(e.value)
    assert Counting.steps == 0 and not list(tmp_path.iterdir())


def test_full_state_save_holds_the_gathered_state_once(runs: Path) -> None:
    """Rank 0 writes the state Lightning gathered straight from its memory: a save's peak stays under the gathered
    state (48 MiB) plus a small constant (the gather's own buffer for one tensor, 4 MiB, and the writer's
    bookkeeping), every save, the first included. Lightning's ``TorchCheckpointIO`` serializes into memory first:
    twice the state (see ``benchmarks/full_state_save.py``)."""
    measured = json.loads((runs / "memory.json").read_text())
    gathered, peaks = measured["gathered_mib"], measured["peaks_mib"]
    assert len(peaks) == 3 and 47 < gathered < 49
    assert max(peaks) < gathered + 12, peaks  # measured: gathered + 4 MiB


def test_sharded_tensors_become_dtensors_over_the_same_memory(tmp_path: Path) -> None:
    """FSDP1's ShardedTensors are saved as DTensors viewing their shards (a load fills them through the view); a
    layout FSDP does not make (two shards on one rank here) is refused with our error, before anything is written."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
    from torch.distributed.tensor import DTensor

    from lightning_ort_ckpt._dcp._strategies import as_dtensors
    from lightning_ort_ckpt.errors import CheckpointConfigError

    own = not dist.is_initialized()  # an in-process Trainer of another test may have left its group of one
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert dist.get_world_size() == 1
        local = torch.arange(12.0).reshape(3, 4)
        whole = [Shard.from_tensor_and_offsets(local, [0, 0], 0)]
        tree = {"state_dict": {"w": init_from_local_shards(whole, 3, 4)}, "epoch": 1, "hparams": {"lr": 0.1}}
        converted = as_dtensors(tree)
        dtensor = converted["state_dict"]["w"]
        assert isinstance(dtensor, DTensor) and dtensor.shape == (3, 4)
        assert dtensor.to_local().data_ptr() == local.data_ptr()
        assert converted["hparams"] is tree["hparams"] and converted["epoch"] == 1
        halves = [Shard.from_tensor_and_offsets(torch.zeros(2, 4), [0, 0], 0),
                  Shard.from_tensor_and_offsets(torch.zeros(2, 4), [2, 0], 0)]
        with pytest.raises(CheckpointConfigError, match="shape \\[4, 4\\] is not split along its first dimension"):
            as_dtensors({"state_dict": {"w": init_from_local_shards(halves, 4, 4)}})
    finally:
        if own:
            dist.destroy_process_group()


# -- asynchronous sharded saves (issue 34) -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def async_runs(runs: Path) -> Path:
    """The launches of ``runs`` ran the sharded saves with ``async_save=True`` too, and the ones whose step-2 save
    fails."""
    return runs


@pytest.mark.parametrize("mode", ASYNC)
def test_async_sharded_resume_is_bitwise_the_uninterrupted_run(async_runs: Path, mode: str) -> None:
    test_resume_is_bitwise_the_uninterrupted_run(async_runs, mode)
    for name in ("half", "full"):  # every save written and committed by the end of fit
        folder = async_runs / mode / name
        assert sorted(p.name for p in folder.iterdir()) == (
            [CKPT] if name == "half" else [CKPT, "epoch=1-step=8.ckpt"])
        assert all(is_sharded_checkpoint(str(p)) for p in folder.iterdir())


@pytest.mark.parametrize("mode", ASYNC)
def test_async_sharded_retention_and_last_stay_in_order(async_runs: Path, mode: str) -> None:
    test_last_resumes_a_sharded_folder_and_retention_removes_folders_whole(async_runs, mode)


@pytest.mark.parametrize("mode", ASYNC)
def test_a_failed_async_sharded_save_is_raised_on_every_rank_and_leaves_no_folder(async_runs: Path,
                                                                                   mode: str) -> None:
    for rank in (0, 1):
        error = json.loads((async_runs / f"{mode}-failing.error{rank}.json").read_text())
        assert error is not None and error.startswith("CheckpointSaveError: "), (rank, error)
        assert "epoch=0-step=2.ckpt" in error, (rank, error)
    assert not (async_runs / mode / "failing" / "epoch=0-step=2.ckpt").exists()
