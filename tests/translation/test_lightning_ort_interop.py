"""Lightning <-> ONNX Runtime training, end to end, against the real onnxruntime-training 1.19.2 (no mocks).

1. Lightning -> ORT: a LightningModule trained with ``Trainer(plugins=[OrtCheckpointIO()])`` and saved with
   ``trainer.save_checkpoint`` loads in ORT's ``CheckpointState`` with the module's trainable/frozen split and its
   exact values; artifacts generated from the same module train from it with ORT's ``Module`` + ``Optimizer``, and
   the optimizer state ORT reads (group0 momentum0/momentum1/step) is torch's AdamW state, bit for bit. ORT's
   first step continues torch's (same loss and moments as torch's next step); its training graph runs BatchNorm in
   training mode and updates the frozen running stats in place (running_var with the biased variance).
2. ORT -> Lightning for that file: after ORT trained and saved it, ``fit(ckpt_path=...)`` resumes with ORT's weights,
   moments and step and Lightning's epoch/global_step, and says so.
3. ORT -> Lightning for a file ORT alone wrote (generate_artifacts' checkpoint, trained by ORT): resumes with ORT's
   weights, moments and step, the live optimizer's hyperparameters, global_step = ORT's step; an SGD optimizer
   starts fresh with a warning.
4. ``ort-ckpt inspect`` shows the Lightning summary of a Lightning-saved file.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime.training")
pl = pytest.importorskip("pytorch_lightning")

import lightning_ort_ckpt
from lightning_ort_ckpt import BindCheckpointIO, OrtCheckpointIO, open_checkpoint
from lightning_ort_ckpt.errors import CheckpointWarning
from lightning_ort_ckpt._translation import MANIFEST
from helpers.ort_reference import Artifacts, assert_same_tensor, export_artifacts, ort_api, ort_parameters, ort_train

api = ort_api()

K_LIGHTNING_STEPS = 3  # Lightning trains this many steps before saving
N_ORT_STEPS = 3  # ORT trains this many more from Lightning's file
M_ORT_ONLY_STEPS = 4  # ORT trains this many from its own generate_artifacts checkpoint
LR = 0.01
BATCH = 5


class LitNet(pl.LightningModule):
    """Linear -> BatchNorm1d -> ReLU -> Linear with cross-entropy; AdamW with ORT's eps (or SGD)."""

    def __init__(self, optimizer: str = "adamw", lr: float = LR) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 6)
        self.bn = torch.nn.BatchNorm1d(6)
        self.fc2 = torch.nn.Linear(6, 3)
        self.optimizer_kind = optimizer
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_kind == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0)


def batches(count: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((BATCH, 4)).astype(np.float32), rng.integers(0, 3, BATCH).astype(np.int64))
            for _ in range(count)]


def loader(seed: int = 0, count: int = 8) -> torch.utils.data.DataLoader:
    data = batches(count, seed)
    x = torch.from_numpy(np.concatenate([b[0] for b in data]))
    y = torch.from_numpy(np.concatenate([b[1] for b in data]))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def make_trainer(max_steps: int, callbacks: list[Any] | None = None) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, max_steps=max_steps,
                      plugins=[OrtCheckpointIO()], callbacks=[*(callbacks or []), BindCheckpointIO()])


def new_model(seed: int, optimizer: str = "adamw") -> LitNet:
    torch.manual_seed(seed)
    return LitNet(optimizer)


def fit(trainer: pl.Trainer, model: LitNet, ckpt_path: Any = None) -> list[warnings.WarningMessage]:
    """``trainer.fit`` recording every warning (Lightning's own notices included)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader(), ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return caught


def checkpoint_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]


def torch_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """Per-parameter optimizer state keyed by parameter name (tensors cloned)."""
    names = {id(p): n for n, p in module.named_parameters()}
    return {names[id(p)]: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for p, s in optimizer.state.items()}


def group0(path: Any) -> tuple[int, dict[str, dict[str, torch.Tensor]]]:
    """group0's step and momentums as our reader parses them (what ORT's Optimizer reads)."""
    with open_checkpoint(path) as reader:
        g = reader.optimizer_groups["group0"]
        return g.step, {p: {m: reader.torch(i).clone() for m, i in ms.items()} for p, ms in g.states.items()}


class SnapshotAtTrainStart(pl.Callback):
    """What ``fit(ckpt_path=...)`` restored, taken before any further training step."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        self.params = torch_params(pl_module)
        self.buffers = {n: b.clone() for n, b in pl_module.named_buffers()}
        self.state = optimizer_state(pl_module, optimizer)
        self.param_groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.global_step = trainer.global_step
        self.epoch = trainer.current_epoch


