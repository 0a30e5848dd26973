"""``lightning.Fabric(plugins=[plugin])`` and ``plugin.bind(fabric.strategy)`` with real Fabric runs: ``fabric.save``
writes files ORT loads and trains from (trainable parameters and AdamW moments named from the module and optimizer in the saved state),
``fabric.load`` gives back exactly what was saved (``strict=False`` and partial states too), and Fabric's sharded
strategies, which take no ``CheckpointIO``, refuse the plugin when the Fabric is made."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch

L = pytest.importorskip("lightning")
pytest.importorskip("onnxruntime.training")

from lightning_ort_ckpt.errors import CheckpointWarning
from lightning_ort_ckpt.format import load_checkpoint
from lightning_ort_ckpt.lightning import OrtCheckpointIO
from helpers.ort_reference import assert_same_tensor, export_artifacts, ort_api, ort_parameters, ort_train


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _trained(fabric: Any, seed: int = 0, steps: int = 3) -> tuple[Any, Any]:
    """A module and its AdamW, set up by ``fabric`` and trained ``steps`` steps."""
    model, optimizer = fabric.setup(*(lambda m: (m, torch.optim.AdamW(m.parameters(), lr=0.01)))(_net(seed)))
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
        fabric.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


@pytest.fixture
def fabric() -> Any:
    plugin = OrtCheckpointIO()
    made = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    plugin.bind(made.strategy)  # as the guide shows (unbound: deprecated, test_nothing_global.py)
    return made


@pytest.fixture
def saved(fabric: Any, tmp_path: Any) -> tuple[Any, Any, Any, str]:
    """A Fabric run saved with ``fabric.save``, with CheckpointWarnings as errors (there must be none)."""
    model, optimizer = _trained(fabric)
    path = str(tmp_path / "fabric.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
    return fabric, model, optimizer, path


def test_fabric_save_writes_a_file_ort_trains_from(saved: Any, tmp_path: Any) -> None:
    fabric, model, optimizer, path = saved
    module = model.module if hasattr(model, "module") else model
    ck = load_checkpoint(path)
    assert set(ck.trainable) == {n for n, _ in module.named_parameters()}
    assert {"1.running_mean", "1.running_var"} <= set(ck.frozen)
    moments = ck.optimizer_groups["group0"].states
    for name, p in module.named_parameters():  # AdamW's moments under the parameter names, as ORT keeps them
        assert_same_tensor(moments[name]["momentum0"], optimizer.state[p]["exp_avg"], name)
        assert_same_tensor(moments[name]["momentum1"], optimizer.state[p]["exp_avg_sq"], name)

    api = ort_api()
    state = api.CheckpointState.load_checkpoint(path)
    params = ort_parameters(state)
    for name, p in module.named_parameters():
        assert params[name][1], f"{name} is not trainable for ORT"
        np.testing.assert_array_equal(params[name][0], p.detach().numpy())
    art = export_artifacts(_net(5).eval(), str(tmp_path / "art"), torch.randn(2, 4))
    g = np.random.default_rng(0)
    batches = [(g.standard_normal((6, 4)).astype(np.float32), g.integers(0, 3, 6).astype(np.int64))
               for _ in range(2)]
    losses = ort_train(art, state, batches, lr=0.01)
    assert all(np.isfinite(losses))
    trained = ort_parameters(state)
    assert not np.array_equal(trained["0.weight"][0], params["0.weight"][0])  # ORT trained from the file


def test_fabric_load_is_exact(saved: Any) -> None:
    fabric, model, optimizer, path = saved
    fresh, fresh_optimizer = _trained(fabric, seed=7, steps=1)
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    assert fabric.load(path, state) == {}
    assert state["step"] == 3
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert_same_tensor(b, a, name)
    assert str(fresh_optimizer.state_dict()) == str(optimizer.state_dict())  # every moment and hyperparameter

    whole = fabric.load(path)  # no state given: the saved state, key for key
    assert whole.keys() == {"model", "optimizer", "step"} and whole["step"] == 3
    assert whole["model"].keys() == model.state_dict().keys()
    assert whole["optimizer"]["param_groups"] == optimizer.state_dict()["param_groups"]


def test_fabric_partial_and_non_strict_loads(saved: Any) -> None:
    fabric, model, optimizer, path = saved
    fresh, _ = _trained(fabric, seed=7, steps=0)
    rest = fabric.load(path, {"model": fresh}, strict=False)  # the rest is handed back, not lost
    assert rest.keys() == {"optimizer", "step"} and rest["step"] == 3
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert_same_tensor(b, a, name)
    state = {"model": _trained(fabric, seed=8, steps=0)[0], "scheduler": None}
    fabric.load(path, state, strict=False)  # a key the file lacks: left alone, not an error
    assert state["scheduler"] is None
    with pytest.raises(KeyError, match="scheduler"):
        fabric.load(path, {"model": fresh, "scheduler": None}, strict=True)


def test_several_modules_and_optimizers_in_one_fabric_save(fabric: Any, tmp_path: Any) -> None:
    """A GAN's generator and discriminator, each with its optimizer: each module's parameters under its key."""
    gen, opt_g = _trained(fabric, seed=1)
    disc = torch.nn.Linear(3, 1)
    disc, opt_d = fabric.setup(disc, torch.optim.SGD(disc.parameters(), lr=0.1, momentum=0.9))
    fabric.backward(disc(torch.ones(2, 3)).sum())
    opt_d.step()
    fabric.save(tmp_path / "gan.ckpt", {"gen": gen, "disc": disc, "opt_g": opt_g, "opt_d": opt_d, "epoch": 2})
    ck = load_checkpoint(tmp_path / "gan.ckpt")
    assert "gen.0.weight" in ck.trainable  # ORT trains with one optimizer, the first: the other's are frozen for it
    assert "disc.weight" in ck.frozen and "disc.weight" not in ck.trainable
    fresh_gen, fresh_opt = _trained(fabric, seed=9, steps=0)
    state = {"gen": fresh_gen, "opt_g": fresh_opt}
    rest = fabric.load(tmp_path / "gan.ckpt", state, strict=False)
    assert rest.keys() == {"disc", "opt_d", "epoch"} and rest["epoch"] == 2
    assert_same_tensor(rest["disc"]["weight"], disc.weight.detach(), "disc.weight")
    for (name, a), b in zip(gen.state_dict().items(), fresh_gen.state_dict().values()):
        assert_same_tensor(b, a, name)
    assert str(fresh_opt.state_dict()) == str(opt_g.state_dict())


def test_fabrics_sharded_strategies_refuse_the_plugin_when_made() -> None:
    """They take no CheckpointIO at all: Lightning says so when the Fabric is made, before anything trains (FSDP
    needs a GPU to be made by Fabric; its strategy refuses the plugin the same way)."""
    from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy

    with pytest.raises(NotImplementedError, match="CheckpointIO"):
        L.Fabric(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(lambda m, _: m),
                 plugins=[OrtCheckpointIO()])
    with pytest.raises(NotImplementedError, match="CheckpointIO"):
        FSDPStrategy().checkpoint_io = OrtCheckpointIO()
