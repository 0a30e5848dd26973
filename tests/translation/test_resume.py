"""Resuming Lightning training from ORT files through a real ``Trainer``.

- An ORT file resumes bit for bit like Lightning's own checkpoint of the same moment (weights, every optimizer's
  state and hyperparameters, schedulers, step and epoch counters, logged metrics), for every torch optimizer and
  scheduler Lightning users commonly pick, manual optimization, and per-parameter step counts that differ.
- With the random states the plugin stores, an epoch-boundary resume (dropout, shuffling) equals the uninterrupted
  run bit for bit, whatever the user seeds before resuming, with or without validation. Mid-epoch, with a resumable
  loader, it is exact too; a plain DataLoader cannot resume mid-epoch, so there neither resume is exact.
- Only fitting restores the random states: validating from a checkpoint does not reseed the process.
- Typed metadata (hparams, callback states with float64, big ints, tuples, tensors) comes back exactly.
- Format switching, checkpoint rotation with ``.data`` companions, bad ``ckpt_path`` values, ``ort_compatible``.
"""

from __future__ import annotations

import collections
import copy
import json
import math
import os
import struct
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_ort_ckpt
from lightning_ort_ckpt import (BindCheckpointIO, CheckpointError, CorruptCheckpointError, DataType, load_checkpoint,
                                open_checkpoint)
from lightning_ort_ckpt.errors import CheckpointWarning
from lightning_ort_ckpt.format import save_checkpoint
from lightning_ort_ckpt.format import _atomic as atomic
from lightning_ort_ckpt._plugin import OrtCheckpointIO
from lightning_ort_ckpt._fit_state._data_position import DATA_KEY
from lightning_ort_ckpt._fit_state._rng import RNG_KEY
from lightning_ort_ckpt._restore._reading import read_lightning_checkpoint
from lightning_ort_ckpt._translation import MANIFEST
from lightning_ort_ckpt._translation.values import Unsaved
from helpers.ort_reference import assert_same_tensor
from helpers.loaders import ResumableShuffleLoader

pytestmark = [
    # any reduced save or restore our plugin reports is a failure here, unless a test expects it (pytest.warns)
    pytest.mark.filterwarnings("error::lightning_ort_ckpt.errors.CheckpointWarning"),
]

K = 6  # steps before the save in the native-equivalence tests; the resume trains to 2 * K


@pytest.fixture(autouse=True)
def _restore_seed_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """seed_everything sets PL_GLOBAL_SEED/PL_SEED_WORKERS; undo that after each test."""
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(name, raising=False)


# -- comparison -------------------------------------------------------------------------------------------------


