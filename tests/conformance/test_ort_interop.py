"""Interop with the real onnxruntime-training 1.19.2 (no mocks). Every reference file is made by ORT in a tmp dir.

* ORT loads what we write (parameters, trainable/frozen split, properties), and re-saves it to the very same bytes.
* We load what ORT writes and re-save it to the very same bytes (CheckpointState path: with and without optimizer
  state, all property types, external data).
* ORT's Module + Optimizer train from a checkpoint we built out of a torch model and torch AdamW state.
* Our reader understands ORT's TensorProto-path files (generate_artifacts, nominal, onnxblock dtype zoo).
* Momentums in the .data file (external_data="all", which ORT itself never writes) are accepted by ORT 1.19.2.
"""

from __future__ import annotations

import copy
import math
import os
import struct

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime.training")

from lightning_ort_ckpt.format import (CheckpointContents, DataType, OptimizerGroup, load_checkpoint, open_checkpoint, save_checkpoint)
from lightning_ort_ckpt.format._checksums import PROPERTY as CHECKSUMS
from helpers.ort_reference import (Artifacts, assert_same_tensor, batch, file_bytes, make_artifacts, ort_api,
                                   ort_parameters, ort_properties, raw_bytes)

api = ort_api()


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> Artifacts:
    return make_artifacts(str(tmp_path_factory.mktemp("artifacts")))


def ort_load(path) -> object:
    return api.CheckpointState.load_checkpoint(str(path))


def ort_save(state, path, include_optimizer_state: bool) -> None:
    api.CheckpointState.save_checkpoint(state, str(path), include_optimizer_state=include_optimizer_state)


def loadable_checkpoint(seed: int = 0, with_optimizer: bool = True) -> CheckpointContents:
    """Every dtype ORT 1.19.2 can load, 0-d and zero-size shapes, unicode names, several groups and momentums."""
    g = torch.Generator().manual_seed(seed)
    trainable = {
        "fc.weight": torch.randn(3, 4, generator=g),
        "fc.bias": torch.randn(4, generator=g),
        "scalar": torch.tensor(1.5),
        "double": torch.randn(3, generator=g, dtype=torch.float64),
        "\u00e9t\u00e9": torch.randn(2, generator=g),
        "Zed": torch.randn(1, 1, generator=g),
    }
    frozen = {
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "i16": torch.tensor([-(2**15), 2**15 - 1], dtype=torch.int16),
        "i32": torch.tensor([[-(2**31)], [2**31 - 1]], dtype=torch.int32),
        "i64": torch.tensor([-(2**63), 2**63 - 1, 5], dtype=torch.int64),
        "i64_scalar": torch.tensor(7, dtype=torch.int64),
        "u8": torch.tensor([0, 1, 255], dtype=torch.uint8),
        "u16": torch.tensor([0, 2**16 - 1], dtype=torch.uint16),
        "u32": torch.tensor([0, 2**32 - 1], dtype=torch.uint32),
        "u64": torch.tensor([0, 2**63 + 5], dtype=torch.uint64),
        "bool": torch.tensor([[True, False, True]]),
        "empty": torch.zeros(0, 3),
        "f64_buffer": torch.tensor([1.0, 1e-300, -math.inf], dtype=torch.float64),
        "bn.running_var": torch.rand(6, generator=g),
    }
    groups = {}
    if with_optimizer:
        groups["group0"] = OptimizerGroup(step=7, initial_learning_rate=0.001, states={
            n: {"momentum0": torch.randn(p.shape, generator=g, dtype=p.dtype),
                "momentum1": torch.rand(p.shape, generator=g, dtype=p.dtype)} for n, p in trainable.items()})
        groups["groupX"] = OptimizerGroup(step=0, initial_learning_rate=0.0, states={
            "fc.bias": {"momentum0": torch.zeros(4), "other": torch.arange(3, dtype=torch.int64)}})
    props = {"epoch": 12, "neg": -(2**63), "big": 2**63 - 1, "lr": 0.1, "pi": math.pi, "neg_f": -2.5e-3,
             "run": "hello-ODTC", "\u00fcnicode_\u00e9": "v\u00e4lue \u65e5\u672c \U0001f600", "empty": "",
             "int_zero": 0}
    return CheckpointContents(trainable=trainable, frozen=frozen, optimizer_groups=groups, properties=props)


