"""Tensor checksums: recorded on save, verified at every entry point that loads, kept (and recognized as stale) by
ORT, and what "last" does with a file whose tensors or metadata are damaged. Real Lightning Trainers and real
onnxruntime-training 1.19.2 throughout."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import lightning_ort_ckpt
from lightning_ort_ckpt import CorruptCheckpointError, OrtCheckpoint, OrtCheckpointIO
from lightning_ort_ckpt.errors import CheckpointWarning
from lightning_ort_ckpt.format import (CheckpointContents, OptimizerGroup, load_checkpoint, open_checkpoint, save_checkpoint)
from lightning_ort_ckpt.format._checksums import PROPERTY
from lightning_ort_ckpt._translation import MANIFEST
from helpers.ort_reference import batch, make_artifacts, ort_api, ort_parameters, ort_properties
from helpers.fits import Net, files_after_fit, fit, name
from helpers.cli import run_cli
from helpers.damage import damaged_copy, flip

MODES = ["never", "params", "all"]


def sample(seed: int = 0) -> CheckpointContents:
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(64, 32, generator=g), torch.randn(64, generator=g)
    return CheckpointContents(
        trainable={"fc.weight": w, "fc.bias": b, "emb": torch.randn(300, 100, generator=g)[:, ::2]},  # strided
        frozen={"bn.running_mean": torch.randn(64, generator=g), "steps": torch.tensor(7),
                "empty": torch.zeros(0, 3), "half": torch.randn(5, generator=g).half()},
        optimizer_groups={"group0": OptimizerGroup(4, 1e-3, {n: {"momentum0": torch.randn_like(t), "momentum1":
                                                                 torch.rand_like(t)}
                                                             for n, t in (("fc.weight", w), ("fc.bias", b))})},
        properties={"epoch": 3})


def tensor_file(reader: Any, info: Any) -> str:
    return reader.data_path if info.storage == "external" else reader.path


# -- recording and verifying ---------------------------------------------------------------------------------------
@pytest.mark.usefixtures("io_path")
@pytest.mark.parametrize("mode", MODES)
def test_every_tensor_is_recorded_and_verifies(tmp_path, mode):
    path = tmp_path / "ck.ckpt"
    ck = sample()
    save_checkpoint(ck, path, external_data=mode)
    with open_checkpoint(path) as reader:
        assert PROPERTY not in reader.properties  # ours, not handed back as a user property
        assert reader.checksums is not None and reader.checksums.usable
        assert len(reader.checksums.digests) == len(reader.tensors())
        reader.verify()
    back = load_checkpoint(path)
    assert back.properties == {"epoch": 3}
    for n, t in {**ck.trainable, **ck.frozen}.items():
        got = back.trainable.get(n, back.frozen.get(n))
        assert got.dtype == t.dtype and torch.equal(got, t), n


@pytest.mark.parametrize("mode", MODES)
def test_a_flipped_bit_in_any_tensor_is_named(tmp_path, mode):
    """Every tensor with bytes, one random bit each (inline or in .data): the full load, the lazy reader with
    verify=True on that tensor (and not on the others), and verify() all name it."""
    rng = random.Random(mode)
    path = tmp_path / "ck.ckpt"
    save_checkpoint(sample(), path, external_data=mode)
    original = {p: Path(p).read_bytes() for p in (str(path), f"{path}.data") if os.path.exists(p)}
    with open_checkpoint(path) as reader:
        infos = [(i, tensor_file(reader, i), i.offset) for i in reader.tensors() if i.nbytes]
        keys = {id(i): k for i, k in ((i, reader._keys[id(i)]) for i in reader.tensors())}
    for info, file, offset in infos:
        label = keys[id(info)].split(":", 1)[1]
        flip(file, offset + rng.randrange(info.nbytes), rng.randrange(8))
        with pytest.raises(CorruptCheckpointError, match=re.escape(repr(label))) as err:
            load_checkpoint(path)
        assert err.value.path == str(path) and "checksum" in str(err.value)
        with open_checkpoint(path, verify=True) as reader:
            others = [i for i in reader.tensors() if i.nbytes and i.name != info.name]
            for other in others[:2]:
                (reader.numpy if other.dtype.name == "FLOAT16" else reader.torch)(other)
            damaged = next(i for i in reader.tensors() if reader._keys[id(i)] == keys[id(info)])
            with pytest.raises(CorruptCheckpointError, match=re.escape(repr(label))):
                reader.torch(damaged)
        with open_checkpoint(path) as reader:  # lazy without verify: reads as today
            reader.torch(next(i for i in reader.tensors() if reader._keys[id(i)] == keys[id(info)]))
        for p, data in original.items():
            Path(p).write_bytes(data)
    load_checkpoint(path)  # restored: sound again


def test_a_damaged_checksum_record_is_damage(tmp_path):
    path = tmp_path / "ck.ckpt"
    save_checkpoint(sample(), path)
    data = path.read_bytes()
    at = data.index(b'"algorithm"')
    path.write_bytes(data[:at] + b"{" + data[at + 1:])  # no longer JSON
    with pytest.raises(CorruptCheckpointError, match="checksums .* are damaged"):
        open_checkpoint(path)
    digit = data.index(b'"param:fc.bias":"') + len(b'"param:fc.bias":"')
    path.write_bytes(data[:digit] + (b"1" if data[digit:digit + 1] == b"0" else b"0") + data[digit + 1:])
    with pytest.raises(CorruptCheckpointError, match="'fc.bias'"):
        load_checkpoint(path)


def test_checksums_off_writes_what_ort_writes(tmp_path):
    save_checkpoint(sample(), tmp_path / "plain.ckpt", checksums=False)
    with open_checkpoint(tmp_path / "plain.ckpt") as reader:
        assert reader.checksums is None and "no checksums" in reader.checksum_status()


# -- ORT keeps the record, loads and trains the file; after ORT trains, the record is stale (not damage) -----------
@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return make_artifacts(str(tmp_path_factory.mktemp("art")))


def test_ort_loads_trains_and_resaves_a_checksummed_file(art, tmp_path):
    api = ort_api()
    ours = tmp_path / "ours.ckpt"
    ck = load_checkpoint(art.checkpoint)
    assert ck.properties == {}
    zeros = {n: {"momentum0": torch.zeros_like(t), "momentum1": torch.zeros_like(t)} for n, t in ck.trainable.items()}
    ck.optimizer_groups = {"group0": OptimizerGroup(2, 1e-3, zeros)}
    save_checkpoint(ck, ours)
    state = api.CheckpointState.load_checkpoint(str(ours))
    assert PROPERTY in ort_properties(state)
    # re-saved untouched: ORT kept the record and the tensors, so everything verifies
    api.CheckpointState.save_checkpoint(state, str(tmp_path / "resaved.ckpt"), include_optimizer_state=True)
    with open_checkpoint(tmp_path / "resaved.ckpt") as reader:
        assert reader.checksums.usable
        reader.verify()
    # trained: the tensors changed, ORT's step moved: recognized as stale, loaded as ORT wrote it
    module = api.Module(art.training_model, state, art.eval_model)
    opt = api.Optimizer(art.optimizer_model, module)
    module.train()
    x, y = batch()
    assert np.isfinite(module(x, y))
    opt.step()
    for include in (True, False):
        trained = tmp_path / f"trained_{include}.ckpt"
        api.CheckpointState.save_checkpoint(state, str(trained), include_optimizer_state=include)
        with open_checkpoint(trained) as reader:
            assert reader.checksums is not None and reader.checksums.stale
            assert "ONNX Runtime trained from this file" in reader.checksum_status()
            reader.verify()  # a no-op: nothing to hold the tensors against
        back = load_checkpoint(trained)
        for n, (data, _) in ort_parameters(state).items():
            t = back.trainable.get(n, back.frozen.get(n))
            assert np.array_equal(t.numpy(), data), n
        out = run_cli("verify", trained)
        assert out.returncode == 0 and "ONNX Runtime trained" in out.stdout, out.stderr


def test_files_ort_wrote_load_as_before_and_verify_says_so(art):
    assert load_checkpoint(art.checkpoint).trainable
    out = run_cli("verify", art.checkpoint)
    assert out.returncode == 0, out.stderr
    assert "no checksums" in out.stdout


# -- the entry points that load ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real Trainer's checkpoints, one per epoch (parameters inline, and a copy with external data)."""
    d = tmp_path_factory.mktemp("trained")
    fit(OrtCheckpoint(dirpath=d, save_top_k=-1), 2)
    assert files_after_fit(d) == {name(0, 4), name(1, 8)}
    return d


