"""The conformance zoo: every model shape of ``zoo_models.ZOO`` through the three round trips, with the real
Lightning Trainer and onnxruntime-training 1.19.2.

(a) save at an epoch boundary -> ``fit(ckpt_path=...)`` -> bitwise equal to the uninterrupted run, in every
    configuration a user can write: ``OrtCheckpoint``, ``OrtCheckpointIO`` + ``BindCheckpointIO``, and
    ``OrtCheckpointIO`` alone (with Lightning's ``ModelCheckpoint``);
(b) Lightning's file -> ``make_training_artifacts`` -> ORT ``CheckpointState`` + ``Module`` + ``Optimizer`` -> a few
    ORT steps -> ORT saves (with and without optimizer state, and once more with Lightning's metadata stripped, as a
    file ORT alone wrote) -> ``fit(ckpt_path=...)`` restores ORT's weights bitwise, under every ``state_dict`` name;
    where ORT cannot train the model, ``make_training_artifacts`` raises ``ArtifactsError`` naming the operator;
(b') ORT's eval model computes what torch's ``eval()`` computes, the same each time: no random op of the training
    graph (DropPath's mask) is left in it;
(c) ``export_onnx`` of the ORT-trained file with the module class: the model ``load_from_checkpoint`` builds has
    ORT's weights and the saved hyperparameters, and ONNX Runtime agrees with it.

A new model shape is one entry in ``zoo_models.ZOO``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import pathlib
import re
import warnings
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime.training")
pl = pytest.importorskip("pytorch_lightning")


from pytorch_lightning.callbacks import ModelCheckpoint

import lightning_ort_ckpt
from lightning_ort_ckpt import BindCheckpointIO, OrtCheckpoint, OrtCheckpointIO
from lightning_ort_ckpt.artifacts import ArtifactsError, TrainingArtifacts, make_training_artifacts
from lightning_ort_ckpt.errors import CheckpointError, CheckpointWarning
from lightning_ort_ckpt.export import export_onnx
from lightning_ort_ckpt.format import load_checkpoint, save_checkpoint
from lightning_ort_ckpt._restore._reading import read_lightning_checkpoint
from lightning_ort_ckpt._translation import MANIFEST
from lightning_ort_ckpt._translation import values
from lightning_ort_ckpt._translation.lightning_dict import EXTRA_PREFIX, ModuleInfo, aliases_of, to_ort
from helpers.ort_reference import assert_same_tensor, ort_api
from helpers.zoo_models import BATCH, ZOO, Act, Entry, FrozenStemCNN
from helpers.zoo import MODES, assert_same_state, fit, loader, trainer

api = ort_api()
ORT_STEPS = 3
ORT_LR = 0.01
ORT_SAVES = ("with_optimizer", "weights_only", "ort_alone")
_IDS = [e.name for e in ZOO]


class Capture(pl.Callback):
    """The module's state right after Lightning restored a checkpoint (before any step), cloned."""

    state: dict[str, torch.Tensor]
    optimizer: dict[str, Any]

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        self.optimizer = trainer.optimizers[0].state_dict()


def assert_same_ort_tensor(actual: torch.Tensor, ort: np.ndarray, what: str) -> None:
    """Bitwise equal to ORT's value; a narrow-float parameter ORT trained as float32 comes back rounded to its dtype
    (docs/mapping.md, ORT-compatible mode)."""
    assert_same_tensor(actual, torch.from_numpy(ort).to(actual.dtype), what)


@pytest.fixture(scope="module")
def epoch_one(tmp_path_factory: Any) -> dict[str, str]:
    """Per entry: the checkpoint Lightning saved after one epoch (the common start of (a) and (b))."""
    root = tmp_path_factory.mktemp("zoo")
    paths = {}
    for entry in ZOO:
        t, _ = fit(entry, entry.build(0), max_epochs=1)
        paths[entry.name] = str(root / f"{entry.name}-epoch1.ckpt")
        t.save_checkpoint(paths[entry.name])
    return paths


