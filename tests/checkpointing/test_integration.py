"""The Lightning integration as users meet it: both copies of Lightning in either import order, pickling, explicit
binding of the plugin, ``load_from_checkpoint`` after ``import lightning_ort_ckpt`` alone, the spawn and fork
launchers with the callback alone, and a callback of the wrong copy of Lightning.

Tests marked ``smoke`` also run on the oldest supported Lightning (``scripts/floor.sh``, run by ``.ci/run``).
Scripts that depend on what a fresh process has imported run in a subprocess.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_ort_ckpt
from lightning_ort_ckpt import BindCheckpointIO, CheckpointError, OrtCheckpoint, OrtCheckpointIO, load_checkpoint
from lightning_ort_ckpt import lightning as for_lightning
from lightning_ort_ckpt.errors import CheckpointWarning
from lightning_ort_ckpt._lightning._lightning_adapter import MODEL_CHECKPOINT_PRIVATE

pytestmark = pytest.mark.smoke
ROOT = Path(__file__).resolve().parents[2]

MODEL = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make(base):
    class Net(base):
        def __init__(self, hidden=8):
            super().__init__()
            self.save_hyperparameters()
            self.l1, self.l2 = nn.Linear(4, hidden), nn.Linear(hidden, 1)

        def forward(self, x):
            return self.l2(torch.tanh(self.l1(x)))

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    return Net


def named(base, name, module):
    """The class for assignment to ``module.name`` (picklable: the spawn launcher pickles the LightningModule)."""
    cls = make(base)
    cls.__name__, cls.__qualname__, cls.__module__ = name, name, module
    return cls


def loader():
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)), batch_size=4)
'''


def python(code: str, cwd: Path, timeout: int = 300) -> str:
    """Run ``code`` in a fresh interpreter with this checkout first on the path; its stdout (fails on an error)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(cwd), os.environ.get("PYTHONPATH", "")])}
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK"):
        env.pop(name, None)  # the launchers decide these (a test in this process may have left a port in use)
    (cwd / "script.py").write_text(textwrap.dedent(code))
    result = subprocess.run([sys.executable, "script.py"], capture_output=True, text=True, cwd=cwd, env=env,
                            timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout


@pytest.fixture
def model_module(tmp_path: Path) -> Path:
    (tmp_path / "itmodel.py").write_text(MODEL)
    return tmp_path


def trainer_kwargs(root: Path) -> dict:
    return dict(max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=str(root))


# -- 1. one named plugin class per copy of Lightning, any import order, picklable --------------------------------
@pytest.mark.parametrize("first", ["lightning_ort_ckpt", "lightning"])
def test_plugin_classes_in_either_import_order(first: str, model_module: Path) -> None:
    out = python(f'''
        import pickle, warnings
        warnings.simplefilter("error", Warning)  # no CheckpointWarning: BindCheckpointIO binds the plugins
        warnings.filterwarnings("ignore", module="(pytorch_)?lightning")
        warnings.filterwarnings("ignore", message=".*(worker|LeafSpec|is_tensor_like|weights_only)")
        if "{first}" == "lightning_ort_ckpt":
            import lightning_ort_ckpt, lightning.pytorch as L, pytorch_lightning as pl
        else:
            import lightning.pytorch as L, pytorch_lightning as pl, lightning_ort_ckpt
        from lightning_ort_ckpt import BindCheckpointIO as BindPl, OrtCheckpointIO as ForPl, load_checkpoint
        from lightning_ort_ckpt.lightning import BindCheckpointIO as BindL, OrtCheckpointIO as ForL
        import itmodel
        assert ForL is not ForPl and ForL.__qualname__ == ForPl.__qualname__ == "OrtCheckpointIO"
        for package, io_class, bind in ((L, ForL, BindL), (pl, ForPl, BindPl)):
            plugin = pickle.loads(pickle.dumps(io_class(async_save=True)))
            assert type(plugin) is io_class and plugin.async_save
            trainer = package.Trainer(plugins=[plugin], callbacks=[bind()], max_epochs=1, accelerator="cpu",
                                      logger=False,
                                      enable_progress_bar=False, enable_model_summary=False,
                                      default_root_dir=package.__name__)
            trainer.fit(itmodel.make(package.LightningModule)(), itmodel.loader())
            ck = load_checkpoint(trainer.checkpoint_callback.best_model_path)
            print(package.__name__, sorted(ck.trainable), len(ck.optimizer_groups))
    ''', model_module)
    for package in ("lightning.pytorch", "pytorch_lightning"):
        assert f"{package} ['l1.bias', 'l1.weight', 'l2.bias', 'l2.weight'] 1" in out, out


def test_plugins_and_callbacks_pickle() -> None:
    for cls in (OrtCheckpointIO, for_lightning.OrtCheckpointIO):
        plugin = cls(external_data="never", ort_compatible=True)
        clone = pickle.loads(pickle.dumps(plugin))
        assert type(clone) is cls and (clone.external_data, clone.ort_compatible) == ("never", True)
    for cls in (OrtCheckpoint, for_lightning.OrtCheckpoint):
        clone = pickle.loads(pickle.dumps(cls(every_n_train_steps=3, keep_newest=2)))
        assert type(clone) is cls and clone.keep_newest == 2


# -- 3. explicit binding: Lightning's ModelCheckpoint with the plugin and BindCheckpointIO, its one extra line ------
@pytest.mark.parametrize("package", [pl, L], ids=["pytorch_lightning", "lightning"])
def test_plugin_with_lightnings_model_checkpoint_is_bound(package, model_module: Path, tmp_path: Path) -> None:
    sys.path.insert(0, str(model_module))
    try:
        import itmodel
    finally:
        sys.path.remove(str(model_module))
    io_class = OrtCheckpointIO if package is pl else for_lightning.OrtCheckpointIO
    bind = BindCheckpointIO if package is pl else for_lightning.BindCheckpointIO
    plugin = io_class()
    trainer = package.Trainer(plugins=[plugin], callbacks=[bind()], **trainer_kwargs(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        trainer.fit(itmodel.make(package.LightningModule)(), itmodel.loader())
        trainer.save_checkpoint(tmp_path / "manual.ckpt")
    assert plugin._owner_strategy() is trainer.strategy
    for path in (trainer.checkpoint_callback.best_model_path, tmp_path / "manual.ckpt"):
        ck = load_checkpoint(path)
        assert sorted(ck.trainable) == ["l1.bias", "l1.weight", "l2.bias", "l2.weight"]
        assert sorted(ck.optimizer_groups["group0"].states) == sorted(ck.trainable)  # keyed by parameter name


def test_plugin_outside_a_trainer_warns(tmp_path: Path) -> None:
    with pytest.warns(CheckpointWarning, match="not attached to a Trainer"):
        OrtCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(3)}}, tmp_path / "bare.ckpt")
    assert torch.equal(OrtCheckpointIO().load_checkpoint(tmp_path / "bare.ckpt")["state_dict"]["w"], torch.ones(3))


