"""A sharded checkpoint directory as one ORT file (``consolidate``): what ORT 1.19.2 loads and trains from, the
layout an unsharded save gets, the CLI on a directory, and memory bounded by one tensor."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from lightning_ort_ckpt import consolidate, load_checkpoint
from lightning_ort_ckpt._command._cli import main
from lightning_ort_ckpt._dcp._dcp_storage import METADATA_NAME, save_sharded
from lightning_ort_ckpt._translation.lightning_dict import ModuleInfo, from_ort, to_ort
from helpers.ort_reference import SmallNet, batch, export_artifacts, ort_api, ort_parameters, ort_train


def _trained() -> tuple[SmallNet, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = SmallNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        x, y = batch()
        torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _lightning_dict(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, opt)  # as ModelParallelStrategy saves: optimizer state by name
    return {"state_dict": model_sd, "optimizer_states": [optim_sd], "epoch": 1, "global_step": 2,
            "pytorch-lightning_version": "2.6.6", "loops": {"fit_loop": {"epoch_progress": {"current": 1}}},
            "callbacks": {"ModelCheckpoint": {"best_model_score": torch.tensor(0.25)}}}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SmallNet, torch.optim.Optimizer]:
    model, opt = _trained()
    path = tmp_path_factory.mktemp("sharded") / "epoch=1-step=2.ckpt"
    save_sharded(_lightning_dict(model, opt), str(path))
    return path, model, opt


def test_same_layout_as_an_unsharded_save(sharded: tuple[Path, SmallNet, torch.optim.Optimizer],
                                          tmp_path: Path) -> None:
    path, model, opt = sharded
    out = tmp_path / "one.ckpt"
    consolidate(path, out)
    got = load_checkpoint(out)
    plain = {**_lightning_dict(model, opt), "optimizer_states": [opt.state_dict()],
             "state_dict": model.state_dict()}
    want = to_ort(plain, ModuleInfo.from_module(model, [opt]), ort_compatible=True)
    assert sorted(got.trainable) == sorted(want.trainable) == sorted(n for n, _ in model.named_parameters())
    assert sorted(got.frozen) == sorted(want.frozen)
    assert sorted(got.optimizer_groups) == sorted(want.optimizer_groups) == ["group0"]
    g, w = got.optimizer_groups["group0"], want.optimizer_groups["group0"]
    assert g.step == w.step == 2
    for param, momentums in w.states.items():
        for name, tensor in momentums.items():
            assert torch.equal(g.states[param][name], tensor), (param, name)
    for name, tensor in {**want.trainable, **want.frozen}.items():
        if not name.startswith("lightning:"):
            assert torch.equal({**got.trainable, **got.frozen}[name], tensor), name
    back = from_ort(got, str(out))  # and this library reads it as the Lightning checkpoint it was
    assert back["global_step"] == 2 and back["loops"] == {"fit_loop": {"epoch_progress": {"current": 1}}}
    assert float(back["callbacks"]["ModelCheckpoint"]["best_model_score"]) == 0.25
    assert torch.equal(back["optimizer_states"][0]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_ort_loads_and_trains_from_it(sharded: tuple[Path, SmallNet, torch.optim.Optimizer],
                                      tmp_path: Path) -> None:
    path, model, _ = sharded
    out = tmp_path / "one.ckpt"
    consolidate(path, out)
    api = ort_api()
    state = api.CheckpointState.load_checkpoint(str(out))
    params = ort_parameters(state)
    for name, tensor in model.state_dict().items():
        if name in params:
            assert np.array_equal(params[name][0], tensor.numpy()), name
            assert params[name][1] == (name in dict(model.named_parameters())), name
    art = export_artifacts(model, str(tmp_path / "artifacts"), torch.randn(5, 4))
    losses = ort_train(art, state, [batch(1), batch(2)], lr=0.01)
    assert all(np.isfinite(losses)) and len(losses) == 2
    after = ort_parameters(state)
    assert not np.array_equal(after["fc1.weight"][0], params["fc1.weight"][0])  # ORT trained it


def test_cli_consolidate_inspect_verify_on_a_directory(sharded: tuple[Path, SmallNet, torch.optim.Optimizer],
                                                       tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _, _ = sharded
    out = tmp_path / "cli.ckpt"
    assert main(["consolidate", str(path), str(out)]) == 0
    assert load_checkpoint(out).optimizer_groups["group0"].step == 2
    capsys.readouterr()
    assert main(["inspect", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["file"] == str(path) and "fc1.weight" in json.dumps(report)
    assert main(["verify", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"OK {path}")


def test_cli_errors_are_one_line(sharded: tuple[Path, SmallNet, torch.optim.Optimizer], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.ckpt"
    empty.mkdir()
    assert main(["consolidate", str(empty), str(tmp_path / "x.ckpt")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "no checkpoint.ort-meta" in err
    assert not (tmp_path / "x.ckpt").exists()
    damaged = tmp_path / "damaged.ckpt"
    damaged.mkdir()
    path, _, _ = sharded
    for f in path.iterdir():
        if not f.name.startswith("."):
            (damaged / f.name).write_bytes(f.read_bytes())
    shard = next(f for f in damaged.iterdir() if f.name.endswith(".odtc"))
    data = bytearray(shard.read_bytes())
    weight = next(t for n, t in SmallNet().named_parameters() if n == "fc1.weight")  # a shape to find: 6 x 4 floats
    assert weight.numel() == 24
    doc = json.loads((damaged / METADATA_NAME).read_text())
    assert doc["tensors"]["state_dict/fc1.weight"]["size"] == [6, 4]
    data[len(data) // 2] ^= 0xFF  # somewhere in the tensors' bytes or the structure: either is reported
    shard.write_bytes(bytes(data))
    assert main(["verify", str(damaged)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("INVALID ") and str(shard) in err


_MEMORY_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from lightning_ort_ckpt import consolidate

    def rss(field):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

    torch.zeros(1)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = rss("VmRSS")
    consolidate(sys.argv[1], sys.argv[2])
    print(rss("VmHWM") - before)
""")