# -- (a) Lightning save -> resume ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("entry", ZOO, ids=_IDS)
def test_resume_at_epoch_boundary_is_bitwise_the_uninterrupted_run(entry: Entry, mode: str,
                                                                   epoch_one: dict[str, str], tmp_path: Any) -> None:
    start = epoch_one[entry.name]
    if mode != "bind":  # the whole run in this configuration: the epoch-1 file too
        t, warned = fit(entry, entry.build(0), mode=mode, max_epochs=1, default_root_dir=tmp_path)
        assert not warned, warned
        start = str(tmp_path / "epoch1.ckpt")
        t.save_checkpoint(start)
        assert load_checkpoint(start).trainable.keys() == load_checkpoint(epoch_one[entry.name]).trainable.keys()
    straight = entry.build(0)  # build() seeds torch: the same start as epoch_one's
    fit(entry, straight, mode=mode, max_epochs=2, default_root_dir=tmp_path / "straight")
    resumed = entry.build(7)  # another seed: the checkpoint's weights and random states must win
    t, warned = fit(entry, resumed, start, mode=mode, max_epochs=2, default_root_dir=tmp_path / "resumed")
    assert not warned, warned
    assert t.global_step == straight.trainer.global_step > 0
    assert_same_state(resumed.state_dict(), straight.state_dict(), entry.name)
    for mine, theirs in zip(t.optimizers, straight.trainer.optimizers, strict=True):
        a, b = mine.state_dict(), theirs.state_dict()
        assert a["param_groups"] == b["param_groups"]  # learning rates of schedules included
        assert a["state"].keys() == b["state"].keys()
        for index, state in b["state"].items():
            for key, value in state.items():
                assert_same_tensor(torch.as_tensor(a["state"][index][key]), torch.as_tensor(value), f"{index}/{key}")
    for name, alias in aliases_of(resumed).items():  # tied weights are still one tensor after the resume
        assert resumed.get_parameter(name) is resumed.get_parameter(alias)


# -- (a') saves inside an epoch -> resume ---------------------------------------------------------------------------

KILLS_PER_MODE = 20
"""Mid-epoch resume points per configuration, spread over the zoo (a fixed seed: the same points every run)."""


def _kill_points(mode: str) -> dict[str, list[float]]:
    """Per entry, where in the run (a fraction of its mid-epoch saves) a crash resumes from."""
    rng = np.random.default_rng(sum(map(ord, mode)))
    points: dict[str, list[float]] = {e.name: [] for e in ZOO}
    for i in range(KILLS_PER_MODE):
        points[ZOO[i % len(ZOO)].name].append(float(rng.random()))
    return points


def _mid_epoch_saves(saves: Any) -> list[tuple[int, Any]]:
    """(step, path) of the files saved inside an epoch (not at its last step), by step."""
    found = [(int(m[2]), int(m[1]), p) for p in saves.glob("*.ckpt")
             if (m := re.fullmatch(r"epoch=(\d+)-step=(\d+)\.ckpt", p.name))]
    last_of_epoch = {}
    for step, epoch, _ in found:
        last_of_epoch[epoch] = max(step, last_of_epoch.get(epoch, 0))
    return sorted((step, p) for step, epoch, p in found if step != last_of_epoch[epoch])


def assert_same_optimizers(mine: list[Any], theirs: list[Any]) -> None:
    for a_opt, b_opt in zip(mine, theirs, strict=True):
        a, b = a_opt.state_dict(), b_opt.state_dict()
        assert a["param_groups"] == b["param_groups"]
        for index, state in b["state"].items():
            for key, value in state.items():
                assert_same_tensor(torch.as_tensor(a["state"][index][key]), torch.as_tensor(value), f"{index}/{key}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("entry", ZOO, ids=_IDS)
def test_resume_inside_an_epoch_is_bitwise_the_uninterrupted_run(entry: Entry, mode: str, tmp_path: Any) -> None:
    """The uninterrupted run saves after every step; a crash at any step resumes from the newest of those files
    (inside an epoch): weights and optimizer state end bitwise equal, the shuffled batches included."""
    points = _kill_points(mode)[entry.name]
    assert points, "KILLS_PER_MODE gives every entry a kill point"
    saves = tmp_path / "ckpts"
    saving = (OrtCheckpoint(dirpath=saves, every_n_train_steps=1, save_top_k=-1, **entry.plugin) if mode == "callback"
              else ModelCheckpoint(dirpath=saves, every_n_train_steps=1, save_top_k=-1))
    straight = entry.build(0)
    plugins = [] if mode == "callback" else [OrtCheckpointIO(**entry.plugin)]
    extra = [BindCheckpointIO()] if mode == "bind" else []
    pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
               plugins=plugins, callbacks=[saving, *extra], deterministic=True, max_epochs=2,
               default_root_dir=tmp_path, **entry.trainer).fit(straight, loader(entry))
    inside = _mid_epoch_saves(saves)
    for step, path in (inside[int(point * len(inside))] for point in points):
        resumed = entry.build(7)
        t, warned = fit(entry, resumed, path, mode=mode, max_epochs=2, default_root_dir=tmp_path / f"r{step}")
        assert not warned, warned
        assert t.global_step == straight.trainer.global_step
        assert_same_state(resumed.state_dict(), straight.state_dict(), f"{entry.name} resumed at step {step}")
        assert_same_optimizers(t.optimizers, straight.trainer.optimizers)