EXPECTED_PROPS = {"epoch": 12, "neg": -(2**63), "big": 2**63 - 1, "lr": f32(0.1), "pi": f32(math.pi),
                  "neg_f": f32(-2.5e-3), "run": "hello-ODTC",
                  "\u00fcnicode_\u00e9": "v\u00e4lue \u65e5\u672c \U0001f600", "empty": "", "int_zero": 0}


def assert_exact_props(got: dict, expected: dict) -> None:
    assert got == expected
    for k, v in expected.items():
        assert type(got[k]) is type(v), k


# -- ORT reads our files ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["never", "params"])
def test_ort_loads_our_checkpoint(tmp_path, mode):
    ck = loadable_checkpoint()
    path = tmp_path / "ours.ckpt"
    save_checkpoint(ck, path, external_data=mode)
    state = ort_load(path)
    params = ort_parameters(state)
    assert set(params) == set(ck.trainable) | set(ck.frozen)
    for name, expected in {**ck.trainable, **ck.frozen}.items():
        data, requires_grad = params[name]
        assert requires_grad == (name in ck.trainable), name
        assert data.shape == tuple(expected.shape), name
        assert data.dtype == expected.numpy().dtype, name
        assert raw_bytes(data) == raw_bytes(expected), name
    props = ort_properties(state)
    assert CHECKSUMS in props  # ORT keeps our checksum record as a property it does not use
    assert_exact_props({k: v for k, v in props.items() if k != CHECKSUMS}, EXPECTED_PROPS)


@pytest.mark.parametrize("mode", ["never", "params"])
@pytest.mark.parametrize("include_optimizer_state", [True, False], ids=["with_opt", "no_opt"])
def test_ort_resaves_our_file_to_identical_bytes(tmp_path, include_optimizer_state, mode):
    ck = loadable_checkpoint()
    ours = tmp_path / "ours.ckpt"
    save_checkpoint(ck, ours, external_data=mode, checksums=include_optimizer_state)
    theirs = tmp_path / "theirs.ckpt"
    ort_save(ort_load(ours), theirs, include_optimizer_state)
    if not include_optimizer_state:  # ORT drops the groups (but keeps an empty optimizer_groups vector, as we do)
        ck.optimizer_groups = {}
        save_checkpoint(ck, ours, external_data=mode, checksums=False)
    assert file_bytes(theirs) == file_bytes(ours)
    assert os.path.exists(f"{theirs}.data") == (mode == "params")
    if mode == "params":
        assert file_bytes(f"{theirs}.data") == file_bytes(f"{ours}.data")


@pytest.mark.parametrize("mode", ["never", "params"])
def test_ort_resaves_minimal_checkpoints_identically(tmp_path, mode):
    cases = {
        "params_only": CheckpointContents(trainable={"w": torch.ones(2)}),
        "frozen_only": CheckpointContents(frozen={"b": torch.arange(3)}),
        "props_only": CheckpointContents(properties={"note": "only a string property"}),
        "one_of_each_prop": CheckpointContents(trainable={"w": torch.ones(1)}, properties={"i": 1, "f": 0.5, "s": "x"}),
        "group_without_states": CheckpointContents(trainable={"w": torch.ones(1)},
                                           optimizer_groups={"group0": OptimizerGroup(3, 0.25)}),
        "empty": CheckpointContents(),
    }
    for name, ck in cases.items():
        ours, theirs = tmp_path / f"{name}.ckpt", tmp_path / f"{name}.ort.ckpt"
        save_checkpoint(ck, ours, external_data=mode)
        ort_save(ort_load(ours), theirs, include_optimizer_state=True)
        assert file_bytes(theirs) == file_bytes(ours), name
        if os.path.exists(f"{ours}.data"):
            assert file_bytes(f"{theirs}.data") == file_bytes(f"{ours}.data"), name