# -- 1. Lightning -> ORT ------------------------------------------------------------------------------------------
@dataclass
class LightningRun:
    path: str  # the ORT file trainer.save_checkpoint wrote
    model: LitNet
    state_dict: dict[str, torch.Tensor]
    trainable: set[str]
    epoch: int
    optimizer: torch.optim.Optimizer
    opt_state: dict[str, dict[str, Any]]
    art: Artifacts


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory) -> LightningRun:
    out = tmp_path_factory.mktemp("lightning")
    model = new_model(0)
    trainer = make_trainer(K_LIGHTNING_STEPS)
    fit(trainer, model)
    assert trainer.global_step == K_LIGHTNING_STEPS
    path = str(out / "lightning.ckpt")
    trainer.save_checkpoint(path)
    optimizer = trainer.optimizers[0]
    run = LightningRun(path, model, {k: v.clone() for k, v in model.state_dict().items()},
                       {n for n, p in model.named_parameters() if p.requires_grad}, trainer.current_epoch, optimizer,
                       optimizer_state(model, optimizer),
                       export_artifacts(model, str(out / "artifacts"), torch.randn(2, 4)))
    assert model.training  # the export left the module as it was
    return run


def test_lightning_file_loads_in_ort_with_the_modules_split_and_values(lightning_run):
    run = lightning_run
    params = ort_parameters(api.CheckpointState.load_checkpoint(run.path))
    # every state_dict entry is there under its key, with the module's requires_grad split
    assert set(run.state_dict) <= set(params)
    assert {n for n in run.state_dict if params[n][1]} == run.trainable == {
        "fc1.weight", "fc1.bias", "bn.weight", "bn.bias", "fc2.weight", "fc2.bias"}
    for frozen in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert params[frozen][1] is False, frozen
    for name, tensor in run.state_dict.items():
        assert_same_tensor(params[name][0], tensor, name)
    assert int(params["bn.num_batches_tracked"][0]) == K_LIGHTNING_STEPS
    # the only other tensors are the frozen Lightning extras (RNG states and the like)
    extra = set(params) - set(run.state_dict)
    assert extra and all(n.startswith("lightning:") and not params[n][1] for n in extra), sorted(extra)
    # the artifacts were generated from the same module: its initializers are its state_dict entries
    assert set(run.art.requires_grad) == run.trainable
    assert set(run.art.frozen) == {"bn.running_mean", "bn.running_var"}


def test_group0_in_the_file_is_torchs_adamw_state_bitwise(lightning_run):
    run = lightning_run
    step, momentums = group0(run.path)
    assert step == K_LIGHTNING_STEPS
    assert set(momentums) == run.trainable
    for name, s in run.opt_state.items():
        assert int(s["step"]) == step, name
        assert_same_tensor(momentums[name]["momentum0"], s["exp_avg"], f"{name}/momentum0")
        assert_same_tensor(momentums[name]["momentum1"], s["exp_avg_sq"], f"{name}/momentum1")
    with open_checkpoint(run.path) as reader:
        g = reader.optimizer_groups["group0"]
        assert g.initial_learning_rate == pytest.approx(LR, rel=1e-7)  # float32
        assert MANIFEST in reader.properties


