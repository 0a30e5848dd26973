"""Hugging Face export (issue 42, point 2): ``export_safetensors`` and ``ort-ckpt export --format safetensors``
write what ``from_pretrained`` loads, bit for bit, from a file or a sharded folder, local or remote; every dtype;
checksums checked on the way; memory of one tensor, not the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import fsspec
import pytest
import pytorch_lightning as pl
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from lightning_ort_ckpt import CorruptCheckpointError, OrtCheckpoint, OrtCheckpointIO
from lightning_ort_ckpt._command._cli import main
from lightning_ort_ckpt._dcp._dcp_storage import save_sharded
from lightning_ort_ckpt.export import ExportError, export_safetensors

ROOT = Path(__file__).resolve().parents[2]


class Finetune(pl.LightningModule):
    """A LightningModule holding a ``transformers`` model, as fine-tuning code does, and a buffer of its own."""

    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2)
        self.model = GPT2LMHeadModel(config)  # lm_head is tied to transformer.wte
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen += 1
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _trainer(steps: int, **kwargs: object) -> pl.Trainer:
    return pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Finetune, str]:
    torch.manual_seed(0)
    module = Finetune()
    ids = torch.randint(0, 96, (8, 12), generator=torch.Generator().manual_seed(0))
    callback = OrtCheckpoint(dirpath=tmp_path_factory.mktemp("finetune"), save_last=True)
    _trainer(3, callbacks=[callback]).fit(module, DataLoader(TensorDataset(ids), batch_size=4))
    return module, callback.last_model_path


def _loaded_equals(folder: Path, trained: torch.nn.Module) -> None:
    trained.config.save_pretrained(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    want, got = trained.state_dict(), loaded.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied again


def test_from_pretrained_gives_the_trained_weights(finetuned: tuple[Finetune, str], tmp_path: Path) -> None:
    module, checkpoint = finetuned
    report = export_safetensors(checkpoint, tmp_path / "hf", prefix="model")
    assert [os.path.basename(f) for f in report.files] == ["model.safetensors"]
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert "lm_head.weight" not in saved and "seen" not in saved  # tied key once, as save_pretrained; outside prefix
    assert report.tensors == len(saved) and report.nbytes == sum(t.nbytes for t in saved.values())
    _loaded_equals(tmp_path / "hf", module.model)


def test_sharded_output_has_the_standard_index(finetuned: tuple[Finetune, str], tmp_path: Path) -> None:
    module, checkpoint = finetuned
    out = tmp_path / "hf"
    export_safetensors(checkpoint, out, prefix="model")  # an earlier, single-file export in the same folder
    report = export_safetensors(checkpoint, out, prefix="model.", max_shard_size=40_000)
    names = sorted(os.listdir(out))
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names  # the stale file went
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == report.nbytes
    assert set(index["weight_map"].values()) == {os.path.basename(f) for f in report.files[:-1]}
    assert len(report.files) - 1 > 2
    _loaded_equals(out, module.model)


def test_cli_format_safetensors(finetuned: tuple[Finetune, str], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    module, checkpoint = finetuned
    assert main(["export", checkpoint, "--format", "safetensors", "--prefix", "model", "-o",
                 str(tmp_path / "hf"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["tensors"] == len(load_file(tmp_path / "hf" / "model.safetensors"))
    _loaded_equals(tmp_path / "hf", module.model)
    assert main(["export", checkpoint, "--format", "safetensors", "--prefix", "nothing", "-o",
                 str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert "no parameter or buffer under prefix 'nothing'" in err and "model" in err and "Traceback" not in err
    assert main(["export", checkpoint, "-o", str(tmp_path / "m.onnx")]) == 1  # ONNX still needs --module
    assert "--module" in capsys.readouterr().err


class Dtypes(pl.LightningModule):
    """Buffers of every kind a model holds: integers, bool, narrow and wide floats."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        g = torch.Generator().manual_seed(1)
        for dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            self.register_buffer(f"b_{str(dtype)[6:]}", torch.randint(-100 if dtype.is_signed else 0, 100, (3, 5),
                                                                     generator=g).to(dtype))
        self.register_buffer("b_bool", torch.rand(7, generator=g) > 0.5)
        for dtype in (torch.float16, torch.bfloat16, torch.float64):
            self.register_buffer(f"b_{str(dtype)[6:]}", torch.randn(2, 3, generator=g).to(dtype))
        self.register_buffer("b_scalar", torch.tensor(7, dtype=torch.int64))
        self.register_buffer("b_empty", torch.zeros(0, 4, dtype=torch.int32))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("ort_compatible", [False, True])  # True stores float16/bfloat16 as float32