def test_consolidation_memory_is_one_tensor(tmp_path: Path) -> None:
    tensor_bytes = 24 << 20
    g = torch.Generator().manual_seed(0)
    state = {"state_dict": {f"layer{i}.weight": torch.randn(tensor_bytes // 4 // 1024, 1024, generator=g)
                            for i in range(6)}, "epoch": 0}
    src = tmp_path / "big.ckpt"
    save_sharded(state, str(src))
    del state
    out = tmp_path / "one.ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(src), str(out)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    grew = int(run.stdout.split()[-1])
    assert grew < tensor_bytes + (40 << 20), f"consolidating 6 x {tensor_bytes >> 20} MiB took {grew >> 20} MiB"
    got = load_checkpoint(out)
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        assert torch.equal(got.frozen[f"layer{i}.weight"], torch.randn(tensor_bytes // 4 // 1024, 1024, generator=g))


def test_export_reads_a_sharded_directory_and_its_errors_name_it(
        sharded: tuple[Path, SmallNet, torch.optim.Optimizer], tmp_path: Path) -> None:
    from lightning_ort_ckpt.errors import CheckpointError
    from lightning_ort_ckpt.export import export_onnx

    path, model, _ = sharded
    x = torch.from_numpy(batch()[0])
    export_onnx(SmallNet(), path, tmp_path / "m.onnx", example_input=x)
    import onnxruntime

    session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"))
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    np.testing.assert_allclose(got, copy.deepcopy(model).eval()(x).detach().numpy(), atol=1e-5)  # exported: eval

    class Wider(SmallNet):  # parameter shapes the checkpoint does not have
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(5, 6)

    with pytest.raises(CheckpointError) as e:
        export_onnx(Wider(), path, tmp_path / "w.onnx", example_input=x)
    assert e.value.path == str(path) and str(path) in str(e.value) and "consolidated" not in str(e.value)


def test_training_artifacts_from_a_sharded_directory_train_in_ort(
        sharded: tuple[Path, SmallNet, torch.optim.Optimizer], tmp_path: Path) -> None:
    from lightning_ort_ckpt.artifacts import make_training_artifacts

    path, model, _ = sharded
    x, y = batch()
    art = make_training_artifacts(SmallNet(), path, tmp_path / "art", example_input=torch.from_numpy(x))
    assert {"fc1.weight", "fc2.weight"} <= set(art.trainable)
    api = ort_api()
    state = api.CheckpointState.load_checkpoint(art.checkpoint)
    for name, want in model.state_dict().items():
        if name in art.trainable:
            np.testing.assert_array_equal(dict(state.parameters)[name].data, want.numpy())
    module = api.Module(art.training_model, state, art.eval_model)
    optimizer = api.Optimizer(art.optimizer_model, module)
    before = dict(state.parameters)["fc1.weight"].data.copy()
    module.train()
    module(x, y)
    optimizer.step()
    assert not np.array_equal(dict(state.parameters)["fc1.weight"].data, before)