# -- 2. launchers with the callback alone; the wrong copy of Lightning -------------------------------------------
@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_notebook"])
def test_spawn_and_fork_launchers_with_the_callback_alone(strategy: str, model_module: Path) -> None:
    """The worker hands its weights back in a file its OrtCheckpointIO wrote; the main process reads it."""
    out = python(f'''
        import warnings
        warnings.filterwarnings("ignore")
        import pytorch_lightning as pl, torch
        from lightning_ort_ckpt import OrtCheckpoint, load_checkpoint
        from lightning_ort_ckpt._restore._reading import read_lightning_checkpoint
        import itmodel

        PlNet = itmodel.named(pl.LightningModule, "PlNet", __name__)
        if __name__ == "__main__":
            callback = OrtCheckpoint(dirpath="ckpts", save_last=True)
            model = PlNet()
            initial = [p.detach().clone() for p in model.parameters()]
            trainer = pl.Trainer(strategy="{strategy}", devices=2, num_nodes=1, accelerator="cpu", max_epochs=2,
                                 logger=False, enable_progress_bar=False, enable_model_summary=False,
                                 callbacks=[callback])
            trainer.fit(model, itmodel.loader())
            saved = load_checkpoint("ckpts/last.ckpt").trainable
            assert saved and all(torch.equal(saved[n], p) for n, p in model.named_parameters()), "weights differ"
            assert not any(torch.equal(a, b) for a, b in zip(initial, model.parameters())), "weights not handed back"
            print("ok", read_lightning_checkpoint("ckpts/last.ckpt")["global_step"], sorted(saved))
    ''', model_module, timeout=300)
    assert "ok 4 ['l1.bias', 'l1.weight', 'l2.bias', 'l2.weight']" in out, out


@pytest.mark.parametrize("wrong", ["pytorch_lightning callback, lightning Trainer",
                                   "lightning callback, pytorch_lightning Trainer"])