@pytest.fixture(scope="module")
def ort_continued(lightning_run, tmp_path_factory) -> dict[str, Any]:
    """ORT trains N_ORT_STEPS from Lightning's file (saving after the first step too) and saves with its optimizer
    state."""
    run = lightning_run
    out = tmp_path_factory.mktemp("ort_continued")
    data = batches(N_ORT_STEPS, seed=7)
    state = api.CheckpointState.load_checkpoint(run.path)
    before = ort_parameters(state)
    module = api.Module(run.art.training_model, state, run.art.eval_model)
    opt = api.Optimizer(run.art.optimizer_model, module)
    opt.set_learning_rate(LR)
    module.train()
    losses = []
    for i, (x, y) in enumerate(data):
        losses.append(float(module(x, y)))
        opt.step()
        module.lazy_reset_grad()
        if i == 0:
            api.CheckpointState.save_checkpoint(state, str(out / "after_one.ckpt"), include_optimizer_state=True)
    path = out / "ort_trained.ckpt"
    api.CheckpointState.save_checkpoint(state, str(path), include_optimizer_state=True)
    return {"path": str(path), "after_one": str(out / "after_one.ckpt"), "before": before,
            "after": ort_parameters(state), "losses": losses, "data": data}


def test_ort_trains_from_the_lightning_file(lightning_run, ort_continued):
    run, ort = lightning_run, ort_continued
    assert all(math.isfinite(loss) for loss in ort["losses"]), ort["losses"]
    for name in run.trainable:
        assert not np.array_equal(ort["after"][name][0], ort["before"][name][0]), f"{name} did not change"
    # ORT's training graph runs BatchNorm in training mode and updates the frozen running stats in place (as torch
    # does in train mode); it does not count num_batches_tracked (not in the graph), and the file keeps it
    for name in ("bn.running_mean", "bn.running_var"):
        assert not np.array_equal(ort["after"][name][0], ort["before"][name][0]), name
    assert np.array_equal(ort["after"]["bn.num_batches_tracked"][0], ort["before"]["bn.num_batches_tracked"][0])
    assert ort["after"]["bn.num_batches_tracked"][1] is False
    step, _ = group0(ort["path"])
    assert step == K_LIGHTNING_STEPS + N_ORT_STEPS  # ORT continued from torch's step


def test_ort_continues_from_torchs_moments(lightning_run, ort_continued):
    """ORT's first step equals the same step in torch from the same state (same loss, same updated moments), so ORT
    used torch's moments and step; starting from zero moments would give very different ones."""
    run, ort = lightning_run, ort_continued
    replica = LitNet()
    replica.load_state_dict(run.state_dict)
    replica.train()  # ORT's training graph runs BatchNorm on batch statistics too
    torch_opt = torch.optim.AdamW(replica.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0)
    torch_opt.load_state_dict(run.optimizer.state_dict())
    x, y = (torch.from_numpy(a) for a in ort["data"][0])
    loss = torch.nn.functional.cross_entropy(replica(x), y)
    loss.backward()
    torch_opt.step()
    assert ort["losses"][0] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    step, momentums = group0(ort["after_one"])
    assert step == K_LIGHTNING_STEPS + 1
    expected = optimizer_state(replica, torch_opt)
    for name in run.trainable:
        for m, key in (("momentum0", "exp_avg"), ("momentum1", "exp_avg_sq")):
            torch.testing.assert_close(momentums[name][m], expected[name][key], rtol=1e-4, atol=1e-7)
        # a fresh start (zero moments) would have given momentum0 = 0.1 * grad: far from what ORT has (except for
        # fc1.bias, whose gradient behind BatchNorm is rounding noise)
        fresh = (1 - 0.9) * next(p.grad for n, p in replica.named_parameters() if n == name)
        if name != "fc1.bias":
            assert not torch.allclose(momentums[name]["momentum0"], fresh, rtol=1e-3, atol=1e-7), name
    # ORT updated the frozen running stats as torch's train-mode BatchNorm does, except that running_var takes the
    # biased batch variance (torch takes the unbiased one)
    with torch.no_grad():
        h = torch.nn.functional.linear(x, run.state_dict["fc1.weight"], run.state_dict["fc1.bias"])
    with open_checkpoint(ort["after_one"]) as reader:
        torch.testing.assert_close(reader.get_tensor("bn.running_mean"), replica.bn.running_mean)
        biased = 0.9 * run.state_dict["bn.running_var"] + 0.1 * h.var(0, unbiased=False)
        torch.testing.assert_close(reader.get_tensor("bn.running_var"), biased)
        assert not torch.allclose(reader.get_tensor("bn.running_var"), replica.bn.running_var)