def test_every_loading_entry_point_names_the_damaged_tensor(trained, tmp_path):
    bad = damaged_copy(trained / name(1, 8), tmp_path / "bad.ckpt")
    pattern = re.escape(str(bad)) + ".*'layer.weight'.*checksum"
    with pytest.raises(CorruptCheckpointError, match=pattern):
        load_checkpoint(bad)
    with pytest.raises(CorruptCheckpointError, match=pattern):
        OrtCheckpointIO().load_checkpoint(bad)
    with pytest.raises(CorruptCheckpointError, match=pattern):
        fit(OrtCheckpoint(dirpath=tmp_path / "resumed"), 3, ckpt_path=str(bad))
    with pytest.raises(CorruptCheckpointError, match=pattern):
        lightning_ort_ckpt.load_from_checkpoint(Net, bad)
    out = run_cli("verify", bad)
    assert out.returncode == 1 and "'layer.weight'" in out.stderr and str(bad) in out.stderr
    assert "Traceback" not in out.stderr
    module_file = tmp_path / "netmod.py"
    module_file.write_text("from helpers.fits import Net\n")
    out = run_cli("export", bad, "--module", f"{module_file}:Net", "--output", tmp_path / "m.onnx")
    assert out.returncode == 1 and "'layer.weight'" in out.stderr and "Traceback" not in out.stderr, out.stderr
    good = run_cli("verify", trained / name(1, 8))
    assert good.returncode == 0 and "every tensor matches" in good.stdout and "decodes" in good.stdout, good.stderr