def test_callback_of_the_other_lightning_copy_raises(wrong: str, model_module: Path, tmp_path: Path) -> None:
    sys.path.insert(0, str(model_module))
    try:
        import itmodel
    finally:
        sys.path.remove(str(model_module))
    package, callback = (L, OrtCheckpoint()) if wrong.startswith("pytorch") else (pl, for_lightning.OrtCheckpoint())
    with pytest.raises((CheckpointError, ValueError)) as raised:
        trainer = package.Trainer(callbacks=[callback], **trainer_kwargs(tmp_path))
        trainer.fit(itmodel.make(package.LightningModule)(), itmodel.loader())
    if type(raised.value) is ValueError:  # older Lightning (2.5) refuses a foreign callback itself, in Trainer()
        assert str(raised.value) == "Expected a parent" and package.__version__ < "2.6"
    else:  # newer Lightning would take it as a plain callback and add its own ModelCheckpoint: ours refuses in setup
        assert "other copy of Lightning" in str(raised.value) and "use OrtCheckpoint from" in str(raised.value)
    assert not list(tmp_path.rglob("*.ckpt"))


# -- 4. load_from_checkpoint after one explicit call, enable_ort_loading() ---------------------------------------
@pytest.mark.parametrize("first", ["lightning_ort_ckpt", "pytorch_lightning"])
def test_load_from_checkpoint_after_enable_ort_loading(first: str, model_module: Path,
                                                                tmp_path: Path) -> None:
    sys.path.insert(0, str(model_module))
    try:
        import itmodel
    finally:
        sys.path.remove(str(model_module))
    callback = OrtCheckpoint(dirpath=tmp_path / "ckpts")
    model = itmodel.make(pl.LightningModule)(hidden=6)
    pl.Trainer(callbacks=[callback], **trainer_kwargs(tmp_path)).fit(model, itmodel.loader())
    torch.save({n: p.detach() for n, p in model.named_parameters()}, tmp_path / "expected.pt")
    second = "pytorch_lightning" if first == "lightning_ort_ckpt" else "lightning_ort_ckpt"
    out = python(f'''
        import io, sys, torch
        import {first}, {second}
        import pytorch_lightning as pl, itmodel
        lightning_ort_ckpt.enable_ort_loading()  # the one documented line
        assert "lightning_ort_ckpt._plugin" not in sys.modules  # no plugin, no callback: the loader alone
        Net = itmodel.make(pl.LightningModule)
        expected = torch.load("expected.pt")
        path = {str(callback.best_model_path)!r}
        with open(path, "rb") as f:
            stream = io.BytesIO(f.read())
        with open(path, "rb") as opened:
            for source, map_location in ((path, {{"cuda:0": "cpu"}}), (opened, "cpu"), (stream, None),
                                         (path, lambda storage, location: storage)):
                model = Net.load_from_checkpoint(source, map_location=map_location)
                assert model.hparams.hidden == 6
                assert all(torch.equal(expected[n], p) for n, p in model.named_parameters())
        print("loaded 4 ways")
    ''', model_module)
    assert "loaded 4 ways" in out


def test_file_like_torch_checkpoints_still_load(tmp_path: Path) -> None:
    """The wrapped loader hands anything that is not an ORT file to torch, unchanged."""
    from pytorch_lightning.core import saving

    buffer = io.BytesIO()
    torch.save({"state_dict": {"w": torch.arange(3.0)}}, buffer)
    buffer.seek(0)
    assert torch.equal(saving.pl_load(buffer, map_location="cpu")["state_dict"]["w"], torch.arange(3.0))
    lightning_ort_ckpt.enable_ort_loading()
    lightning_ort_ckpt.enable_ort_loading()  # twice: still one wrapper deep
    try:
        assert getattr(saving.pl_load, "reads_ort_checkpoints", False)
        assert not getattr(saving.pl_load.__wrapped__, "reads_ort_checkpoints", False)
        buffer.seek(0)
        assert torch.equal(saving.pl_load(buffer, map_location="cpu")["state_dict"]["w"], torch.arange(3.0))
    finally:
        lightning_ort_ckpt.disable_ort_loading()
        lightning_ort_ckpt.disable_ort_loading()


# -- 5. the private Lightning names we rely on exist ---------------------------------------------------------------
@pytest.mark.parametrize("package", [pl, L], ids=["pytorch_lightning", "lightning"])
def test_private_lightning_names_exist(package) -> None:
    missing = [name for name in MODEL_CHECKPOINT_PRIVATE if not hasattr(package.callbacks.ModelCheckpoint, name)]
    assert not missing, f"{package.__name__} {package.__version__} lacks {missing}"
    assert "save_on_exception" in package.callbacks.ModelCheckpoint.__init__.__code__.co_varnames