# -- 2. ORT -> Lightning, a file Lightning wrote and ORT trained on ----------------------------------------------
def test_lightning_resumes_from_the_ort_trained_file(lightning_run, ort_continued):
    ort = ort_continued
    step, momentums = group0(ort["path"])
    with open_checkpoint(ort["path"]) as reader:
        saved = json.loads(reader.properties[MANIFEST])["values"]
    assert saved["global_step"] == K_LIGHTNING_STEPS

    snapshot = SnapshotAtTrainStart()
    trainer = make_trainer(K_LIGHTNING_STEPS + 2, [snapshot])
    model = new_model(123)
    caught = fit(trainer, model, ort["path"])
    messages = checkpoint_warnings(caught)
    assert any(f"ONNX Runtime trained {N_ORT_STEPS} more optimizer steps" in m for m in messages), messages

    # weights and buffers: ORT's, bit for bit (running stats as ORT updated them, num_batches_tracked as Lightning
    # saved it: ORT does not count it)
    assert set(snapshot.params) == lightning_run.trainable
    for name, value in snapshot.params.items():
        assert_same_tensor(value, torch.from_numpy(ort["after"][name][0]), name)
    for name, value in snapshot.buffers.items():
        assert_same_tensor(value, torch.from_numpy(ort["after"][name][0]), name)
    # optimizer: ORT's moments, ORT's step on every parameter, Lightning's hyperparameters
    assert set(snapshot.state) == lightning_run.trainable
    for name, s in snapshot.state.items():
        assert_same_tensor(s["exp_avg"], momentums[name]["momentum0"], f"{name}/exp_avg")
        assert_same_tensor(s["exp_avg_sq"], momentums[name]["momentum1"], f"{name}/exp_avg_sq")
        assert float(s["step"]) == step == K_LIGHTNING_STEPS + N_ORT_STEPS, name
    assert snapshot.param_groups[0]["lr"] == LR and snapshot.param_groups[0]["eps"] == 1e-6
    # Lightning's metadata stays as Lightning saved it
    assert snapshot.global_step == saved["global_step"] == K_LIGHTNING_STEPS
    assert snapshot.epoch == saved["epoch"] == lightning_run.epoch
    # and training went on
    assert trainer.global_step == K_LIGHTNING_STEPS + 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not torch.equal(model.fc1.weight.detach(), snapshot.params["fc1.weight"])


# -- 3. ORT -> Lightning, a file ORT alone wrote -------------------------------------------------------------------
@pytest.fixture(scope="module")
def ort_only(tmp_path_factory) -> dict[str, Any]:
    """generate_artifacts' own checkpoint for LitNet, trained M_ORT_ONLY_STEPS by ORT, saved with optimizer state."""
    out = tmp_path_factory.mktemp("ort_only")
    model = new_model(5)
    with torch.no_grad():
        # a fresh BatchNorm's running stats equal its weight (ones) and bias (zeros); the TorchScript exporter then
        # merges those equal initializers (running_mean becomes Identity(bn.bias)) and they leave the checkpoint
        model.bn.running_mean.copy_(torch.linspace(-0.2, 0.3, 6))
        model.bn.running_var.copy_(torch.linspace(0.7, 1.4, 6))
    art = export_artifacts(model, str(out / "artifacts"), torch.randn(2, 4))
    state = api.CheckpointState.load_checkpoint(art.checkpoint)
    losses = ort_train(art, state, batches(M_ORT_ONLY_STEPS, seed=11), lr=LR)
    assert all(math.isfinite(loss) for loss in losses), losses
    path = out / "ort_only.ckpt"
    api.CheckpointState.save_checkpoint(state, str(path), include_optimizer_state=True)
    with open_checkpoint(path) as reader:
        assert MANIFEST not in reader.properties
    step, momentums = group0(path)
    assert step == M_ORT_ONLY_STEPS
    return {"path": str(path), "params": ort_parameters(state), "step": step, "momentums": momentums}


def fit_from_ort_only(ort_only: dict[str, Any], model: LitNet) -> tuple[SnapshotAtTrainStart, pl.Trainer, list[str]]:
    snapshot = SnapshotAtTrainStart()
    trainer = make_trainer(M_ORT_ONLY_STEPS + 2, [snapshot])
    caught = fit(trainer, model, ort_only["path"])
    messages = checkpoint_warnings(caught)
    assert any("was written by ONNX Runtime, not Lightning" in m for m in messages), messages
    return snapshot, trainer, messages