def test_verify_checks_the_lightning_metadata(trained, tmp_path):
    ck = load_checkpoint(trained / name(1, 8))
    manifest = json.loads(ck.properties[MANIFEST])
    manifest["state_dict"].append("no.such.parameter")
    ck.properties[MANIFEST] = json.dumps(manifest)
    save_checkpoint(ck, tmp_path / "meta.ckpt")  # tensors sound, fresh checksums: only the metadata is wrong
    out = run_cli("verify", tmp_path / "meta.ckpt")
    assert out.returncode == 1 and "no.such.parameter" in out.stderr, out.stdout + out.stderr


# -- "last" falls back past damage ---------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["tensor", "metadata"])
def test_resume_last_falls_back_past_damage(tmp_path, damage):
    fit(OrtCheckpoint(dirpath=tmp_path, save_top_k=-1), 2)
    newest = tmp_path / name(1, 8)
    os.utime(tmp_path / name(0, 4), (1_000_000, 1_000_000))
    os.utime(newest, (1_000_001, 1_000_001))
    if damage == "tensor":
        damaged_copy(newest, newest)  # one bit of layer.weight: the structure is intact
    else:
        data = newest.read_bytes()
        at = data.index(b'"keys":[')  # the manifest's JSON, broken in place (same length)
        newest.write_bytes(data[:at] + b'"keys":{' + data[at + len(b'"keys":['):])
    os.utime(newest, (1_000_001, 1_000_001))
    with pytest.warns(CheckpointWarning, match=re.escape(str(newest)) + ".*(checksum|metadata)"):
        trainer = fit(OrtCheckpoint(dirpath=tmp_path, save_top_k=-1), 3, ckpt_path="last")
    assert trainer.ckpt_path == str(tmp_path / name(0, 4))
    assert trainer.lightning_module.steps_run == 8 and trainer.global_step == 12


def test_two_thread_verification_names_the_damaged_tensor(tmp_path, monkeypatch):
    """Large checkpoints are verified on two threads: a full load reads each tensor on one of two threads and hashes
    it there as soon as it is read, and the lazy ``verify()`` splits the tensors between two threads. A damaged
    tensor anywhere (the first, the second, the last read) is named by both."""
    from lightning_ort_ckpt.format import _verification as reader_mod

    monkeypatch.setattr(reader_mod, "PARALLEL_VERIFY_BYTES", 0)
    path = tmp_path / "ck.ckpt"
    save_checkpoint(sample(), path)
    load_checkpoint(path)
    original = path.read_bytes()
    with open_checkpoint(path) as reader:
        infos = [(reader._keys[id(i)], i.offset) for i in reader.tensors() if i.nbytes]
    for key, offset in [*infos[:2], infos[-1]]:
        flip(path, offset)
        with pytest.raises(CorruptCheckpointError, match=re.escape(repr(key.split(":", 1)[1]))):
            load_checkpoint(path)
        with pytest.raises(CorruptCheckpointError, match=re.escape(repr(key.split(":", 1)[1]))):
            with open_checkpoint(path) as reader:
                reader.verify()
        path.write_bytes(original)


def test_lazy_verify_on_two_threads_maps_the_data_file_once(tmp_path, monkeypatch):
    """``verify()`` hashes on two threads, which both ask for the ``.data`` mapping at once: it must be made once
    (made twice, the second thread used the file the first had closed: EBADF)."""
    from lightning_ort_ckpt.format import _verification as reader_module

    monkeypatch.setattr(reader_module, "PARALLEL_VERIFY_BYTES", 0)  # two threads whatever the size
    g = torch.Generator().manual_seed(0)
    trainable = {f"w{i}": torch.randn(256, 256, generator=g) for i in range(8)}
    path = tmp_path / "external.ckpt"
    save_checkpoint(CheckpointContents(trainable=trainable), path, external_data="all")
    for _ in range(20):
        with open_checkpoint(path) as reader:
            reader.verify()