# -- we read ORT's CheckpointState files and re-save them identically ---------------------------------------------
@pytest.fixture(scope="module")
def ort_trained(art, tmp_path_factory):
    """Files ORT wrote itself after Module + Optimizer + 2 AdamW steps (plus one right after Optimizer creation)."""
    out = tmp_path_factory.mktemp("ort_trained")
    x, y = batch()
    state = ort_load(art.checkpoint)
    module = api.Module(art.training_model, state, art.eval_model)
    opt = api.Optimizer(art.optimizer_model, module)
    ort_save(state, out / "step0_opt.ckpt", include_optimizer_state=True)
    module.train()
    for _ in range(2):
        loss = module(x, y)
        opt.step()
        module.lazy_reset_grad()
    assert np.isfinite(loss)
    opt.set_learning_rate(0.0123)  # not saved: initial_learning_rate stays 0.001
    props = {"epoch": 7, "a_neg": -5, "int_min": -(2**63), "int_max": 2**63 - 1, "best_loss": 0.1,
             "zz_pi": math.pi, "neg_f": -1.25, "run_name": "hello-ODTC", "unicode_\u00e9": "v\u00e4lue \U0001f600",
             "empty_str": "", "int_zero": 0}
    for k, v in props.items():
        state.properties[k] = v
    ort_save(state, out / "step2_opt_props.ckpt", include_optimizer_state=True)
    ort_save(state, out / "step2_noopt_props.ckpt", include_optimizer_state=False)
    params = ort_parameters(state)
    return {"dir": out, "props": props, "params": params}


@pytest.mark.parametrize("name", ["step0_opt", "step2_opt_props", "step2_noopt_props"])
def test_we_resave_ort_written_file_identically(ort_trained, tmp_path, name):
    theirs = ort_trained["dir"] / f"{name}.ckpt"
    ck = load_checkpoint(theirs)
    ours = tmp_path / "ours.ckpt"
    save_checkpoint(ck, ours, checksums=False)  # no record: exactly ORT's bytes
    assert file_bytes(ours) == file_bytes(theirs)
    # the parameters are ORT's values, bit for bit
    for pname, (data, requires_grad) in ort_trained["params"].items():
        t = ck.trainable[pname] if requires_grad else ck.frozen[pname]
        if name != "step0_opt":
            assert raw_bytes(t) == raw_bytes(data), pname
            assert t.dtype == torch.from_numpy(data).dtype
    if name == "step0_opt":
        g = ck.optimizer_groups["group0"]
        assert g.step == 0 and g.initial_learning_rate == f32(0.001)
        for ms in g.states.values():
            assert all(not m.any() for m in ms.values())  # zeros right after Optimizer()
        assert ck.properties == {}
    elif name == "step2_opt_props":
        g = ck.optimizer_groups["group0"]
        assert g.step == 2 and g.initial_learning_rate == f32(0.001)
        assert set(g.states) == {n for n, (_, rg) in ort_trained["params"].items() if rg}
        assert all(set(ms) == {"momentum0", "momentum1"} for ms in g.states.values())
        assert all(ms["momentum1"].any() for ms in g.states.values())
    else:
        assert ck.optimizer_groups == {}
    if name != "step0_opt":
        expected = {k: f32(v) if isinstance(v, float) else v for k, v in ort_trained["props"].items()}
        assert ck.properties == expected
        assert ck.properties["best_loss"] == 0.10000000149011612 and type(ck.properties["int_zero"]) is int