# -- (b) Lightning -> ORT training -> Lightning ----------------------------------------------------------------------


def ort_batches(entry: Entry) -> list[tuple[np.ndarray, np.ndarray]]:
    x, y = entry.data(seed=5)
    return [(x[i:i + BATCH].numpy(), y[i:i + BATCH].numpy()) for i in range(0, ORT_STEPS * BATCH, BATCH)]


def strip_lightning_metadata(source: str, target: str) -> None:
    """``source`` as ORT alone would have it: no manifest, no ``lightning:`` tensors, no torch-only groups."""
    ck = load_checkpoint(source)
    del ck.properties[MANIFEST]
    ck.frozen = {k: v for k, v in ck.frozen.items() if not k.startswith(EXTRA_PREFIX)}
    ck.optimizer_groups = {g: v for g, v in ck.optimizer_groups.items() if g == "group0"}
    save_checkpoint(ck, target)


def ort_train(art: TrainingArtifacts, start: str, entry: Entry, saves: dict[str, bool]) -> dict[str, np.ndarray]:
    """Train ORT_STEPS steps from ``start``; save to each path of ``saves`` (value: include_optimizer_state);
    ORT's parameters after training."""
    state = api.CheckpointState.load_checkpoint(start)
    module = api.Module(art.training_model, state, art.eval_model)
    optimizer = api.Optimizer(art.optimizer_model, module)
    optimizer.set_learning_rate(ORT_LR)
    module.train()
    for x, y in ort_batches(entry):
        module(x, y)
        optimizer.step()
        module.lazy_reset_grad()
    for path, with_state in saves.items():
        api.CheckpointState.save_checkpoint(state, path, include_optimizer_state=with_state)
    return {name: p.data.copy() for name, p in state.parameters if not name.startswith(EXTRA_PREFIX)}


def model_for_ort(entry: Entry, checkpoint: str) -> Any:
    """What ORT and ONNX Runtime are given: the class, or a float32 instance for a narrow-float model."""
    if not entry.float32_for_ort:
        return entry.cls
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        return lightning_ort_ckpt.load_from_checkpoint(entry.cls, checkpoint).float()


@pytest.fixture(scope="module")
def ort_trained(epoch_one: dict[str, str], tmp_path_factory: Any) -> Any:
    """``ort_trained(entry)``: ORT trains the entry once (made on first use): {save kind: path}, ORT's parameters
    after training from Lightning's file, and after training from the stripped (ORT-alone) file."""
    root = tmp_path_factory.mktemp("ort")
    done: dict[str, tuple[dict[str, str], dict[str, np.ndarray], dict[str, np.ndarray]]] = {}

    def train(entry: Entry) -> tuple[dict[str, str], dict[str, np.ndarray], dict[str, np.ndarray]]:
        if entry.name not in done:
            art = make_training_artifacts(model_for_ort(entry, epoch_one[entry.name]), epoch_one[entry.name],
                                          root / entry.name)
            # one trainable set: the file's (what the first optimizer holds) is the artifacts'
            assert sorted(art.trainable) == sorted(load_checkpoint(epoch_one[entry.name]).trainable)
            paths = {kind: str(root / f"{entry.name}-{kind}.ckpt") for kind in ORT_SAVES}
            weights = ort_train(art, art.checkpoint, entry,
                                {paths["with_optimizer"]: True, paths["weights_only"]: False})
            stripped = str(root / f"{entry.name}-stripped.ckpt")
            strip_lightning_metadata(art.checkpoint, stripped)
            done[entry.name] = (paths, weights, ort_train(art, stripped, entry, {paths["ort_alone"]: True}))
        return done[entry.name]

    return train


