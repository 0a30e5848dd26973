"""The conformance zoo under Fabric: every model of ``zoo_models.ZOO`` (tied weights, frozen parts, BatchNorm, two
optimizers, a OneCycle schedule, bfloat16...) trained in a plain Fabric loop with ``Fabric(plugins=[plugin])`` and
``plugin.bind(fabric.strategy)``, saved after one epoch with ``fabric.save``, loaded with ``fabric.load`` into a
model built from another seed, and trained one more epoch: bitwise the uninterrupted run. Fabric leaves the random
states to the script, which saves torch's in the state, as Fabric's docs do."""

from __future__ import annotations

from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning")

from lightning_ort_ckpt.format import load_checkpoint
from lightning_ort_ckpt.lightning import OrtCheckpointIO
from lightning_ort_ckpt._translation.lightning_dict import aliases_of
from helpers.ort_reference import assert_same_tensor
from helpers.zoo_models import BATCH, ZOO, Entry

_IDS = [e.name for e in ZOO]


def _parts(model: Any) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """The optimizers and schedulers of ``configure_optimizers``, in the shapes the zoo uses."""
    conf = model.configure_optimizers()
    if isinstance(conf, dict):
        return [conf["optimizer"]], [conf["lr_scheduler"]["scheduler"]]
    return (list(conf), []) if isinstance(conf, (tuple, list)) else ([conf], [])


def _run(entry: Entry, seed: int, epochs: int, load: str | None = None, save: str | None = None) -> dict[str, Any]:
    plugin = OrtCheckpointIO(**entry.plugin)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    plugin.bind(fabric.strategy)
    model = entry.build(seed)
    optimizers, schedulers = _parts(model)
    model, *optimizers = fabric.setup(model, *optimizers)
    state: dict[str, Any] = {"model": model, **{f"optimizer{i}": o for i, o in enumerate(optimizers)},
                             **{f"scheduler{i}": s for i, s in enumerate(schedulers)}, "epoch": 0,
                             "rng": torch.get_rng_state()}
    if load is not None:
        assert fabric.load(load, state) == {}
        torch.set_rng_state(state["rng"])
    x, y = entry.data()
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                                                  batch_size=BATCH, shuffle=True))
    model.train()
    for _ in range(state["epoch"], epochs):
        for xb, yb in loader:
            fabric.backward(torch.nn.functional.cross_entropy(model(xb), yb))
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
            for scheduler in schedulers:
                scheduler.step()
        state["epoch"] += 1
    if save is not None:
        state["rng"] = torch.get_rng_state()
        fabric.save(save, state)
    return state


@pytest.mark.parametrize("entry", ZOO, ids=_IDS)
def test_fabric_resume_at_epoch_boundary_is_bitwise_the_uninterrupted_run(entry: Entry, tmp_path: Any) -> None:
    straight = _run(entry, 0, 2)
    path = str(tmp_path / "epoch1.ckpt")
    _run(entry, 0, 1, save=path)
    module = straight["model"].module
    assert set(load_checkpoint(path).trainable) <= {n for n, p in module.named_parameters() if p.requires_grad}
    resumed = _run(entry, 7, 2, load=path)
    assert resumed["epoch"] == 2
    for (name, a), b in zip(straight["model"].state_dict().items(), resumed["model"].state_dict().values(),
                            strict=True):
        assert_same_tensor(b, a, f"{entry.name}: {name}")
    for key in straight:
        if key.startswith(("optimizer", "scheduler")):
            assert str(straight[key].state_dict()) == str(resumed[key].state_dict()), (entry.name, key)
    tied = aliases_of(resumed["model"].module)
    for name, alias in tied.items():  # tied weights are still one tensor after the load
        assert resumed["model"].module.get_parameter(name) is resumed["model"].module.get_parameter(alias)
