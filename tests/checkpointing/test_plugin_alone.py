"""``plugins=[OrtCheckpointIO()]`` with Lightning's own ``ModelCheckpoint`` and no ``BindCheckpointIO``, under the
sharded strategies (2 CPU processes, gloo, launched as users launch them): the script of
``tests/lightning_side/test_sharded_strategies.py`` (in ``tests/helpers/sharded.py``) with that one change. The plugin
binds itself to the strategy Lightning hands it to, so every mode (ModelParallel and FSDP, sharded and full state) saves
files that resume bitwise, the full-state file is one ORT trains from, and no rank warns. (Single device and the zoo:
``tests/conformance/test_zoo.py``; the random states of a fit resumed without a callback: ``_train_start``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_ort_ckpt._dcp._dcp_storage import is_sharded_checkpoint
from lightning_ort_ckpt._restore._reading import read_contents
from helpers.ort_reference import ort_api, ort_parameters
from helpers.sharded import CKPT, MODES, SCRIPT, SHARDED, assert_same_state, record, state
from helpers.launching import launch_script

ALONE = (SCRIPT
         .replace("from lightning_ort_ckpt import OrtCheckpoint",
                  "from lightning_ort_ckpt import OrtCheckpointIO\nfrom pytorch_lightning.callbacks import ModelCheckpoint")
         .replace("cb = OrtCheckpoint(", "cb = ModelCheckpoint(")
         .replace(',\n                       async_save=kind.endswith("-async"))', ")")  # the plugin's setting
         .replace('accelerator="cpu",', 'accelerator="cpu", plugins=[OrtCheckpointIO(async_save=kind.endswith("-async"))],'))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp_path = tmp_path_factory.mktemp("alone")
    script = tmp_path / "train.py"
    script.write_text(ALONE)
    for phase in ("first", "resume"):  # the bound catches a hang, not a slow start on a loaded machine
        launch_script(script, [str(tmp_path), f"{phase}={','.join(MODES)}"], f"the run ({phase})", 900)
    return tmp_path


def test_the_script_is_the_plugin_alone() -> None:
    fit = ALONE[ALONE.index("def fit("):ALONE.index("def memory_of_full_saves")]  # what the phases run
    assert "OrtCheckpoint(" not in fit and "BindCheckpointIO" not in ALONE
    assert "cb = ModelCheckpoint(" in fit and "plugins=[OrtCheckpointIO(" in fit and "async_save" not in fit.split(
        "cb = ModelCheckpoint(")[1].split(")")[0]


@pytest.mark.parametrize("mode", MODES)
def test_the_plugin_alone_resumes_bitwise(runs: Path, mode: str) -> None:
    assert_same_state(state(runs, f"{mode}-full", "end"), state(runs, f"{mode}-resumed", "end"), mode)
    for rank in (0, 1):
        full, resumed = record(runs, f"{mode}-full", rank), record(runs, f"{mode}-resumed", rank)
        assert resumed["start"] == 4 and resumed["end"] == full["end"] == 8
        after = {k: v for k, v in full["rng"].items() if int(k) >= 4}
        assert resumed["rng"] == after, (mode, rank)  # every rank's random states, step by step
        assert not [w for w in resumed["warnings"] + full["warnings"] if "not attached" in w]


@pytest.mark.parametrize("mode", MODES)
def test_the_plugin_alone_writes_our_files(runs: Path, mode: str) -> None:
    path = runs / mode / "half" / CKPT
    assert is_sharded_checkpoint(str(path)) is (mode in SHARDED)
    if mode in SHARDED:
        return
    contents = read_contents(path)
    assert sorted(contents.trainable) == ["l1.bias", "l1.weight", "l2.bias", "l2.weight"]
    params = ort_parameters(ort_api().CheckpointState.load_checkpoint(str(path)))
    assert {name for name, (_, trainable) in params.items() if trainable} == set(contents.trainable)


def test_deepspeed_stops_the_plugin_alone_when_the_trainer_is_made() -> None:
    """DeepSpeed writes its own files: the plugin refuses it as Lightning hands it over, before anything trains."""
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy

    from lightning_ort_ckpt import OrtCheckpointIO
    from lightning_ort_ckpt.errors import CheckpointConfigError

    class CPUDeepSpeed(DeepSpeedStrategy):
        """Test only, as in test_sharded_strategies: DeepSpeedStrategy without the deepspeed package."""

        __init__ = DDPStrategy.__init__

    with pytest.raises(CheckpointConfigError, match="DeepSpeed writes its ZeRO checkpoints itself"):
        pl.Trainer(strategy=CPUDeepSpeed(), accelerator="cpu", devices=1, logger=False, plugins=[OrtCheckpointIO()])