ORT_CASES = [pytest.param(e, kind, id=f"{e.name}-{kind}") for e in ZOO if not e.ort_error for kind in ORT_SAVES]


@pytest.mark.parametrize(("entry", "kind"), ORT_CASES)
def test_resume_after_ort_training_has_orts_weights_bitwise(entry: Entry, kind: str, ort_trained: Any,
                                                            epoch_one: dict[str, str]) -> None:
    paths, weights, alone = ort_trained(entry)
    ort = alone if kind == "ort_alone" else weights
    capture = Capture()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        steps = read_lightning_checkpoint(paths[kind])["global_step"]  # ORT's step for a file ORT alone wrote
    t, warned = fit(entry, entry.build(3), paths[kind], [capture], max_steps=steps + 1)
    module = t.lightning_module
    aliases = aliases_of(module)
    for name, tensor in capture.state.items():
        stored = aliases.get(name, name)
        assert stored in ort, f"{name} ({stored}) not in ORT's file"
        assert_same_ort_tensor(tensor, ort[stored], f"{entry.name}/{kind}: {name}")
    start = load_checkpoint(epoch_one[entry.name])
    for name in entry.trained_by_ort:
        stored = aliases.get(name, name)
        assert not np.array_equal(ort[stored], {**start.trainable, **start.frozen}[stored].numpy()), name
    for name in entry.unchanged:  # frozen, or held by no optimizer: frozen for ORT too
        assert name in start.frozen and name not in start.trainable, name
        assert_same_tensor(capture.state[name], start.frozen[name], f"{name} must not move")
    text = " ".join(warned)
    if kind == "weights_only":
        assert "holds no optimizer state" in text, warned
    elif kind == "ort_alone":
        assert "written by ONNX Runtime, not Lightning" in text, warned
        if not entry.adam_like:
            assert "starts fresh" in text, warned
    elif entry.adam_like:
        assert f"ONNX Runtime trained {ORT_STEPS} more optimizer steps" in text, warned
    else:  # SGD / RMSprop: ORT trained with AdamW; Lightning's optimizer state is from before
        assert "is Lightning's from before and is not what ORT used" in text, warned


@pytest.mark.parametrize("entry", [e for e in ZOO if e.ort_error or e.float32_for_ort], ids=lambda e: e.name)
def test_what_ort_cannot_train_is_a_clear_error(entry: Entry, epoch_one: dict[str, str], tmp_path: Any) -> None:
    """An operator ORT cannot differentiate is named, with the way out; so are parameters of a dtype ORT cannot
    train (the float32 copy of such a model trains: see the ORT round trips)."""
    expected = entry.ort_error or "trains float32 graphs, and parameter .* is bfloat16.*load_from_checkpoint"
    with pytest.raises(ArtifactsError, match=expected) as info:
        make_training_artifacts(entry.cls, epoch_one[entry.name], tmp_path / "art")
    assert str(info.value).startswith(epoch_one[entry.name])
    assert "requires_grad=False" in str(info.value) or entry.float32_for_ort