def test_we_resave_ort_zero_float_property_identically(art, tmp_path):
    state = ort_load(art.checkpoint)
    state.properties["zero_f"] = 0.0
    state.properties["one_f"] = 1.0
    ort_save(state, tmp_path / "theirs.ckpt", include_optimizer_state=False)
    ck = load_checkpoint(tmp_path / "theirs.ckpt")
    assert type(ck.properties["zero_f"]) is float
    save_checkpoint(ck, tmp_path / "ours.ckpt", checksums=False)
    assert file_bytes(tmp_path / "ours.ckpt") == file_bytes(tmp_path / "theirs.ckpt")


def test_external_data_written_by_ort(art, tmp_path):
    """ORT writes external data for a state loaded from an external-data file; we re-save both files identically."""
    ck = load_checkpoint(art.checkpoint)
    ours = tmp_path / "ours.ckpt"
    save_checkpoint(ck, ours, external_data="params", checksums=False)
    state = ort_load(ours)
    module = api.Module(art.training_model, state, art.eval_model)
    opt = api.Optimizer(art.optimizer_model, module)
    module.train()
    x, y = batch(1)
    module(x, y)
    opt.step()
    state.properties["epoch"] = 1
    state.properties["lr_seen"] = 0.001
    state.properties["tag"] = "external"
    for include in (True, False):
        theirs = tmp_path / f"theirs_{include}.ckpt"
        ort_save(state, theirs, include_optimizer_state=include)
        assert os.path.exists(f"{theirs}.data")
        with open_checkpoint(theirs) as reader:
            assert reader.has_external_data
            assert all(i.storage == "external" for i in [*reader.trainable.values(), *reader.frozen.values()])
            assert all(i.storage == "inline" for i in reader.tensors() if i.kind == "momentum")  # ORT keeps them inline
            assert bool(reader.optimizer_groups) == include
        loaded = load_checkpoint(theirs)
        if include:
            assert loaded.optimizer_groups["group0"].step == 1
        mine = tmp_path / f"mine_{include}.ckpt"
        save_checkpoint(loaded, mine, external_data="params", checksums=False)
        assert file_bytes(mine) == file_bytes(theirs)
        assert file_bytes(f"{mine}.data") == file_bytes(f"{theirs}.data")
        for name, (data, _) in ort_parameters(state).items():
            t = loaded.trainable.get(name, loaded.frozen.get(name))
            assert raw_bytes(t) == raw_bytes(data), name