def check_resumed_from_ort_only(ort_only: dict[str, Any], snapshot: SnapshotAtTrainStart, optimizer: str,
                                messages: list[str]) -> None:
    """Weights and running stats from ORT; AdamW: ORT's moments and step with the live hyperparameters; SGD: fresh."""
    trainable = {n for n, (_, rg) in ort_only["params"].items() if rg}
    assert set(snapshot.params) == trainable
    for name, value in snapshot.params.items():
        assert_same_tensor(value, torch.from_numpy(ort_only["params"][name][0]), name)
    for name in ("bn.running_mean", "bn.running_var"):
        assert_same_tensor(snapshot.buffers[name], torch.from_numpy(ort_only["params"][name][0]), name)
    live = LitNet(optimizer).configure_optimizers().param_groups[0]
    if optimizer == "sgd":
        assert any("ORT's optimizer state is AdamW's; SGD starts fresh" in m for m in messages), messages
        assert snapshot.state == {}  # no momentum buffers before the first step
        keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    else:
        assert set(snapshot.state) == trainable
        for name, s in snapshot.state.items():
            assert_same_tensor(s["exp_avg"], ort_only["momentums"][name]["momentum0"], f"{name}/exp_avg")
            assert_same_tensor(s["exp_avg_sq"], ort_only["momentums"][name]["momentum1"], f"{name}/exp_avg_sq")
            assert float(s["step"]) == ort_only["step"], name
        keys = ("lr", "betas", "eps", "weight_decay", "amsgrad")
    for key in keys:  # ORT stores no hyperparameters: the live ones from configure_optimizers
        assert snapshot.param_groups[0][key] == live[key], key
    assert snapshot.epoch == 0


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_lightning_resumes_from_a_file_ort_alone_wrote(ort_only, optimizer):
    """The whole contract: fit(ckpt_path=<ORT's file>) with a plain LightningModule."""
    model = new_model(321, optimizer)
    snapshot, trainer, messages = fit_from_ort_only(ort_only, model)
    check_resumed_from_ort_only(ort_only, snapshot, optimizer, messages)
    assert snapshot.global_step == ort_only["step"]
    assert trainer.global_step == M_ORT_ONLY_STEPS + 2  # and it trained on
    assert all(torch.isfinite(p).all() for p in model.parameters())




# -- 4. the CLI ---------------------------------------------------------------------------------------------------
def test_cli_inspect_shows_the_lightning_summary(lightning_run):
    result = subprocess.run([sys.executable, "-m", "lightning_ort_ckpt", "inspect", lightning_run.path],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("Lightning checkpoint:")), None)
    assert line is not None, result.stdout
    assert f"epoch {lightning_run.epoch}, global step {K_LIGHTNING_STEPS}," in line, line
    assert f"saved by Lightning {pl.__version__}" in line, line
    assert "optimizer_states" in line and "loops" in line, line
    assert "optimizer group group0: step 3" in result.stdout


def test_ort_resave_without_optimizer_state_still_resumes(lightning_run, tmp_path):
    """ORT's save_checkpoint defaults to include_optimizer_state=False: weights and metadata survive, moments do not."""
    api = ort_api()
    out = str(tmp_path / "weights_only_by_ort.ckpt")
    api.CheckpointState.save_checkpoint(api.CheckpointState.load_checkpoint(lightning_run.path), out)
    with open_checkpoint(out) as reader:
        assert reader.optimizer_groups == {}
    snapshot = SnapshotAtTrainStart()
    caught = fit(make_trainer(K_LIGHTNING_STEPS + 1, [snapshot]), new_model(7), out)
    assert any("holds no optimizer state" in m for m in checkpoint_warnings(caught))
    for name, value in lightning_run.state_dict.items():
        assert torch.equal(snapshot.params.get(name, snapshot.buffers.get(name)), value), name
    assert snapshot.state == {} and snapshot.global_step == K_LIGHTNING_STEPS
    assert snapshot.param_groups[0]["lr"] == lightning_run.optimizer.param_groups[0]["lr"]
    loaded = lightning_ort_ckpt.load_from_checkpoint(LitNet, out)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in lightning_run.state_dict.items())
