"""Exact resume inside an epoch: the data position is part of every checkpoint (issue 38).

A dataset that hands out its indices; a fit that crashes at a step inside an epoch resumes from the newest
checkpoint (saved every few steps, so always mid-epoch), and the indices it then trains on, after the ones trained up
to the save, are the uninterrupted run's, batch for batch; weights and optimizer state end bitwise equal. For every
loader kind people use (sequential, shuffled with and without a generator, ``drop_last``, workers, persistent
workers, a custom batch sampler, several loaders, ``limit_train_batches``, gradient accumulation, validation inside
the epoch, loaders rebuilt every epoch) and every configuration (callback, plugin + ``BindCheckpointIO``, plugin
alone). Real Trainers; the crash is an exception raised in ``training_step``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.utilities import CombinedLoader
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset

from lightning_ort_ckpt import BindCheckpointIO, OrtCheckpoint, OrtCheckpointIO
from lightning_ort_ckpt.errors import CheckpointWarning

N = 40


class Indexed(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


class Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Any:
        return (torch.tensor([float(i)]) for i in range(N))


class ShuffledBatches:
    """A custom batch sampler, deterministic given Python's random state when its epoch starts."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __iter__(self) -> Any:
        order = list(range(self.n))
        random.shuffle(order)
        return iter([order[i:i + self.size] for i in range(0, self.n, self.size)])

    def __len__(self) -> int:
        return -(-self.n // self.size)


class Crash(RuntimeError):
    pass


class Recorder(pl.LightningModule):
    def __init__(self, kind: str, crash_at: int | None = None) -> None:
        super().__init__()
        self.kind, self.crash_at = kind, crash_at
        self.layer = torch.nn.Linear(1, 1)
        self.drop = torch.nn.Dropout(0.5)
        self.seen: list[list[int]] = []
        self.val_seen = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.crash_at is not None and self.global_step == self.crash_at:
            raise Crash(f"crash at step {self.global_step}")
        parts = [b for b in (batch if isinstance(batch, list) else [batch]) if b is not None]
        self.seen.append([int(x) for part in parts for x in part.flatten().tolist()])
        x = torch.cat(parts)
        return self.drop(self.layer(x / N)).square().mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_seen += 1
        self.log("val", self.layer(batch / N).mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def train_dataloader(self) -> Any:
        return make_loader(self.kind)

    def val_dataloader(self) -> Any:
        return DataLoader(Indexed(), batch_size=20)


def make_loader(kind: str) -> Any:
    if kind == "sequential":
        return DataLoader(Indexed(), batch_size=4)
    if kind == "shuffle":
        return DataLoader(Indexed(), batch_size=4, shuffle=True)
    if kind == "generator":
        return DataLoader(Indexed(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
    if kind == "drop_last":
        return DataLoader(Indexed(), batch_size=3, shuffle=True, drop_last=True)
    if kind == "workers":
        return DataLoader(Indexed(), batch_size=4, shuffle=True, num_workers=2)
    if kind == "persistent":
        return DataLoader(Indexed(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)
    if kind == "batch_sampler":
        return DataLoader(Indexed(), batch_sampler=ShuffledBatches(N, 4))
    if kind in ("several", "min_size", "max_size"):
        loaders = [DataLoader(Indexed(), batch_size=4, shuffle=True),
                   DataLoader(torch.utils.data.Subset(Indexed(), range(30)), batch_size=4, shuffle=True)]
        return CombinedLoader(loaders, "max_size_cycle" if kind == "several" else kind)
    if kind == "iterable":
        return DataLoader(Stream(), batch_size=4)
    raise ValueError(kind)


TRAINER_OPTIONS: dict[str, dict[str, Any]] = {
    "limit": {"limit_train_batches": 7},
    "accumulate": {"accumulate_grad_batches": 2},
    "val_inside": {"val_check_interval": 0.5, "limit_val_batches": 1},
    "reload": {"reload_dataloaders_every_n_epochs": 1},
}


def fit(where: Path, kind: str, how: str, steps: int, crash_at: int | None = None, ckpt_path: str | None = None,
        options: dict[str, Any] | None = None, io: Any = None, extra: list[Any] = ()) -> tuple[Recorder, Path]:
    pl.seed_everything(3)
    model = Recorder(kind, crash_at)
    ckpts = where / "ckpts"
    plugins: list[Any] | None = None
    if how == "callback":
        callbacks: list[Any] = [OrtCheckpoint(dirpath=ckpts, every_n_train_steps=3, save_top_k=-1,
                                              checkpoint_io=io)]
    else:
        callbacks = [ModelCheckpoint(dirpath=ckpts, every_n_train_steps=3, save_top_k=-1)]
        callbacks += [BindCheckpointIO()] if how == "bind" else []
        plugins = [io or OrtCheckpointIO()]
    callbacks += list(extra)
    opts = dict(options or {})
    if "limit_val_batches" not in opts:
        opts["limit_val_batches"] = 0
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks, plugins=plugins,
                         default_root_dir=where, **opts)
    try:
        trainer.fit(model, ckpt_path=ckpt_path)
    except Crash:
        pass
    return model, ckpts


def newest(ckpts: Path) -> tuple[Path, int]:
    found = sorted(((int(p.stem.split("step=")[1].split("-")[0].split(".")[0]), p) for p in ckpts.glob("*.ckpt")))
    step, path = found[-1]
    return path, step


def check_resume(tmp: Path, kind: str, how: str, crash_at: int, steps: int = 24,
                 options: dict[str, Any] | None = None, io: Any = None) -> None:
    straight, _ = fit(tmp / "straight", kind, how, steps, options=options)
    crashed, ckpts = fit(tmp / "crashed", kind, how, steps, crash_at=crash_at, options=options)
    path, step = newest(ckpts)
    accumulate = (options or {}).get("accumulate_grad_batches", 1)
    micro = step * accumulate
    resumed, _ = fit(tmp / "resumed", kind, how, steps, ckpt_path=str(path), options=options,
                     io=type(io)(**io.__getstate__()) if io is not None else None)
    assert crashed.seen[:micro] + resumed.seen == straight.seen, (
        f"resumed from step {step}: {resumed.seen[:3]}... instead of {straight.seen[micro:micro + 3]}...")
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


KINDS = ["sequential", "shuffle", "generator", "drop_last", "workers", "persistent", "batch_sampler", "several",
         "min_size", "max_size"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_loader_kind_resumes_at_its_batch(tmp_path: Path, kind: str) -> None:
    check_resume(tmp_path, kind, "callback", crash_at=15)


@pytest.mark.parametrize("how", ["bind", "plugin"])
@pytest.mark.parametrize("kind", ["shuffle", "workers"])
def test_every_configuration_resumes_at_its_batch(tmp_path: Path, kind: str, how: str) -> None:
    check_resume(tmp_path, kind, how, crash_at=17)


@pytest.mark.parametrize("option", sorted(TRAINER_OPTIONS))
def test_trainer_options_resume_at_their_batch(tmp_path: Path, option: str) -> None:
    check_resume(tmp_path, "shuffle", "callback", crash_at=14, options=TRAINER_OPTIONS[option])


@pytest.mark.parametrize("crash_at", [4, 7, 11, 19, 22])
def test_any_step_resumes_at_its_batch(tmp_path: Path, crash_at: int) -> None:
    check_resume(tmp_path, "generator", "callback", crash_at=crash_at)


def test_an_iterable_dataset_warns_what_repeats(tmp_path: Path) -> None:
    _, ckpts = fit(tmp_path / "crashed", "iterable", "callback", 24, crash_at=15)
    path, _ = newest(ckpts)
    with pytest.warns(CheckpointWarning, match=r"IterableDataset.*(\d+) batches trained before the save"):
        fit(tmp_path / "resumed", "iterable", "callback", 24, ckpt_path=str(path))


def test_an_iterable_dataset_fast_forwards_when_asked(tmp_path: Path) -> None:
    check_resume(tmp_path, "iterable", "callback", crash_at=15, io=OrtCheckpointIO(fast_forward_iterables=True))


class OlderPlugin(OrtCheckpointIO):
    """Writes files as a version before 0.5 did (and as ORT and Fabric do): without a data position."""

    def data_position(self) -> dict[str, Any]:
        return {}


def test_a_file_without_data_position_warns_what_repeats(tmp_path: Path) -> None:
    _, ckpts = fit(tmp_path / "crashed", "shuffle", "callback", 24, crash_at=15, io=OlderPlugin())
    path, step = newest(ckpts)
    with pytest.warns(CheckpointWarning, match=rf"without its data position.*epoch 1 restarts from its first batch.*"
                                               rf"the {step % 10} batches trained before the save"):
        fit(tmp_path / "resumed", "shuffle", "callback", 24, ckpt_path=str(path))


DAMAGES = {
    "consumed_text": lambda p: p["loaders"][0].__setitem__("consumed", "three"),
    "consumed_negative": lambda p: p["loaders"][0].__setitem__("consumed", -1),
    "torch_state_short": lambda p: p["loaders"][0]["draw"].__setitem__("torch", "00ff"),
    "generators_missing": lambda p: p["loaders"][0]["draw"].__setitem__("generators", ["00", "11"]),
    "python_words_odd": lambda p: p["loaders"][0]["draw"]["python"].__setitem__(1, "abc"),
    "loaders_not_a_list": lambda p: p.__setitem__("loaders", 5),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_data_position_fails_with_our_error(tmp_path: Path, damage: str) -> None:
    """The position edited in the file's manifest (checksums fresh: only the position is wrong): fit raises our
    error naming the file before any generator is set, never an IndexError from deep inside a sampler."""
    import json

    from lightning_ort_ckpt._fit_state._data_position import DATA_KEY
    from lightning_ort_ckpt._translation import MANIFEST
    from lightning_ort_ckpt.errors import CorruptCheckpointError
    from lightning_ort_ckpt.format import load_checkpoint, save_checkpoint

    _, ckpts = fit(tmp_path / "crashed", "generator", "callback", 24, crash_at=15)
    good, _ = newest(ckpts)
    ck = load_checkpoint(good)
    manifest = json.loads(ck.properties[MANIFEST])
    DAMAGES[damage](manifest["values"][DATA_KEY])
    ck.properties[MANIFEST] = json.dumps(manifest)
    path = tmp_path / "damaged.ckpt"
    save_checkpoint(ck, path)
    with pytest.raises(CorruptCheckpointError, match="data position is damaged") as err:
        fit(tmp_path / "resumed", "generator", "callback", 24, ckpt_path=str(path))
    assert str(path) in str(err.value)


class Augmented(Dataset[torch.Tensor]):
    """Each item with a random "augmentation" drawn where the item is loaded (the main process, or a worker)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(torch.rand(()))])


class AugmentedRecorder(Recorder):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.crash_at is not None and self.global_step == self.crash_at:
            raise Crash(f"crash at step {self.global_step}")
        self.seen.append([int(i) for i in batch[:, 0].tolist()])
        self.drawn = getattr(self, "drawn", []) + [batch[:, 1].tolist()]
        return self.layer(batch[:, 1:]).square().mean()

    def train_dataloader(self) -> Any:
        return DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=int(self.kind))


@pytest.mark.parametrize("workers", [0, 2])
def test_augmentation_drawn_in_workers_differs_until_the_epoch_ends(tmp_path: Path, workers: int) -> None:
    """What the docs say of random augmentation: drawn in the main process it is exact; drawn in worker processes
    it follows each worker's own stream, which the skip changes, for the rest of the resumed epoch only (the next
    epoch's workers are seeded as in the uninterrupted run). The samples seen are exact either way."""
    runs = {}
    for name, crash, ckpt in (("straight", None, None), ("crashed", 15, None), ("resumed", None, "newest")):
        pl.seed_everything(3)
        model = AugmentedRecorder(str(workers), crash)
        ckpts = tmp_path / name
        path = str(newest(tmp_path / "crashed")[0]) if ckpt else None
        trainer = pl.Trainer(max_steps=30, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
                             callbacks=[OrtCheckpoint(dirpath=ckpts, every_n_train_steps=3, save_top_k=-1)])
        try:
            trainer.fit(model, ckpt_path=path)
        except Crash:
            pass
        runs[name] = model
    step = newest(tmp_path / "crashed")[1]
    straight, crashed, resumed = runs["straight"], runs["crashed"], runs["resumed"]
    assert crashed.seen[:step] + resumed.seen == straight.seen
    rest_of_epoch = 20 - step  # steps 15..19 finish epoch 1; epoch 2 starts at step 20
    same = [a == b for a, b in zip(resumed.drawn, straight.drawn[step:])]
    print(f"{workers} workers: augmentation equal to the uninterrupted run's in {sum(same)} of {len(same)} steps "
          f"after the resume ({rest_of_epoch} left in the resumed epoch)")
    if workers == 0:
        assert all(same)
    else:
        assert not any(same[:rest_of_epoch]) and all(same[rest_of_epoch:])


def test_the_plugin_alone_leaves_no_callback_of_ours_in_the_trainer(tmp_path: Path) -> None:
    """The plugin used alone adds a callback to restore the random states when training starts, and takes it out at
    its teardown: after fit, the Trainer's callbacks are the user's."""
    from lightning_ort_ckpt._fit_state._train_start import RestoreRandomStates

    _, ckpts = fit(tmp_path / "crashed", "shuffle", "plugin", 24, crash_at=15)
    path, _ = newest(ckpts)
    seen: list[bool] = []

    class Look(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            seen.append(any(isinstance(c, RestoreRandomStates) for c in trainer.callbacks))

    model, _ = fit(tmp_path / "resumed", "shuffle", "plugin", 24, ckpt_path=str(path), extra=[Look()])
    assert seen == [True]
    assert not [c for c in model.trainer.callbacks if isinstance(c, RestoreRandomStates)]


@pytest.mark.parametrize("kind", ["workers", "persistent"])
def test_a_fit_leaves_no_loader_iterator_to_the_garbage_collector(tmp_path: Path, kind: str) -> None:
    """With the collector off, a fit's loader iterators (their worker processes) are gone when the fit and its
    Trainer are: nothing of ours keeps them in a reference cycle until a later collection (which would shut the
    workers down at a random point of another fit)."""
    import gc
    import weakref

    from torch.utils.data.dataloader import _BaseDataLoaderIter

    made: list[weakref.ref[Any]] = []

    class Collect(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            made.extend(weakref.ref(o) for o in gc.get_objects() if isinstance(o, _BaseDataLoaderIter))

    gc.collect()
    gc.disable()
    try:
        model, _ = fit(tmp_path, kind, "callback", 24, extra=[Collect()])
        trainer = model.trainer
        del model
        trainer.fit_loop._combined_loader = None  # Lightning's own hold (its Trainer and loops are a cycle of theirs)
        del trainer
        alive = {id(r()) for r in made if r() is not None}
    finally:
        gc.enable()
    assert made and not alive, f"{len(alive)} loader iterators kept alive by a reference cycle"
