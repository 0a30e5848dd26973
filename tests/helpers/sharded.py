"""The training script of the sharded-strategy tests (ModelParallel and FSDP, sharded and full state, sync and
async), its modes, and how its records are read and compared (tests/lightning_side/test_sharded_strategies.py,
tests/checkpointing/test_plugin_alone.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

MODES = ("mp-sharded", "mp-full", "fsdp-sharded", "fsdp-full")
CKPT = "epoch=0-step=4.ckpt"
SHARDED = ("mp-sharded", "fsdp-sharded")
ASYNC = ("mp-sharded-async", "fsdp-sharded-async")
VALIDATED = ("mp-sharded-val", "mp-full-val")
"""ModelParallel with a validation (drawing random numbers) after each epoch's last batch: after the step-4 save."""

CPU_FSDP = r'''
from pytorch_lightning.strategies import FSDPStrategy


def cpu_tolerant_full_state():
    """Test only: torch's FSDP1 full state dicts with ``offload_to_cpu=True`` (Lightning's, for
    ``state_dict_type="full"``) count on the move to CPU making a copy; on CPU it is a no-op returning the same memory:
    (1) ``FlatParamHandle.to_cpu`` then frees the gathered parameters the state dict still views (a segfault),
    (2) ``_unflatten_orig_param_states`` skips its clone, so every optimizer state of a parameter views one reused
    gather buffer (``exp_avg`` comes out as ``exp_avg_sq``). On CPU there is nothing to move: these two do on CPU
    what they do without offloading; on accelerators they are torch's."""
    import contextlib
    from torch.distributed.fsdp import _optim_utils
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    to_cpu, unflatten = FlatParamHandle.to_cpu, _optim_utils._unflatten_orig_param_states

    @contextlib.contextmanager
    def to_cpu_unless_there(self):
        if self.device.type == "cpu":
            yield
        else:
            with to_cpu(self):
                yield

    def unflatten_cloning_on_cpu(info, output_states, state_name, shard_state, to_save, cpu_offload):
        on_cpu = info.handle.flat_param.device.type == "cpu"
        unflatten(info, output_states, state_name, shard_state, to_save, cpu_offload and not on_cpu)

    FlatParamHandle.to_cpu = to_cpu_unless_there
    _optim_utils._unflatten_orig_param_states = unflatten_cloning_on_cpu


cpu_tolerant_full_state()


class CPUFSDPStrategy(FSDPStrategy):
    """Test only: FSDPStrategy (FSDP1) on CPU. Lightning refuses ``FSDPStrategy`` itself without CUDA (its accelerator
    connector checks the exact type, so a subclass passes), and hands FSDP ``device_id=root_device.index``, None on
    CPU, for which torch asks for an accelerator; with ``device_id=torch.device("cpu")`` torch runs FSDP1 on CPU.
    This one wraps the module itself with that device and lets Lightning's ``_setup_model`` (which leaves an FSDP
    module as it is) do the rest; saving and loading are FSDPStrategy's (and so ours) unchanged. With it,
    ``cpu_tolerant_full_state`` above."""

    def _setup_model(self, model):
        from torch.distributed.fsdp import FullyShardedDataParallel
        model = FullyShardedDataParallel(model, cpu_offload=self.cpu_offload,
                                         mixed_precision=self.mixed_precision_config,
                                         sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                                         **self.kwargs)
        self.kwargs.pop("auto_wrap_policy", None)  # applied: Lightning would warn that it is ignored
        return super()._setup_model(model)
'''
"""Script text: ``FSDPStrategy`` (FSDP1) on CPU for tests (``CPUFSDPStrategy``, ``cpu_tolerant_full_state``); it needs
``torch`` imported."""