def assert_same_value(actual: Any, expected: Any, where: str = "value") -> None:
    """Same type all the way down (tuple stays tuple, float stays float), floats and tensors bit for bit."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__} is not a tensor"
        assert_same_tensor(actual, expected, where)
        return
    # a state_dict is an OrderedDict in memory and a dict after any JSON round trip; the order is what counts
    mapping = {dict, collections.OrderedDict}
    assert type(actual) is type(expected) or {type(actual), type(expected)} <= mapping, \
        f"{where}: {type(actual).__name__} != {type(expected).__name__} ({actual!r} vs {expected!r})"
    if isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype, f"{where}: {actual.dtype} != {expected.dtype}"
        assert_same_tensor(actual, expected, where)
    elif isinstance(expected, (float, np.floating)):
        assert struct.pack("<d", float(actual)) == struct.pack("<d", float(expected)), \
            f"{where}: {actual!r} != {expected!r} bitwise"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for k, v in expected.items():
            assert_same_value(actual[k], v, f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same_value(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def training_state(trainer: pl.Trainer) -> dict[str, Any]:
    """Everything that decides the rest of a run, as values (copied)."""
    return copy.deepcopy({
        "state_dict": trainer.lightning_module.state_dict(),
        "optimizers": [opt.state_dict() for opt in trainer.optimizers],
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "callback_metrics": dict(trainer.callback_metrics),
        "logged_metrics": dict(trainer.logged_metrics),
    })


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


# -- model, data, trainer ---------------------------------------------------------------------------------------


def dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


TRAIN, VAL = dataset(16, 1), dataset(8, 2)


def loaders(*, shuffle: bool = False, val: bool = True, batch_size: int = 4) -> dict[str, Any]:
    return {"train_dataloaders": DataLoader(TRAIN, batch_size=batch_size, shuffle=shuffle),
            "val_dataloaders": DataLoader(VAL, batch_size=8) if val else None}


class Net(pl.LightningModule):
    """Linear -> BatchNorm (buffers, an int64 counter) -> ReLU -> Dropout -> Linear, times a frozen parameter."""

    def __init__(self, case: str = "adamw", dropout: float = 0.0) -> None:
        super().__init__()
        self.case = case
        self.l1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(dropout)
        self.l2 = nn.Linear(8, 1)
        self.scale = nn.Parameter(torch.full((1,), 0.75), requires_grad=False)
        self.automatic_optimization = case != "manual_two_optimizers"

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.l1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.drop(self.hidden(x))) * self.scale

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        if self.automatic_optimization:
            return loss
        opt_a, opt_b = self.optimizers()
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(loss)
        opt_a.step()
        opt_b.step()
        self.lr_schedulers().step()
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # torch skips parameters whose grad is None: their per-parameter step lags, or they have no state yet
        if self.case == "lagging_steps" and self.trainer.global_step < 2:
            self.l2.weight.grad = None
        if self.case == "no_state_yet" and self.trainer.global_step < K + 2:
            self.l2.bias.grad = None

    def configure_optimizers(self) -> Any:
        case, params = self.case, list(self.parameters())
        adamw = torch.optim.AdamW(params, lr=0.01, weight_decay=0.05)
        if case in ("adamw", "lagging_steps", "no_state_yet"):
            return adamw
        if case == "adam_amsgrad":
            return torch.optim.Adam(params, lr=0.01, amsgrad=True)
        if case == "sgd_nesterov":
            return torch.optim.SGD(params, lr=0.02, momentum=0.9, nesterov=True)
        if case == "adagrad":
            return torch.optim.Adagrad(params, lr=0.05)
        if case == "rmsprop_centered":
            return torch.optim.RMSprop(params, lr=0.005, momentum=0.5, centered=True)
        if case == "two_param_groups":
            return torch.optim.AdamW([
                {"params": list(self.l1.parameters()), "lr": 0.02, "weight_decay": 0.1},
                {"params": [*self.bn.parameters(), *self.l2.parameters()], "lr": 0.005, "weight_decay": 0.0}])
        if case == "manual_two_optimizers":
            opt_a = torch.optim.Adam(self.l1.parameters(), lr=0.01)
            opt_b = torch.optim.SGD([*self.bn.parameters(), *self.l2.parameters()], lr=0.02, momentum=0.9)
            return [opt_a, opt_b], [torch.optim.lr_scheduler.StepLR(opt_b, step_size=2, gamma=0.5)]
        if case == "steplr":
            scheduler: Any = torch.optim.lr_scheduler.StepLR(adamw, step_size=2, gamma=0.5)
            return {"optimizer": adamw, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        if case == "onecycle":
            scheduler = torch.optim.lr_scheduler.OneCycleLR(adamw, max_lr=0.05, total_steps=2 * K)
            return {"optimizer": adamw, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        if case == "plateau":
            # threshold 0.5: no epoch counts as an improvement, so the learning rate really drops
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(adamw, factor=0.5, patience=0, threshold=0.5)
            return {"optimizer": adamw, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}
        raise AssertionError(case)


def trainer(root: Any, *, plugin: OrtCheckpointIO | bool = True, callbacks: Iterable[pl.Callback] = (),
            **kwargs: Any) -> pl.Trainer:
    callbacks = list(callbacks)
    plugins = [plugin] if isinstance(plugin, OrtCheckpointIO) else [OrtCheckpointIO()] if plugin else None
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, deterministic=True, default_root_dir=os.fspath(root),
                      enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                      callbacks=[*callbacks, BindCheckpointIO()] if plugins else callbacks, plugins=plugins, **kwargs)


def save_native(t: pl.Trainer, path: Any) -> None:
    """Lightning's own checkpoint of this moment, written by Lightning's own CheckpointIO."""
    TorchCheckpointIO().save_checkpoint(t._checkpoint_connector.dump_checkpoint(), path)


def without_rng(checkpoint: dict[str, Any]) -> dict[str, Any]:
    checkpoint = dict(checkpoint)
    checkpoint.pop(RNG_KEY, None)
    checkpoint.pop(DATA_KEY, None)
    return checkpoint


# -- 1. bitwise equal to Lightning's native resume --------------------------------------------------------------

CASES = ["adamw", "adam_amsgrad", "sgd_nesterov", "adagrad", "rmsprop_centered", "two_param_groups",
         "manual_two_optimizers", "steplr", "onecycle", "plateau", "lagging_steps", "no_state_yet"]


@pytest.mark.parametrize("case", CASES)
def test_resume_equals_native_resume(tmp_path: Any, case: str) -> None:
    first = trainer(tmp_path, max_steps=K, num_sanity_val_steps=0)
    first.fit(Net(case), **loaders())
    ort, native = tmp_path / "x.ort", tmp_path / "x.ckpt"
    first.save_checkpoint(ort)
    save_native(first, native)

    # the file itself: the checkpoint dict read back equals Lightning's, value for value and type for type
    saved = torch.load(native, weights_only=False)
    assert_same_value(without_rng(read_lightning_checkpoint(ort)), saved, "checkpoint")
    if case == "lagging_steps":  # the per-parameter steps really differ at the save
        steps = {s["step"].item() for s in saved["optimizer_states"][0]["state"].values()}
        assert steps == {K - 2, K}
    if case == "no_state_yet":
        assert len(saved["optimizer_states"][0]["state"]) == len([p for p in Net().parameters() if p.requires_grad]) - 1

    finals = []
    for path in (ort, native):
        t = trainer(tmp_path, max_steps=2 * K, num_sanity_val_steps=0)
        t.fit(Net(case), **loaders(), ckpt_path=path)
        finals.append(training_state(t))
    from_ort, from_native = finals
    assert from_native["global_step"] == 2 * K
    assert set(from_native["callback_metrics"]) >= {"train_loss", "val_loss"}
    assert_same_value(from_ort, from_native, "resumed")
    if case == "plateau":
        assert from_native["optimizers"][0]["param_groups"][0]["lr"] < 0.01


# -- 2. epoch-boundary resume equals the uninterrupted run -------------------------------------------------------


def shuffled(val: bool) -> dict[str, Any]:
    return loaders(shuffle=True, val=val)


@pytest.mark.parametrize("save", ["model_checkpoint", "after_fit"])
@pytest.mark.parametrize("val", [False, True], ids=["no_val", "val"])
def test_epoch_boundary_resume_equals_uninterrupted_run(tmp_path: Any, val: bool, save: str) -> None:
    pl.seed_everything(0)
    uninterrupted = Net("adamw", dropout=0.3)
    trainer(tmp_path, max_epochs=2).fit(uninterrupted, **shuffled(val))

    pl.seed_everything(0)
    callbacks = [ModelCheckpoint(tmp_path / "ckpts", every_n_epochs=1, save_top_k=-1)] if save == "model_checkpoint" else []
    first = trainer(tmp_path, max_epochs=1, callbacks=callbacks)
    first.fit(Net("adamw", dropout=0.3), **shuffled(val))
    path = tmp_path / "ckpts" / "epoch=0-step=4.ckpt"
    if save == "after_fit":
        path = tmp_path / "after_fit.ort"
        first.save_checkpoint(path)

    pl.seed_everything(123)  # the resume must not depend on what the user seeds
    resumed = Net("adamw", dropout=0.3)
    t = trainer(tmp_path, max_epochs=2)
    t.fit(resumed, **shuffled(val), ckpt_path=path)
    assert t.global_step == 8
    assert_same_value(resumed.state_dict(), uninterrupted.state_dict(), "weights")


@pytest.mark.parametrize("callback", ["OrtCheckpoint", "ModelCheckpoint"])
def test_resume_from_a_save_at_validation_end(tmp_path: Any, callback: str) -> None:
    """Saved at validation end, inside its epoch: resuming first draws a loader iterator that finishes that epoch.
    The random states are restored at on_train_start, after that draw: exact with OrtCheckpoint, and with Lightning's
    ModelCheckpoint and the plugin bound by BindCheckpointIO (which this module's trainer() adds)."""
    from lightning_ort_ckpt import OrtCheckpoint

    def checkpoints(dirpath: Any) -> pl.Callback:
        kind = OrtCheckpoint if callback == "OrtCheckpoint" else ModelCheckpoint
        return kind(dirpath, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=False)

    pl.seed_everything(0)
    uninterrupted = Net("adamw", dropout=0.3)
    trainer(tmp_path, max_epochs=2, callbacks=[checkpoints(tmp_path / "full")]).fit(uninterrupted, **shuffled(True))
    pl.seed_everything(123)
    resumed = Net("adamw", dropout=0.3)
    t = trainer(tmp_path, max_epochs=2, callbacks=[checkpoints(tmp_path / "resumed")])
    t.fit(resumed, **shuffled(True), ckpt_path=tmp_path / "full" / "epoch=0-step=4.ckpt")
    assert t.global_step == 8
    assert_same_value(resumed.state_dict(), uninterrupted.state_dict(), "weights")


def test_native_epoch_boundary_resume_is_not_exact_without_our_rng_states(tmp_path: Any) -> None:
    """The control for the test above: it would catch a resume that ignored the random states."""
    pl.seed_everything(0)
    uninterrupted = Net("adamw", dropout=0.3)
    trainer(tmp_path, max_epochs=2).fit(uninterrupted, **shuffled(False))
    pl.seed_everything(0)
    first = trainer(tmp_path, max_epochs=1)
    first.fit(Net("adamw", dropout=0.3), **shuffled(False))
    save_native(first, tmp_path / "x.ckpt")
    pl.seed_everything(123)
    resumed = Net("adamw", dropout=0.3)
    trainer(tmp_path, max_epochs=2).fit(resumed, **shuffled(False), ckpt_path=tmp_path / "x.ckpt")
    assert max_abs_diff(resumed.state_dict(), uninterrupted.state_dict()) > 0


# -- 3. mid-epoch resume ----------------------------------------------------------------------------------------


class SaveNativeAt(pl.Callback):
    def __init__(self, step: int, path: Any) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            save_native(trainer, self.path)


@pytest.mark.parametrize("loader", ["dataloader", "resumable"])
def test_mid_epoch_resume_is_exact_where_native_is_not(tmp_path: Any, record_property: Any, loader: str) -> None:
    def data() -> dict[str, Any]:
        if loader == "resumable":
            return {"train_dataloaders": ResumableShuffleLoader(TRAIN, batch_size=4)}
        return shuffled(False)

    pl.seed_everything(0)
    uninterrupted = Net("adamw", dropout=0.3)
    trainer(tmp_path, max_epochs=2).fit(uninterrupted, **data())

    pl.seed_everything(0)
    native = tmp_path / "native-step2.ckpt"
    callbacks = [ModelCheckpoint(tmp_path / "ckpts", every_n_train_steps=2, save_top_k=-1), SaveNativeAt(2, native)]
    trainer(tmp_path, max_epochs=1, callbacks=callbacks).fit(Net("adamw", dropout=0.3), **data())
    ort = tmp_path / "ckpts" / "epoch=0-step=2.ckpt"

    diffs = {}
    for name, path in (("ort", ort), ("native", native)):
        pl.seed_everything(123)
        resumed = Net("adamw", dropout=0.3)
        t = trainer(tmp_path, max_epochs=2)
        t.fit(resumed, **data(), ckpt_path=path)
        assert t.global_step == 8
        diffs[name] = max_abs_diff(resumed.state_dict(), uninterrupted.state_dict())
    print(f"mid-epoch resume ({loader}, saved at step 2 of 4, dropout 0.3, shuffled): max |w - w_uninterrupted| "
          f"ORT file {diffs['ort']:.3e}, native .ckpt {diffs['native']:.3e}")
    record_property("mid_epoch_max_abs_diff_ort", diffs["ort"])
    record_property("mid_epoch_max_abs_diff_native", diffs["native"])
    assert diffs["native"] > 0  # dropout masks and the next permutation depend on the random states
    # Lightning cannot resume a plain DataLoader mid-epoch (it restarts it with a new permutation); our file carries
    # the data position, so the plain DataLoader resumes exactly too (docs/mapping.md, "Exact resume")
    assert diffs["ort"] == 0.0


# -- 4. typed metadata ------------------------------------------------------------------------------------------

HPARAMS: dict[str, Any] = {
    "lr": 0.1, "third": 1 / 3, "tiny": 1e-300, "neg_zero": -0.0, "inf": math.inf,
    "big": 2**53 + 1, "huge": 2**63 - 1, "negative": -(2**62) - 5,
    "nothing": None, "flag": True, "off": False, "name": "résumé ✓",
    "nested": {"a": [1, 2.5, (3, "four", None)], "b": {"c": (0.1, True), "d": []}}, "pair": (1, (2.0, [3])),
}


class HParamNet(Net):
    def __init__(self, lr: float = 0.0, third: float = 0.0, tiny: float = 0.0, neg_zero: float = 0.0,
                 inf: float = 0.0, big: int = 0, huge: int = 0, negative: int = 0, nothing: Any = 1,
                 flag: bool = False, off: bool = True, name: str = "", nested: Any = None, pair: Any = None) -> None:
        super().__init__("adamw")
        self.save_hyperparameters()


class EmaCallback(pl.Callback):
    """Keeps a float64 best score, an EMA of the weights in float64 and a big tensor; records what it gets back."""

    def __init__(self) -> None:
        self.best = math.inf
        self.updates = 0
        self.ema: dict[str, torch.Tensor] = {}
        self.bank = torch.randn(300, 300, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        self.saved: dict[str, Any] | None = None
        self.received: dict[str, Any] | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.best = min(self.best, outputs["loss"].item() / 3)  # float64, not float32-exact
        for n, p in pl_module.named_parameters():
            p = p.detach().double()
            self.ema[n] = p.clone() if n not in self.ema else 0.9 * self.ema[n] + 0.1 * p
        self.bank.mul_(1.0 + 1 / 3)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        state = {"best": self.best, "updates": self.updates, "ema": self.ema,
                 "bank": self.bank, "marker": torch.tensor([1, 2**40, -3]), "arr": np.arange(6.0).reshape(2, 3) / 7,
                 "meta": {"ids": (2**60 + 7, -1), "ratio": 1 / 3, "tags": ["a", None, True, 1e-310],
                          "by_int": {1: "one", (2, 3): "tuple key"}, "kinds": {"x", "y"}, "raw": b"\x00\xff"}}
        self.saved = copy.deepcopy(state)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.received = state_dict


def test_typed_metadata_round_trip(tmp_path: Any) -> None:
    model, callback = HParamNet(**HPARAMS), EmaCallback()
    first = trainer(tmp_path, max_steps=3, callbacks=[callback], num_sanity_val_steps=0)
    first.fit(model, **loaders())
    path = tmp_path / "typed.ort"
    first.save_checkpoint(path)
    assert callback.saved is not None

    # tensors nested in callback state are real tensors in the file, not encoded text
    with open_checkpoint(path) as reader:
        extra = {n: reader.torch(i).clone() for n, i in reader.frozen.items() if n.startswith("lightning:callbacks/")}
    bank = [t for t in extra.values() if t.shape == (300, 300)]
    assert len(bank) == 1 and bank[0].dtype == torch.float64
    assert_same_tensor(bank[0], callback.saved["bank"], "bank in the file")
    assert len(extra) == 2 + len(callback.saved["ema"]) + 1  # bank, marker, EMA tensors, the numpy array

    fresh = EmaCallback()
    resumed = HParamNet(**HPARAMS)
    trainer(tmp_path, max_steps=4, callbacks=[fresh], num_sanity_val_steps=0).fit(resumed, **loaders(), ckpt_path=path)
    assert_same_value(fresh.received, callback.saved, "callback state")

    loaded = lightning_ort_ckpt.load_from_checkpoint(HParamNet, path)
    assert_same_value(dict(loaded.hparams), dict(model.hparams), "hparams")
    assert_same_value(dict(loaded.hparams), HPARAMS, "hparams")
    assert_same_value(loaded.state_dict(), model.state_dict(), "weights")
    assert_same_value(read_lightning_checkpoint(path)["hyper_parameters"], HPARAMS, "hyper_parameters")


def test_validate_from_an_ort_file_does_not_reseed(tmp_path: Any) -> None:
    t = trainer(tmp_path, max_steps=2, limit_val_batches=0)
    t.fit(Net("adamw"), **loaders())
    t.save_checkpoint(tmp_path / "v.ort")
    save_native(t, tmp_path / "v.ckpt")
    after = {}
    for name in ("v.ort", "v.ckpt"):
        torch.manual_seed(999)
        trainer(tmp_path).validate(Net("adamw"), dataloaders=loaders()["val_dataloaders"], ckpt_path=tmp_path / name)
        after[name] = torch.get_rng_state()
    assert torch.equal(after["v.ort"], after["v.ckpt"])  # the saved states were not restored


def test_numpy_float64_scalar_keeps_its_type(tmp_path: Any) -> None:
    callback = EmaCallback()
    callback.state_dict = lambda: {"best_np": np.float64(1 / 3), "f32": np.float32(0.1)}  # type: ignore[method-assign]
    first = trainer(tmp_path, max_steps=1, callbacks=[callback], num_sanity_val_steps=0, limit_val_batches=0)
    first.fit(Net("adamw"), **loaders())
    first.save_checkpoint(tmp_path / "np.ort")
    fresh = EmaCallback()
    trainer(tmp_path, max_steps=2, callbacks=[fresh], limit_val_batches=0).fit(
        Net("adamw"), **loaders(), ckpt_path=tmp_path / "np.ort")
    assert_same_value(fresh.received, {"best_np": np.float64(1 / 3), "f32": np.float32(0.1)}, "callback state")


class ModuleHParamNet(Net):
    def __init__(self, head: Any = None, width: int = 8) -> None:
        super().__init__("adamw")
        self.save_hyperparameters()


def test_module_hparam_warns_and_loads_as_placeholder(tmp_path: Any) -> None:
    model = ModuleHParamNet(head=nn.Linear(3, 2), width=8)
    first = trainer(tmp_path, max_steps=2, num_sanity_val_steps=0)
    first.fit(model, **loaders())
    path = tmp_path / "module.ort"
    with pytest.warns(CheckpointWarning, match=r"\['hyper_parameters'\]\['head'\].*torch\.nn\.modules\.linear\.Linear"):
        first.save_checkpoint(path)
    head = read_lightning_checkpoint(path)["hyper_parameters"]["head"]
    assert isinstance(head, Unsaved) and "Linear(in_features=3, out_features=2" in repr(head), head
    loaded = lightning_ort_ckpt.load_from_checkpoint(ModuleHParamNet, path)
    assert repr(loaded.hparams.head) == repr(head) and loaded.hparams.width == 8
    with pytest.raises(CheckpointError, match="was not saved and cannot be used"):
        loaded.hparams.head.weight  # a model that uses the value fails loudly, never with a stand-in
    assert_same_value(loaded.state_dict(), model.state_dict(), "weights")
    # and the file still resumes
    t = trainer(tmp_path, max_steps=4, num_sanity_val_steps=0)
    t.fit(ModuleHParamNet(head=nn.Linear(3, 2)), **loaders(), ckpt_path=path)
    assert t.global_step == 4


# -- 5. format switching and rotation ---------------------------------------------------------------------------


def test_plugin_resumes_a_torch_checkpoint_like_lightning_does(tmp_path: Any) -> None:
    first = trainer(tmp_path, plugin=False, max_steps=K, num_sanity_val_steps=0)
    first.fit(Net("steplr"), **loaders())
    path = tmp_path / "plain.ckpt"
    first.save_checkpoint(path)
    assert open(path, "rb").read(4) == b"PK\x03\x04"  # a torch zip file, not ORT

    finals, trainers = [], []
    for plugin in (True, False):
        t = trainer(tmp_path, plugin=plugin, max_steps=2 * K, num_sanity_val_steps=0)
        t.fit(Net("steplr"), **loaders(), ckpt_path=path)
        finals.append(training_state(t))
        trainers.append(t)
    assert_same_value(finals[0], finals[1], "resumed")
    # the run that resumed from a torch file now writes ORT files, which resume in turn
    trainers[0].save_checkpoint(tmp_path / "next.ort")
    assert open(tmp_path / "next.ort", "rb").read(8)[4:] == b"ODTC"
    t = trainer(tmp_path, max_steps=2 * K + 1, num_sanity_val_steps=0)
    t.fit(Net("steplr"), **loaders(), ckpt_path=tmp_path / "next.ort")
    assert t.global_step == 2 * K + 1


def test_rotation_removes_old_files_and_their_data_companions(tmp_path: Any) -> None:
    dirpath = tmp_path / "ckpts"
    callback = ModelCheckpoint(dirpath, every_n_train_steps=1, save_top_k=1, save_last=True)
    t = trainer(tmp_path, plugin=OrtCheckpointIO(external_data="params"), max_steps=5, callbacks=[callback],
                num_sanity_val_steps=0)
    t.fit(Net("adamw"), **loaders(val=False))
    expected = {"epoch=1-step=5.ckpt", "epoch=1-step=5.ckpt.data", "last.ckpt", "last.ckpt.data"}
    assert {n for n in os.listdir(dirpath) if not n.startswith(".")} == expected
    atomic.wait_for_cleanup()
    assert set(os.listdir(dirpath)) == expected  # no temporary or retired file is left behind
    with open_checkpoint(dirpath / "last.ckpt") as reader:
        assert reader.has_external_data and set(reader.trainable) >= {"l1.weight", "l2.bias"}
    resumed = trainer(tmp_path, plugin=OrtCheckpointIO(external_data="params"), max_steps=6, num_sanity_val_steps=0)
    resumed.fit(Net("adamw"), **loaders(val=False), ckpt_path=dirpath / "last.ckpt")
    assert resumed.global_step == 6


def test_one_plugin_instance_shared_by_two_trainers(tmp_path: Any) -> None:
    plugin = OrtCheckpointIO()
    first = trainer(tmp_path, plugin=plugin, max_steps=1, limit_val_batches=0)
    first.fit(Net("adamw"), **loaders())
    first.save_checkpoint(tmp_path / "first.ort")
    second = trainer(tmp_path, plugin=plugin, max_steps=1, limit_val_batches=0)
    second.fit(HalfNet(), **loaders())  # one more trainable parameter, "gain"
    second.save_checkpoint(tmp_path / "second.ort")
    with open_checkpoint(tmp_path / "second.ort") as reader:
        assert "gain" in reader.trainable
        assert "gain" in reader.optimizer_groups["group0"].states


# -- 6. bad ckpt_path -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_ort(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    root = tmp_path_factory.mktemp("good")
    t = trainer(root, max_steps=2, num_sanity_val_steps=0)
    t.fit(Net("adamw"), **loaders())
    t.save_checkpoint(root / "good.ort")
    return (root / "good.ort").read_bytes()


def resume(root: Any, path: Any) -> pl.Trainer:
    t = trainer(root, max_steps=4, num_sanity_val_steps=0)
    t.fit(Net("adamw"), **loaders(), ckpt_path=path)
    return t


def assert_names_file(error: BaseException, path: Any) -> None:
    assert os.fspath(path) in str(error), f"{error!r} does not name {path}"


@pytest.mark.parametrize("keep", [8, 64, 0.5, -1])
def test_truncated_ort_file_raises_our_error(tmp_path: Any, good_ort: bytes, keep: float) -> None:
    path = tmp_path / "truncated.ort"
    path.write_bytes(good_ort[:int(len(good_ort) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(CorruptCheckpointError) as info:
        resume(tmp_path, path)
    assert_names_file(info.value, path)


def test_random_bytes_with_ort_identifier_raise_our_error(tmp_path: Any) -> None:
    rng = np.random.default_rng(7)
    for i in range(5):
        body = bytearray(rng.integers(0, 256, size=int(rng.integers(8, 4096)), dtype=np.uint8).tobytes())
        body[4:8] = b"ODTC"
        path = tmp_path / f"random{i}.ort"
        path.write_bytes(bytes(body))
        with pytest.raises(CorruptCheckpointError) as info:
            resume(tmp_path, path)
        assert_names_file(info.value, path)


def test_non_ort_paths_get_lightnings_and_torchs_errors(tmp_path: Any) -> None:
    """Anything without the ORT identifier goes to Lightning's TorchCheckpointIO: FileNotFoundError for a missing
    path, IsADirectoryError for a directory (the system's errors, naming the file), and for other bytes our
    CorruptCheckpointError naming the file (torch.load's UnpicklingError does not)."""
    missing = tmp_path / "missing.ort"
    with pytest.raises(FileNotFoundError) as info:
        resume(tmp_path, missing)
    assert_names_file(info.value, missing)

    directory = tmp_path / "a_directory.ort"
    directory.mkdir()
    with pytest.raises(IsADirectoryError) as info2:
        resume(tmp_path, directory)
    assert_names_file(info2.value, directory)

    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"\x00\x01not a checkpoint of any kind" * 10)
    with pytest.raises(CorruptCheckpointError, match="neither an ORT checkpoint nor a torch checkpoint") as info3:
        resume(tmp_path, garbage)
    assert_names_file(info3.value, garbage)


def _tensor_ref(name: str) -> dict[str, Any]:
    return {"__tensor__": name}


def _damage(manifest: dict[str, Any], how: str) -> None:
    values = manifest["values"]
    if how == "param_missing":
        manifest["state_dict"].append("ghost.weight")
    elif how == "value_missing":
        del values["global_step"]
    elif how == "tensor_ref_missing":
        manifest["optimizers"][0]["state_dict"]["state"]["1"]["exp_avg"] = {"__tensor__": ["group0", "nope", "m"]}
    elif how == "tensor_ref_bad_type":
        manifest["optimizers"][0]["state_dict"]["state"]["1"]["exp_avg"] = {"__tensor__": {"a": 1}}
    elif how == "optimizers_not_list":
        manifest["optimizers"] = "x"
    elif how == "newer_version":
        manifest["version"] = 99
    elif how == "bad_cast":
        manifest["cast"] = {"l1.weight": "no_such_dtype"}
    elif how == "bad_tags":
        values["epoch"] = {"__dict__": [[[1], 2]]}
    elif how == "rng_states_missing":
        values[RNG_KEY] = {}
    elif how == "rng_torch_state_wrong":
        values[RNG_KEY]["torch"] = _tensor_ref("l1.weight")
    elif how == "rng_python_state_wrong":
        values[RNG_KEY]["python"] = {"__tuple__": [3, _tensor_ref("l2.bias"), None]}
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", [
    "param_missing", "value_missing", "tensor_ref_missing", "tensor_ref_bad_type", "optimizers_not_list",
    "newer_version", "bad_cast", "bad_tags",
    "rng_states_missing",
    "rng_torch_state_wrong",
    "rng_python_state_wrong",
])
def test_damaged_lightning_metadata_raises_our_error(tmp_path: Any, good_ort: bytes, how: str) -> None:
    good = tmp_path / "good.ort"
    good.write_bytes(good_ort)
    ck = load_checkpoint(good)
    manifest = json.loads(ck.properties[MANIFEST])
    _damage(manifest, how)
    ck.properties[MANIFEST] = json.dumps(manifest)
    path = tmp_path / f"{how}.ort"
    save_checkpoint(ck, path)
    with pytest.raises(CorruptCheckpointError) as info:
        resume(tmp_path, path)
    assert_names_file(info.value, path)


def test_unparsable_manifest_raises_our_error(tmp_path: Any, good_ort: bytes) -> None:
    good = tmp_path / "good.ort"
    good.write_bytes(good_ort)
    ck = load_checkpoint(good)
    ck.properties[MANIFEST] = ck.properties[MANIFEST][:-10]
    path = tmp_path / "cut_manifest.ort"
    save_checkpoint(ck, path)
    with pytest.raises(CorruptCheckpointError) as info:
        resume(tmp_path, path)
    assert_names_file(info.value, path)


# -- 7. ort_compatible ------------------------------------------------------------------------------------------


class HalfNet(Net):
    """A float16 parameter and a bfloat16 running buffer, trained in float32 around them."""

    def __init__(self) -> None:
        super().__init__("adamw")
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 8).to(torch.float16))
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, 8).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(x) * self.gain.float() + self.offset.float()
        if self.training:
            with torch.no_grad():
                self.offset.copy_((0.5 * self.offset.float() + 0.5 * h.mean(0)).to(torch.bfloat16))
        return self.l2(h) * self.scale