# -- ORT trains from a checkpoint made from torch -----------------------------------------------------------------
def test_ort_trains_from_our_checkpoint(art, tmp_path):
    x, y = batch(2)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    model = copy.deepcopy(art.model).train()
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0)
    torch.nn.functional.cross_entropy(model(xt), yt).backward()
    torch_opt.step()
    torch_opt.zero_grad()
    # the checkpoint: names are state_dict keys; parameters trainable, buffers frozen
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    param_names = [n for n, _ in model.named_parameters()]
    assert param_names == art.requires_grad
    states = {n: {"momentum0": torch_opt.state[p]["exp_avg"].clone(),
                  "momentum1": torch_opt.state[p]["exp_avg_sq"].clone()} for n, p in model.named_parameters()}
    step = int(torch_opt.state[next(iter(model.parameters()))]["step"])
    assert step == 1
    ck = CheckpointContents(trainable={n: sd[n] for n in param_names},
                    frozen={n: sd[n] for n in sd if n not in param_names},  # incl. bn.num_batches_tracked
                    optimizer_groups={"group0": OptimizerGroup(step=step, initial_learning_rate=1e-3, states=states)},
                    properties={"epoch": 1, "source": "torch"})
    assert "bn.num_batches_tracked" in ck.frozen and "offset_idx" in ck.frozen
    path = tmp_path / "from_torch.ckpt"
    save_checkpoint(ck, path)

    state = ort_load(path)
    before = ort_parameters(state)
    assert {n for n, (_, rg) in before.items() if rg} == set(param_names)
    module = api.Module(art.training_model, state, art.eval_model)
    opt = api.Optimizer(art.optimizer_model, module)
    opt.set_learning_rate(1e-3)
    module.train()
    loss = float(module(x, y))
    opt.step()
    module.lazy_reset_grad()
    assert math.isfinite(loss)
    after = ort_parameters(state)
    for n in param_names:
        assert not np.array_equal(after[n][0], before[n][0]), f"{n} did not change"
    assert np.array_equal(after["offset_idx"][0], [2, 0, 1])

    # the same step in torch: same loss (so ORT used our parameter values), close momentums (so it used ours)
    torch_loss = torch.nn.functional.cross_entropy(model(xt), yt)
    torch_loss.backward()
    torch_opt.step()
    assert loss == pytest.approx(torch_loss.item(), rel=1e-5, abs=1e-6)

    out = tmp_path / "ort_after_step.ckpt"
    ort_save(state, out, include_optimizer_state=True)
    back = load_checkpoint(out)
    g = back.optimizer_groups["group0"]
    assert g.step == step + 1
    assert back.properties == {"epoch": 1, "source": "torch"}
    assert set(back.trainable) == set(param_names)
    assert "bn.num_batches_tracked" in back.frozen  # kept although the graph does not use it
    for n, p in model.named_parameters():
        for m, key in (("momentum0", "exp_avg"), ("momentum1", "exp_avg_sq")):
            got = g.states[n][m]
            assert torch.isfinite(got).all()
            assert not torch.equal(got, states[n][m]), f"{n}/{m} was not updated"
            torch.testing.assert_close(got, torch_opt.state[p][key], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(back.trainable[n], p.detach(), rtol=0, atol=5e-4)
    # ORT kept our checksum record, which no longer matches the tensors it trained: recognized, not damage
    with open_checkpoint(out) as reader:
        assert reader.checksums is not None and reader.checksums.stale
        assert "ONNX Runtime trained" in reader.checksum_status()
    # and our writer reproduces ORT's file, but with a fresh checksum record instead of the stale one
    save_checkpoint(back, tmp_path / "again.ckpt", checksums=False)
    ort_save(ort_load(tmp_path / "again.ckpt"), tmp_path / "again_ort.ckpt", include_optimizer_state=True)
    assert file_bytes(tmp_path / "again.ckpt") == file_bytes(tmp_path / "again_ort.ckpt")
    save_checkpoint(back, tmp_path / "again.ckpt")
    with open_checkpoint(tmp_path / "again.ckpt") as reader:
        assert reader.checksums.usable
        reader.verify()


# -- our reader on ORT's TensorProto-path files -------------------------------------------------------------------
def test_reader_on_generate_artifacts_checkpoint(art, tmp_path):
    with open_checkpoint(art.checkpoint) as reader:
        assert reader.version == 2 and not reader.nominal and not reader.has_external_data
        # initializer order, not sorted
        assert list(reader.trainable) == [n for n in art.initializer_order if n in art.requires_grad]
        assert list(reader.frozen) == [n for n in art.initializer_order if n in art.frozen]
        assert list(reader.trainable) != sorted(reader.trainable)
        assert reader.optimizer_groups == {} and reader.properties == {}
        assert reader.frozen["offset_idx"].dtype is DataType.INT64
        for name in [*reader.trainable, *reader.frozen]:
            t = reader.get_tensor(name)
            assert raw_bytes(t) == raw_bytes(art.initializers[name]), name
            assert tuple(t.shape) == art.initializers[name].shape
        assert reader.get_tensor("offset_idx").tolist() == [2, 0, 1]
    ck = load_checkpoint(art.checkpoint)
    for name, value in art.initializers.items():
        if name in ck.trainable or name in ck.frozen:
            t = ck.trainable.get(name, ck.frozen.get(name))
            assert raw_bytes(t) == raw_bytes(value), name
    # our re-save equals ORT's own CheckpointState re-save of the same file
    save_checkpoint(ck, tmp_path / "ours.ckpt", checksums=False)
    ort_save(ort_load(art.checkpoint), tmp_path / "theirs.ckpt", include_optimizer_state=True)
    assert file_bytes(tmp_path / "ours.ckpt") == file_bytes(tmp_path / "theirs.ckpt")


def test_reader_on_nominal_checkpoint(art, tmp_path):
    with open_checkpoint(art.nominal_checkpoint) as reader:
        assert reader.nominal
        assert list(reader.trainable) == [n for n in art.initializer_order if n in art.requires_grad]
        assert list(reader.frozen) == [n for n in art.initializer_order if n in art.frozen]
        for info in reader.tensors():
            assert info.storage == "none" and info.shape == ()
            expected = DataType.INT64 if info.name == "offset_idx" else DataType.FLOAT
            assert info.dtype is expected
    ck = load_checkpoint(art.nominal_checkpoint)
    assert ck.nominal and ck.frozen["offset_idx"].dtype == torch.int64
    # a nominal file we write from it: ORT sees the same names and split and refuses data access, as for its own
    save_checkpoint(ck, tmp_path / "ours_nominal.ckpt")
    for path in (art.nominal_checkpoint, tmp_path / "ours_nominal.ckpt"):
        state = ort_load(path)
        assert len(state.parameters) == len(art.requires_grad) + len(art.frozen)
        assert all(n in state.parameters for n in [*art.requires_grad, *art.frozen])
        with pytest.raises(RuntimeError, match="nominal state"):
            state.parameters["fc1.weight"]


def _proto(name, dtype, dims, raw=None, doc=None, strings=None):
    from onnx import TensorProto, helper

    if strings is not None:
        t = helper.make_tensor(name, TensorProto.STRING, dims, [s.encode("utf-8") for s in strings])
    else:
        t = TensorProto()
        t.name, t.data_type = name, dtype
        t.dims.extend(dims)
        t.raw_data = raw
    if doc is not None:
        t.doc_string = doc
    return t


def test_reader_on_onnxblock_dtype_zoo(tmp_path):
    from onnx import helper
    from onnxruntime.training import onnxblock

    rng = np.random.default_rng(0)
    arrays = {  # name -> (DataType, shape, raw little-endian bytes)
        "f32": (DataType.FLOAT, (2, 3), np.arange(6, dtype="<f4").tobytes()),
        "f32_scalar": (DataType.FLOAT, (), np.array(1.5, "<f4").tobytes()),
        "f32_empty": (DataType.FLOAT, (0, 3), b""),
        "u8": (DataType.UINT8, (3,), bytes([1, 2, 255])),
        "i8": (DataType.INT8, (3,), np.array([-1, 0, 1], "i1").tobytes()),
        "u16": (DataType.UINT16, (2,), np.array([1, 65535], "<u2").tobytes()),
        "i16": (DataType.INT16, (2,), np.array([-2, 3], "<i2").tobytes()),
        "i32": (DataType.INT32, (2,), np.array([-2, 3], "<i4").tobytes()),
        "i64": (DataType.INT64, (3,), np.array([-2, 1 << 40, 5], "<i8").tobytes()),
        "bool": (DataType.BOOL, (3,), bytes([1, 0, 1])),
        "f64": (DataType.DOUBLE, (2,), np.array([1.0, 1e-300], "<f8").tobytes()),
        "u32": (DataType.UINT32, (2,), np.array([1, 2**32 - 1], "<u4").tobytes()),
        "u64": (DataType.UINT64, (2,), np.array([1, 2**64 - 1], "<u8").tobytes()),
        "f16": (DataType.FLOAT16, (2, 2), rng.standard_normal(4).astype("<f2").tobytes()),
        "bf16": (DataType.BFLOAT16, (2,), bytes.fromhex("803f00c0")),
        "f8e4m3fn": (DataType.FLOAT8E4M3FN, (2,), bytes([0x38, 0xC0])),
        "f8e4m3fnuz": (DataType.FLOAT8E4M3FNUZ, (2,), bytes([0x40, 0xC8])),
        "f8e5m2": (DataType.FLOAT8E5M2, (2,), bytes([0x3C, 0xC0])),
        "f8e5m2fnuz": (DataType.FLOAT8E5M2FNUZ, (2,), bytes([0x40, 0xC4])),
    }
    trainable = [_proto("f32", 1, [2, 3], arrays["f32"][2], doc="a doc string"),
                 helper.make_tensor("from_float_data", 1, [2], [1.0, 2.0])]
    frozen = [_proto(n, int(dt), list(shape), raw) for n, (dt, shape, raw) in arrays.items() if n != "f32"]
    strings = ["ab", "c\u00e9", "", "\U0001f600"]
    frozen.append(_proto("str", 8, [2, 2], strings=strings, doc="strings"))
    path = tmp_path / "zoo.ckpt"
    onnxblock.save_checkpoint((trainable, frozen), str(path))

    with open_checkpoint(path) as reader:
        assert list(reader.trainable) == ["f32", "from_float_data"]
        assert list(reader.frozen) == [n for n in arrays if n != "f32"] + ["str"]  # given order kept
        assert reader.trainable["f32"].doc_string == "a doc string"
        assert reader.frozen["str"].doc_string == "strings"
        assert reader.frozen["i8"].doc_string is None
        for name, (dt, shape, raw) in arrays.items():
            info = reader.trainable.get(name) or reader.frozen[name]
            assert info.dtype is dt and info.shape == shape and info.storage == "inline", name
            assert reader.numpy(info).tobytes() == raw, name
            t = reader.torch(info)
            assert t.dtype == dt.to_torch() and raw_bytes(t) == raw, name
        assert raw_bytes(reader.get_tensor("from_float_data")) == np.array([1.0, 2.0], "<f4").tobytes()
        s = reader.frozen["str"]
        assert s.dtype is DataType.STRING and s.storage == "strings" and s.shape == (2, 2)
        assert reader.numpy(s).tolist() == [["ab", "c\u00e9"], ["", "\U0001f600"]]
    ck = load_checkpoint(path)
    assert ck.frozen["str"].tolist() == [["ab", "c\u00e9"], ["", "\U0001f600"]]
    assert ck.frozen["bf16"].dtype == torch.bfloat16 and ck.frozen["bf16"].tolist() == [1.0, -2.0]
    assert ck.frozen["f16"].dtype == torch.float16
    assert ck.frozen["f8e4m3fn"].float().tolist() == [1.0, -2.0]
    for name, (dt, shape, raw) in arrays.items():
        t = ck.trainable.get(name, ck.frozen.get(name))
        assert raw_bytes(t) == raw and tuple(t.shape) == shape, name

    # the ORT-loadable part: ORT's CheckpointState re-save (sorted, doc dropped) == our load + save
    loadable = [_proto(n, int(dt), list(shape), raw) for n, (dt, shape, raw) in arrays.items()
                if dt.ort_loadable and n != "f32"]
    onnxblock.save_checkpoint((trainable, loadable), str(tmp_path / "loadable.ckpt"))
    ort_save(ort_load(tmp_path / "loadable.ckpt"), tmp_path / "theirs.ckpt", include_optimizer_state=False)
    save_checkpoint(load_checkpoint(tmp_path / "loadable.ckpt"), tmp_path / "ours.ckpt", checksums=False)
    assert file_bytes(tmp_path / "ours.ckpt") == file_bytes(tmp_path / "theirs.ckpt")


def test_ort_rejects_dtypes_it_cannot_load(tmp_path):
    """What DataType.ort_loadable claims: ORT 1.19.2 refuses float16 and friends in CheckpointState.load_checkpoint."""
    for dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        path = tmp_path / f"{dtype}.ckpt"
        save_checkpoint(CheckpointContents(frozen={"x": torch.zeros(2, dtype=dtype)}), path)
        code = int(open_checkpoint(path).frozen["x"].dtype)
        assert not DataType(code).ort_loadable
        with pytest.raises(Exception, match=f"Unsupported data type: {code}"):
            ort_load(path)


# -- momentums in external data (external_data="all") --------------------------------------------------------------
def test_ort_accepts_external_momentums(art, tmp_path):
    """ORT 1.19.2 never writes momentums to .data, but its loader reads them from there (external_data_offset on a
    momentum tensor): CheckpointState.load_checkpoint, Optimizer() and a training step all work, the momentum values
    are read exactly, and ORT's re-save moves them back inline (== our external_data="params" file)."""
    model = art.model
    sd = model.state_dict()
    g = torch.Generator().manual_seed(5)
    states = {n: {"momentum0": torch.randn(p.shape, generator=g) * 0.01,
                  "momentum1": torch.rand(p.shape, generator=g) * 1e-4} for n, p in model.named_parameters()}
    ck = CheckpointContents(trainable={n: sd[n] for n in art.requires_grad}, frozen={n: sd[n] for n in art.frozen},
                    optimizer_groups={"group0": OptimizerGroup(3, 1e-3, states)}, properties={"k": "v"})
    paths = {}
    for mode in ("never", "params", "all"):
        paths[mode] = tmp_path / f"{mode}.ckpt"
        save_checkpoint(ck, paths[mode], external_data=mode)
    with open_checkpoint(paths["all"]) as reader:
        assert all(i.storage == "external" for i in reader.tensors())

    # 1. load + re-save (no Module): momentums come back bit-exact, inline; the file equals our "params" file
    state = ort_load(paths["all"])
    ort_save(state, tmp_path / "resaved.ckpt", include_optimizer_state=True)
    assert file_bytes(tmp_path / "resaved.ckpt") == file_bytes(paths["params"])
    assert file_bytes(tmp_path / "resaved.ckpt.data") == file_bytes(f"{paths['params']}.data")

    # 2. a training step from each file gives bit-identical results: the external momentums were used
    x, y = batch(3)
    results = {}
    for mode, path in paths.items():
        state = ort_load(path)
        module = api.Module(art.training_model, state, art.eval_model)
        opt = api.Optimizer(art.optimizer_model, module)
        module.train()
        loss = float(module(x, y))
        opt.step()
        assert math.isfinite(loss)
        out = tmp_path / f"{mode}_after.ckpt"
        ort_save(state, out, include_optimizer_state=True)
        results[mode] = load_checkpoint(out)
    for mode in ("params", "all"):
        a, b = results[mode], results["never"]
        assert a.optimizer_groups["group0"].step == 4
        for n in art.requires_grad:
            assert_same_tensor(a.trainable[n], b.trainable[n], n)
            for m in ("momentum0", "momentum1"):
                assert_same_tensor(a.optimizer_groups["group0"].states[n][m],
                                   b.optimizer_groups["group0"].states[n][m], f"{mode} {n}/{m}")
    # and the momentums did matter: zero momentums give a different step
    zero = copy.deepcopy(ck)
    zero.optimizer_groups["group0"].states = {n: {m: torch.zeros_like(t) for m, t in ms.items()}
                                              for n, ms in states.items()}
    save_checkpoint(zero, tmp_path / "zero.ckpt", external_data="all")
    state = ort_load(tmp_path / "zero.ckpt")
    module = api.Module(art.training_model, state, art.eval_model)
    opt = api.Optimizer(art.optimizer_model, module)
    module.train()
    module(x, y)
    opt.step()
    w = ort_parameters(state)["fc1.weight"][0]
    assert not np.array_equal(w, results["all"].trainable["fc1.weight"].numpy())