@pytest.mark.parametrize("entry", [e for e in ZOO if not e.ort_error], ids=lambda e: e.name)
def test_orts_eval_model_computes_torchs_eval(entry: Entry, epoch_one: dict[str, str], tmp_path: Any) -> None:
    import onnx

    source = epoch_one[entry.name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        model = model_for_ort(entry, source)
        art = make_training_artifacts(model, source, tmp_path / "art")
        torch_model = (model if isinstance(model, torch.nn.Module)
                       else lightning_ort_ckpt.load_from_checkpoint(entry.cls, source)).eval()
    x, y = ort_batches(entry)[0]
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(torch_model(torch.from_numpy(x)), torch.from_numpy(y)).item()
    module = api.Module(art.training_model, api.CheckpointState.load_checkpoint(art.checkpoint), art.eval_model)
    module.eval()
    losses = [float(module(x, y)) for _ in range(3)]
    assert losses == [losses[0]] * 3, losses
    assert abs(losses[0] - expected) <= entry.tolerance, (losses[0], expected)
    random = {"RandomUniformLike", "RandomUniform", "RandomNormalLike", "RandomNormal", "Bernoulli"}
    assert not [n.op_type for n in onnx.load(art.eval_model).graph.node if n.op_type in random]
    if entry.cls.__name__ == "StochasticDepthCNN":  # training keeps DropPath's mask: only the eval model lost it
        assert "RandomUniformLike" in {n.op_type for n in onnx.load(art.training_model).graph.node}


# -- (c) export parity -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ZOO, ids=_IDS)
def test_export_of_the_ort_trained_file_matches_ort(entry: Entry, epoch_one: dict[str, str], ort_trained: Any,
                                                   tmp_path: Any) -> None:
    if entry.ort_error:
        source, ort = epoch_one[entry.name], {k: v.numpy() for k, v in load_checkpoint(epoch_one[entry.name])
                                                                      .trainable.items()}
    else:
        paths, ort, _ = ort_trained(entry)
        source = paths["with_optimizer"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        loaded = lightning_ort_ckpt.load_from_checkpoint(entry.cls, source)
        report = export_onnx(model_for_ort(entry, source), source, tmp_path / "model.onnx", tolerance=entry.tolerance)
    assert report.max_abs_diff <= entry.tolerance
    for key, value in entry.kwargs.items():
        assert loaded.hparams[key] == value and type(loaded.hparams[key]) is type(value)
    aliases = aliases_of(loaded)
    for name, tensor in loaded.state_dict().items():
        stored = aliases.get(name, name)
        if stored in ort:
            assert_same_ort_tensor(tensor, ort[stored], f"{entry.name}: {name}")


# -- hyperparameters JSON cannot spell -------------------------------------------------------------------------------


def test_enum_hparam_builds_the_same_model_and_module_hparam_fails_loudly(tmp_path: Any) -> None:
    entry = next(e for e in ZOO if e.cls is FrozenStemCNN)
    model = entry.build(0)
    t = trainer(entry, max_steps=1)
    t.fit(model, loader(entry))
    t.save_checkpoint(tmp_path / "cnn.ckpt")
    loaded = lightning_ort_ckpt.load_from_checkpoint(FrozenStemCNN, tmp_path / "cnn.ckpt")
    assert loaded.hparams.act is Act.TANH and isinstance(loaded.act, torch.nn.Tanh)

    class Local(enum.Enum):  # not importable by name: saved with a warning, and refuses to be used when loaded
        A = 1

    model.hparams.act = Local.A
    with pytest.warns(CheckpointWarning, match=r"\['hyper_parameters'\]\['act'\].*placeholder that raises"):
        t.save_checkpoint(tmp_path / "local.ckpt")
    with pytest.raises(CheckpointError, match="was not saved and cannot be used: <unsaved .*Local"):
        lightning_ort_ckpt.load_from_checkpoint(FrozenStemCNN, tmp_path / "local.ckpt")
    relu = lightning_ort_ckpt.load_from_checkpoint(FrozenStemCNN, tmp_path / "local.ckpt", act=Act.RELU)
    assert isinstance(relu.act, torch.nn.ReLU)
    with pytest.raises(CheckpointError, match="was not saved"):
        export_onnx(FrozenStemCNN, tmp_path / "local.ckpt", tmp_path / "m.onnx")
    assert not os.path.exists(tmp_path / "m.onnx")


def test_tied_weights_are_stored_once_under_the_name_orts_graph_uses(epoch_one: dict[str, str],
                                                                      ort_trained: Any) -> None:
    entry = next(e for e in ZOO if e.name == "tied_transformer")
    ck = load_checkpoint(epoch_one[entry.name])
    manifest = json.loads(ck.properties[MANIFEST])
    assert manifest["aliases"] == {"head.weight": "embed.weight"}
    assert "embed.weight" in ck.trainable and "head.weight" not in {**ck.trainable, **ck.frozen}
    assert "head.weight" in manifest["state_dict"]
    _, ort, _ = ort_trained(entry)
    assert "head.weight" not in ort  # ORT's training graph knows the tensor by its first name only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        state = read_lightning_checkpoint(epoch_one[entry.name])["state_dict"]
    assert state["head.weight"] is state["embed.weight"]


@dataclasses.dataclass
class Schedule:
    warmup: int
    root: pathlib.Path
    act: Act = Act.RELU


def test_hparams_json_cannot_spell_round_trip_without_pickle() -> None:
    value = {"act": Act.TANH, "schedule": Schedule(3, pathlib.Path("runs/a"), Act.TANH), "path": pathlib.Path("/x")}
    encoded = json.loads(json.dumps(values.encode(value, lambda path, t: None)))
    assert encoded["act"] == {"__enum__": ["helpers.zoo_models:Act", "tanh"]}
    decoded = values.decode(encoded, lambda ref: None)
    assert decoded == value and decoded["act"] is Act.TANH and type(decoded["schedule"]) is Schedule


def test_a_changed_class_loads_as_a_placeholder_not_a_damaged_file() -> None:
    for data in ({"__enum__": ["helpers.zoo_models:Act", "gelu"]},
                 {"__dataclass__": ["test_zoo:Schedule", {"steps": 3}]}):
        decoded = values.decode(data, lambda ref: None)
        assert isinstance(decoded, values.Unsaved) and "cannot be rebuilt" in repr(decoded)


@pytest.mark.parametrize("name", ["subprocess:Popen", "os:system", "helpers.zoo_models:ZooModule",
                                  "no_such_module:Enum", "helpers.zoo_models:<locals>.Act"])
def test_only_imported_enum_and_dataclass_classes_are_resolved(name: str) -> None:
    """A file names the class to rebuild: anything but an Enum or a dataclass of an imported module is refused."""
    for tag in ("__enum__", "__dataclass__"):
        decoded = values.decode({tag: [name, {} if tag == "__dataclass__" else 1]}, lambda ref: None)
        assert isinstance(decoded, values.Unsaved)
        with pytest.raises(CheckpointError, match=re.escape(name.split(":")[0])):
            decoded == 1  # noqa: B015 - the comparison is what must raise


def test_a_tied_file_ort_alone_wrote_loads_into_a_module(ort_trained: Any, tmp_path: Any) -> None:
    """ORT stores the tied tensor once, with no aliases: a module at hand (an instance given to export_onnx) fills
    the tied name from it; load_from_checkpoint, which has none yet, needs strict=False, and the tie does the rest."""
    entry = next(e for e in ZOO if e.name == "tied_transformer")
    paths, _, alone = ort_trained(entry)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        loaded = lightning_ort_ckpt.load_from_checkpoint(entry.cls, paths["ort_alone"], strict=False)
        instance = entry.build(9)
        export_onnx(instance, paths["ort_alone"], tmp_path / "m.onnx", tolerance=entry.tolerance)
    for module in (loaded, instance):
        for name in ("embed.weight", "head.weight"):
            assert_same_ort_tensor(module.state_dict()[name], alone["embed.weight"], name)


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = torch.nn.LayerNorm(8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x + self.attn(x, x, x, need_weights=False)[0]).mean(1))


GRADIENT_CASES = {
    "group_norm": (lambda: torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.GroupNorm(2, 4),
                                               torch.nn.Flatten(), torch.nn.Linear(64, 3)), (5, 1, 6, 6)),
    "instance_norm": (lambda: torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.InstanceNorm2d(4, affine=True),
                                                  torch.nn.Flatten(), torch.nn.Linear(64, 3)), (5, 1, 6, 6)),
    "layer_norm_attention": (_Attention, (5, 4, 8)),
}


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("case", list(GRADIENT_CASES))
def test_orts_rewritten_graph_computes_torchs_loss_and_gradients(case: str, opset: int, tmp_path: Any) -> None:
    """The graph changes make_training_artifacts makes (LayerNorm's extra outputs, InstanceNormalization written
    out) keep the model's meaning: ORT's first loss and gradients are torch's, to float32 rounding."""
    build, shape = GRADIENT_CASES[case]
    torch.manual_seed(0)
    model = build()
    x, y = torch.randn(*shape), torch.tensor([0, 1, 2, 1, 0])
    save_checkpoint(to_ort({"state_dict": model.state_dict()},
                           ModuleInfo({n for n, _ in model.named_parameters()}, [])), tmp_path / "start.ckpt")
    art = make_training_artifacts(model, tmp_path / "start.ckpt", tmp_path / "art", example_input=x[:2], opset=opset)
    state = api.CheckpointState.load_checkpoint(art.checkpoint)
    module = api.Module(art.training_model, state, art.eval_model)
    module.train()
    ort_loss = float(module(x.numpy(), y.numpy()))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    assert abs(ort_loss - loss.item()) < 1e-5
    grads = {name: p.grad for name, p in state.parameters if p.requires_grad}
    assert grads.keys() == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        np.testing.assert_allclose(grads[name], p.grad.numpy(), atol=2e-6, rtol=1e-4, err_msg=name)