def test_ort_compatible_stores_float32_and_restores_narrow_dtypes(tmp_path: Any) -> None:
    plugin = OrtCheckpointIO(ort_compatible=True)
    first = trainer(tmp_path, plugin=plugin, max_steps=K, num_sanity_val_steps=0)
    first.fit(HalfNet(), **loaders())
    ort, native = tmp_path / "half.ort", tmp_path / "half.ckpt"
    first.save_checkpoint(ort)
    save_native(first, native)

    with open_checkpoint(ort) as reader:
        assert reader.trainable["gain"].dtype == DataType.FLOAT
        assert reader.frozen["offset"].dtype == DataType.FLOAT
        assert reader.optimizer_groups["group0"].states["gain"]["momentum0"].dtype == DataType.FLOAT
        assert not {i.dtype for i in reader.tensors()} & {DataType.FLOAT16, DataType.BFLOAT16}

    saved = torch.load(native, weights_only=False)
    assert saved["state_dict"]["gain"].dtype == torch.float16 and saved["state_dict"]["offset"].dtype == torch.bfloat16
    assert_same_value(without_rng(read_lightning_checkpoint(ort)), saved, "checkpoint")

    finals = []
    for path in (ort, native):
        t = trainer(tmp_path, plugin=OrtCheckpointIO(ort_compatible=True), max_steps=2 * K, num_sanity_val_steps=0)
        t.fit(HalfNet(), **loaders(), ckpt_path=path)
        finals.append(training_state(t))
    assert finals[0]["state_dict"]["gain"].dtype == torch.float16
    assert_same_value(finals[0], finals[1], "resumed")