SCRIPT = r'''
import hashlib, json, os, sys, warnings
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from pytorch_lightning.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from lightning_ort_ckpt import OrtCheckpoint


class Net(pl.LightningModule):
    def __init__(self, sharded_by_hand):
        super().__init__()
        self.sharded_by_hand = sharded_by_hand
        self.l0, self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(16, 1)
        self.l0.requires_grad_(False)
        self.register_buffer("scale", torch.full((1,), 0.5))

    def configure_model(self):
        if self.sharded_by_hand:
            from torch.distributed.fsdp import fully_shard
            mesh = self.device_mesh["data_parallel"]
            for m in (self.l1, self.l2):
                fully_shard(m, mesh=mesh)
            fully_shard(self, mesh=mesh)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(self.l0(x)))) * self.scale

    def training_step(self, batch, batch_idx):
        x = batch[0] + 0.05 * torch.randn_like(batch[0])  # per-rank random numbers decide the run
        return nn.functional.mse_loss(self(x), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.01)

    def on_fit_start(self):
        torch.manual_seed(1000 + self.global_rank)


class ValNet(Net):
    def validation_step(self, batch, batch_idx):
        x = batch[0] + 0.05 * torch.randn_like(batch[0])  # the validation's random numbers, after the save
        self.log("val_loss", nn.functional.mse_loss(self(x), batch[1]))


class Record(pl.Callback):
    def __init__(self, out, name):
        self.out, self.name, self.rng = out, name, {}

    def full_state(self, trainer, pl_module):
        model = trainer.strategy.model
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = get_model_state_dict(model, options=opts)
        osd = get_optimizer_state_dict(model, trainer.optimizers[0], options=opts)
        return {"model": sd, "optim": osd}

    def dump(self, trainer, pl_module, what):
        state = self.full_state(trainer, pl_module)
        if trainer.global_rank == 0:
            torch.save(state, os.path.join(self.out, f"{self.name}.{what}.pt"))

    def on_train_start(self, trainer, pl_module):
        self.start = trainer.global_step
        self.dump(trainer, pl_module, "start")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rng[trainer.global_step] = hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()

    def on_fit_end(self, trainer, pl_module):
        self.dump(trainer, pl_module, "end")
        with open(os.path.join(self.out, f"{self.name}.rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"start": self.start, "end": trainer.global_step, "rng": self.rng,
                       "warnings": [str(w.message) for w in CAUGHT]}, f)


''' + CPU_FSDP + r'''

def strategy(kind, devices):
    if kind.startswith("mp"):
        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1,
                                     save_distributed_checkpoint=kind.startswith("mp-sharded"))
    return CPUFSDPStrategy(state_dict_type=kind.split("-")[1], auto_wrap_policy={nn.Linear})


def fit(out, kind, name, max_steps, devices=2, ckpt_path=None, every=4, top_k=-1, extra=()):
    pl.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    y = torch.sin(x).sum(1, keepdim=True)
    cb = OrtCheckpoint(os.path.join(out, kind, name), every_n_train_steps=every, save_top_k=top_k,
                       async_save=kind.endswith("-async"))
    validated = kind.endswith("-val")
    trainer = pl.Trainer(max_steps=max_steps, strategy=strategy(kind, devices), devices=devices,
                         accelerator="cpu",
                         logger=False, callbacks=[Record(out, f"{kind}-{name}"), cb, *extra], num_sanity_val_steps=0,
                         enable_progress_bar=False, enable_model_summary=False,
                         **({} if validated else {"limit_val_batches": 0}))
    trainer.fit((ValNet if validated else Net)(kind.startswith("mp")), DataLoader(TensorDataset(x, y), batch_size=4),
                DataLoader(TensorDataset(x[:8], y[:8]), batch_size=4) if validated else None, ckpt_path=ckpt_path)
    wrapped = sorted(k for k in ("save_checkpoint", "load_checkpoint") if k in vars(trainer.strategy))
    with open(os.path.join(out, f"{kind}-{name}.wrapped{trainer.global_rank}.json"), "w") as f:
        json.dump(wrapped, f)  # our methods are gone from the strategy once fit is over
    from lightning_fabric.utilities.cloud_io import _load
    from pytorch_lightning.core import saving
    from pytorch_lightning.trainer.connectors.checkpoint_connector import _CheckpointConnector
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
    own = sum(len(o._optimizer_step_pre_hooks) + len(o._optimizer_step_post_hooks) for o in trainer.optimizers)
    lightnings = {"pl_load": saving.pl_load is _load,  # (the callback still exists here)
                  "_parse_ckpt_path": not hasattr(_CheckpointConnector._parse_ckpt_path, "__wrapped__")}
    with open(os.path.join(out, f"{kind}-{name}.hooks{trainer.global_rank}.json"), "w") as f:
        json.dump([len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks), own,
                   sorted(k for k, v in lightnings.items() if not v)], f)  # after every fit


def memory_of_full_saves(out):
    """Rank 0's memory during full-state saves (``mp-full``) of 4 ``nn.Linear(1024, 1024)`` trained by AdamW: the
    peak above the memory before each save (``VmHWM``, reset through ``/proc/self/clear_refs``; the launcher has glibc
    map every allocation of 64 KiB or more on its own, so freed memory leaves the RSS at once) and the gathered
    state's size."""
    class Wide(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(4))

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard
            for layer in self.layers:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            x = batch[0]
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x.square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def kb(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    trainer = pl.Trainer(max_steps=3, strategy=strategy("mp-full", 2), devices=2, accelerator="cpu", logger=False,
                         callbacks=[OrtCheckpoint(os.path.join(out, "memory"), every_n_train_steps=1)],
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    save, peaks = trainer.save_checkpoint, []

    def measured_save(*args, **kwargs):
        before = kb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        save(*args, **kwargs)
        peaks.append((kb("VmHWM") - before) / 1024)

    trainer.save_checkpoint = measured_save
    trainer.fit(Wide(), DataLoader(TensorDataset(torch.randn(12, 1024)), batch_size=4))
    gathered = sum(3 * p.numel() * 4 for p in trainer.lightning_module.parameters()) / 2**20  # AdamW: 2 moments
    if trainer.global_rank == 0:
        with open(os.path.join(out, "memory.json"), "w") as f:
            json.dump({"peaks_mib": peaks, "gathered_mib": gathered}, f)


class NoRoomAfterStep1(pl.Callback):
    """From step 1 on, no file of this process may grow past 256 bytes (the kernel's RLIMIT_FSIZE, its signal
    ignored): the step-2 save fails as on a full disk, on every rank, while it is written."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        import resource, signal
        if trainer.global_step == 1:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (256, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def fit_failing(out, kind):
    import resource
    try:
        fit(out, kind, "failing", 6, every=2, extra=[NoRoomAfterStep1()])
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit[1], limit[1]))
    rank = int(os.environ.get("LOCAL_RANK", 0))
    with open(os.path.join(out, f"{kind}-failing.error{rank}.json"), "w") as f:
        json.dump(error, f)


out, steps = sys.argv[1], [step.split("=") for step in sys.argv[2:]]  # each step: <phase>=<kind>,<kind>...
warnings.simplefilter("ignore")
with warnings.catch_warnings(record=True) as CAUGHT:
    warnings.simplefilter("always", UserWarning)
    for phase, kind in [(phase, kind) for phase, kinds in steps for kind in kinds.split(",")]:
        if phase == "first":
            fit(out, kind, "full", 8)
            fit(out, kind, "half", 4)
        elif phase == "resume":
            fit(out, kind, "resumed", 8, ckpt_path=os.path.join(out, kind, "half", "epoch=0-step=4.ckpt"))
        elif phase == "last":  # a copy of the half run's folder: resume from "last", keep the newest save only
            fit(out, kind, "last", 8, ckpt_path="last", every=2, top_k=1)
        elif phase == "memory":
            memory_of_full_saves(out)
        elif phase == "fail":
            fit_failing(out, kind)
        else:
            fit(out, kind, "resumed1", 8, devices=1, ckpt_path=os.path.join(out, kind, "half", "epoch=0-step=4.ckpt"))
'''


def record(tmp_path: Path, name: str, rank: int) -> dict[str, Any]:
    return json.loads((tmp_path / f"{name}.rank{rank}.json").read_text())


def state(tmp_path: Path, name: str, when: str) -> dict[str, Any]:
    """The full module and optimizer state (gathered by torch's helpers) at the start or end of a fit."""
    return torch.load(tmp_path / f"{name}.{when}.pt")


def assert_same_state(a: dict[str, Any], b: dict[str, Any], where: str) -> None:
    assert a["model"].keys() == b["model"].keys(), where
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), (where, k)
    assert a["optim"]["state"].keys() == b["optim"]["state"].keys() and a["optim"]["state"], where
    for param, moments in a["optim"]["state"].items():
        for m, t in moments.items():
            assert torch.equal(t, b["optim"]["state"][param][m]), (where, param, m)


DEFINITIONS = SCRIPT[:SCRIPT.index("\nout, steps = ")]
"""The script's module, strategies and ``fit`` without its main part: for scripts of other tests to build on."""