def test_every_dtype_bit_for_bit(tmp_path: Path, ort_compatible: bool) -> None:
    module = Dtypes()
    trainer = _trainer(1, plugins=[OrtCheckpointIO(ort_compatible=ort_compatible)], enable_checkpointing=False)
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(2, 4)), batch_size=2))
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    export_safetensors(tmp_path / "c.ckpt", tmp_path / "out")
    got = load_file(tmp_path / "out" / "model.safetensors")
    want = module.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def test_sharded_folder_and_remote_file(finetuned: tuple[Finetune, str], tmp_path: Path) -> None:
    module, checkpoint = finetuned
    folder = tmp_path / "sharded.ckpt"
    save_sharded({"state_dict": module.state_dict(), "epoch": 0, "global_step": 3}, str(folder))
    export_safetensors(folder, tmp_path / "from-folder", prefix="model")
    _loaded_equals(tmp_path / "from-folder", module.model)
    url = f"memory://safetensors-{tmp_path.name}/last.ckpt"
    with fsspec.open(url, "wb") as f:
        f.write(Path(checkpoint).read_bytes())
    export_safetensors(url, tmp_path / "from-url", prefix="model")
    _loaded_equals(tmp_path / "from-url", module.model)


def test_a_damaged_tensor_is_caught_and_nothing_is_written(finetuned: tuple[Finetune, str], tmp_path: Path) -> None:
    module, checkpoint = finetuned
    weight = module.model.transformer.h[0].mlp.c_fc.weight.detach()
    data = bytearray(Path(checkpoint).read_bytes())
    at = bytes(data).find(weight.numpy().tobytes()[:64])
    assert at > 0
    data[at + 10] ^= 0x01
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="transformer.h.0.mlp.c_fc.weight"):
        export_safetensors(damaged, tmp_path / "out", prefix="model")
    assert not [f for f in os.listdir(tmp_path / "out") if "safetensors" in f]


def test_a_torch_file_or_a_tree_without_weights_is_refused_by_name(tmp_path: Path) -> None:
    torch.save({"state_dict": {"w": torch.zeros(2)}}, tmp_path / "plain.ckpt")
    with pytest.raises(ExportError, match="not an ORT checkpoint"):
        export_safetensors(tmp_path / "plain.ckpt", tmp_path / "out")
    save_sharded({"model": {"w": torch.zeros(2)}, "step": 3}, str(tmp_path / "other.ckpt"))  # no state_dict
    with pytest.raises(ExportError, match="other.ckpt: it holds no module weights"):
        export_safetensors(tmp_path / "other.ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


_MEMORY = textwrap.dedent("""
    import sys
    import torch
    from lightning_ort_ckpt._export import _consolidate  # what the export imports: not part of its memory
    from lightning_ort_ckpt.export import export_safetensors

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

    torch.zeros(1)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    export_safetensors(sys.argv[1], sys.argv[2])
    print(status("VmHWM") - before)
""")


class Wide(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048, bias=False) for _ in range(12)))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layers(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_memory_is_one_tensor_not_the_model(tmp_path: Path) -> None:
    """12 tensors of 16 MiB (192 MiB): the export's peak grows by about one tensor."""
    module = Wide()
    trainer = _trainer(1, plugins=[OrtCheckpointIO()], enable_checkpointing=False)
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(2, 2048)), batch_size=2))
    trainer.save_checkpoint(tmp_path / "wide.ckpt")
    tensor_bytes = 2048 * 2048 * 4
    model_bytes = 12 * tensor_bytes
    del module, trainer
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _MEMORY, str(tmp_path / "wide.ckpt"), str(tmp_path / "out")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    grew = int(run.stdout.split()[-1])
    assert grew < tensor_bytes + (24 << 20) < model_bytes, f"the export took {grew >> 20} MiB more"
    assert os.path.getsize(tmp_path / "out" / "model.safetensors") > model_bytes
