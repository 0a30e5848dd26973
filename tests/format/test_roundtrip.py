"""Our writer and reader round-trip every dtype, shape, property, optimizer group and external-data mode bit for bit.

Both read paths are covered: ``load_checkpoint`` (fresh tensors, the file read whole) and ``open_checkpoint`` (lazy,
zero-copy from the memory map where alignment allows).
"""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from lightning_ort_ckpt import CheckpointError, CheckpointSaveError
from lightning_ort_ckpt.format import (CheckpointContents, DataType, OptimizerGroup, load_checkpoint, open_checkpoint, save_checkpoint)
from lightning_ort_ckpt.format._atomic import wait_for_cleanup
from helpers.ort_reference import assert_same_tensor, file_bytes, raw_bytes

NUMERIC_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz,
    torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64,
    torch.bool, torch.complex64, torch.complex128,
]
SHAPES = [(), (0, 3), (7,), (2, 3, 5), (3, 0)]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaN payloads, denormals, extremes included); bool gets 0/1 only."""
    g = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def all_tensors(ck: CheckpointContents) -> dict[str, object]:
    out: dict[str, object] = {}
    out.update({f"trainable/{n}": t for n, t in ck.trainable.items()})
    out.update({f"frozen/{n}": t for n, t in ck.frozen.items()})
    for g, group in ck.optimizer_groups.items():
        for p, ms in group.states.items():
            out.update({f"{g}/{p}/{m}": t for m, t in ms.items()})
    return out


def assert_checkpoints_equal(actual: CheckpointContents, expected: CheckpointContents) -> None:
    assert list(actual.trainable) == sorted(expected.trainable, key=str.encode)
    assert list(actual.frozen) == sorted(expected.frozen, key=str.encode)
    assert actual.nominal == expected.nominal
    a, e = all_tensors(actual), all_tensors(expected)
    assert a.keys() == e.keys()
    for key in e:
        if isinstance(e[key], np.ndarray) and np.asarray(e[key]).dtype.kind in "OUS":
            assert isinstance(a[key], np.ndarray) and a[key].shape == e[key].shape, key
            assert a[key].tolist() == np.vectorize(_text, otypes=[object])(e[key]).tolist(), key
        else:
            assert isinstance(a[key], torch.Tensor), key
            expected_t = e[key] if isinstance(e[key], torch.Tensor) else torch.from_numpy(
                np.ascontiguousarray(np.asarray(e[key]).astype(np.asarray(e[key]).dtype.newbyteorder("="))))
            assert_same_tensor(a[key], expected_t, key)
    assert actual.optimizer_groups.keys() == expected.optimizer_groups.keys()
    for name, group in expected.optimizer_groups.items():
        got = actual.optimizer_groups[name]
        assert got.step == group.step
        assert got.initial_learning_rate == _f32(group.initial_learning_rate)
        assert {p: sorted(ms) for p, ms in got.states.items()} == {p: sorted(ms) for p, ms in group.states.items()}


def _text(s: object) -> str:
    return s.decode("utf-8") if isinstance(s, bytes) else str(s)


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def check_lazy(path: str, expected: CheckpointContents) -> None:
    """``open_checkpoint`` gives the same tensors as the checkpoint that was saved, via torch() and numpy()."""
    exp = all_tensors(expected)
    with open_checkpoint(path) as reader:
        infos = {f"{i.kind}/{i.name}": i for i in [*reader.trainable.values(), *reader.frozen.values()]}
        for g in reader.optimizer_groups.values():
            for p, ms in g.states.items():
                infos.update({f"{g.name}/{p}/{m}": i for m, i in ms.items()})
        assert infos.keys() == exp.keys()
        for key, info in infos.items():
            e = exp[key]
            if info.storage == "strings":
                assert reader.numpy(info).tolist() == np.vectorize(_text, otypes=[object])(e).tolist()
                continue
            e_bytes = raw_bytes(e)
            assert info.nbytes == len(e_bytes)
            t = reader.torch(info)
            assert t.dtype == (e.dtype if isinstance(e, torch.Tensor) else torch.from_numpy(
                np.zeros(0, np.asarray(e).dtype.newbyteorder("="))).dtype), key
            assert tuple(t.shape) == tuple(e.shape), key
            assert raw_bytes(t) == e_bytes, key
            if info.nbytes:
                assert t.data_ptr() % t.element_size() == 0, f"{key}: misaligned tensor handed out"
            arr = reader.numpy(info)
            assert arr.shape == tuple(e.shape) and arr.tobytes() == e_bytes, key
            if info.kind != "momentum":
                assert raw_bytes(reader.get_tensor(info.name)) == e_bytes


def roundtrip(tmp_path, ck: CheckpointContents, external_data: str = "never", name: str = "ck.ckpt") -> CheckpointContents:
    path = str(tmp_path / name)
    save_checkpoint(ck, path, external_data=external_data)
    loaded = load_checkpoint(path)
    assert_checkpoints_equal(loaded, ck)
    check_lazy(path, ck)
    return loaded


# -- dtypes and shapes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", NUMERIC_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype_and_shape_class(tmp_path, dtype):
    tensors = {f"t{i}": random_tensor(s, dtype, seed=i) for i, s in enumerate(SHAPES)}
    ck = CheckpointContents(trainable=dict(list(tensors.items())[:2]), frozen=dict(list(tensors.items())[2:]),
                    optimizer_groups={"group0": OptimizerGroup(1, 0.5, {"t0": {"momentum0": tensors["t3"]}})})
    roundtrip(tmp_path, ck)
    with open_checkpoint(tmp_path / "ck.ckpt") as reader:
        for info in reader.tensors():
            assert info.dtype.to_torch() == dtype
            assert info.dtype.to_torch() == dtype


@pytest.mark.usefixtures("io_path")
@pytest.mark.parametrize("mode", ["params", "all"])
@pytest.mark.parametrize("dtype", NUMERIC_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype_external(tmp_path, dtype, mode):
    # odd byte counts between blobs exercise the .data alignment padding (8 for int64/double, else 4)
    tensors = {f"t{i}": random_tensor(s, dtype, seed=i) for i, s in enumerate([(3,), (), (0, 3), (5, 1)])}
    pad = {"pad": random_tensor((5,), torch.uint8, seed=9)}
    ck = CheckpointContents(trainable={**tensors, **pad}, frozen={"z": random_tensor((3,), dtype, seed=5)},
                    optimizer_groups={"group0": OptimizerGroup(2, 0.1, {"t0": {"momentum0": tensors["t3"]}})})
    roundtrip(tmp_path, ck, mode)
    with open_checkpoint(tmp_path / "ck.ckpt") as reader:
        assert reader.has_external_data
        for info in reader.tensors():
            assert info.storage == ("external" if info.kind != "momentum" or mode == "all" else "inline")
            if info.storage == "external":
                assert info.offset % info.dtype.external_alignment == 0


@pytest.mark.usefixtures("io_path")
def test_large_tensor(tmp_path):
    big = random_tensor((1024, 1280), torch.float32, seed=1)  # 5 MiB: written directly, not gathered
    big64 = random_tensor((3, 131072), torch.int64, seed=2)  # 3 MiB
    ck = CheckpointContents(trainable={"big": big, "small": torch.arange(3.0)}, frozen={"big64": big64},
                    optimizer_groups={"group0": OptimizerGroup(1, 0.1, {"big": {"momentum0": big.t()}})})
    for mode in ("never", "params", "all"):
        roundtrip(tmp_path, ck, mode, name=f"{mode}.ckpt")


@pytest.mark.usefixtures("io_path")
def test_write_paths_give_the_same_bytes(tmp_path, monkeypatch):
    """The writer's fast paths (small pieces gathered into writev, write-behind every few MiB) against plain
    writes: the same bytes, short writes continued where they stopped. 1,500 small tensors pass writev's 1,024-piece
    limit; 40 MB of large ones pass several write-behind steps, in the .ckpt and in the .data file."""
    from lightning_ort_ckpt.format import _diskio as diskio

    small = {f"s{i:04d}": random_tensor((i % 7 + 1,), torch.float32, seed=i) for i in range(1500)}
    large = {f"w{i}": random_tensor((1024, 2560), torch.float32, seed=100 + i) for i in range(4)}  # 10 MiB each
    ck = CheckpointContents(trainable={**small, **large}, frozen={"f": random_tensor((3, 5), torch.int64, seed=9)},
                    optimizer_groups={"group0": OptimizerGroup(2, 1e-3, {n: {"momentum0": t * 2}
                                                                         for n, t in large.items()})})
    files = {}
    fast = str(tmp_path / "fast.ckpt")
    save_checkpoint(ck, fast, external_data="params")
    files["fast"] = fast

    def short_writev(fd, views):  # writes at most half of the first piece (and never 0 bytes)
        return os.write(fd, views[0][:max(1, len(views[0]) // 2)])

    with monkeypatch.context() as m:
        m.setattr(os, "writev", short_writev)
        files["short"] = str(tmp_path / "short.ckpt")
        save_checkpoint(ck, files["short"], external_data="params")
    with monkeypatch.context() as m:
        m.delattr(os, "writev")  # as on Windows
        m.setattr(diskio.WriteBehind, "open", classmethod(lambda cls, out: None))
        files["plain"] = str(tmp_path / "plain.ckpt")
        save_checkpoint(ck, files["plain"], external_data="params")
    for name, path in files.items():
        for suffix in ("", ".data"):
            assert file_bytes(path + suffix) == file_bytes(files["plain"] + suffix), (name, suffix)
    assert os.path.getsize(fast + ".data") > 40e6
    assert_checkpoints_equal(load_checkpoint(fast), ck)


@pytest.mark.usefixtures("io_path")
def test_non_contiguous_torch_tensors(tmp_path):
    base = random_tensor((6, 8), torch.float32, seed=3)
    cplx = random_tensor((4, 3), torch.complex64, seed=4)
    views = {
        "transposed": base.t(),
        "sliced_step": base[:, ::3],
        "sliced_offset": base[2:, 1:5],
        "strided_2d": base[::2, 1::3],
        "expanded": torch.arange(4, dtype=torch.int64).expand(3, 4),
        "permuted": random_tensor((2, 3, 4), torch.int16, seed=5).permute(2, 0, 1),
        "conj": cplx.conj(),
        "neg": cplx.conj().imag,  # a view with torch's negative bit set
        "f64_t_slice": torch.arange(6.0, dtype=torch.float64).reshape(2, 3).t()[1:],
        "int64_col": random_tensor((5, 4), torch.int64, seed=6)[:, 1],
        "bf16_t": random_tensor((3, 5), torch.bfloat16, seed=7).t(),
        "requires_grad": torch.nn.Parameter(torch.randn(3, 2)).t(),
    }
    assert views["conj"].is_conj() and views["neg"].is_neg()
    assert not any(v.is_contiguous() for k, v in views.items() if k not in ("conj", "neg"))
    expected = {k: v.detach().resolve_conj().resolve_neg().contiguous() for k, v in views.items()}
    path = str(tmp_path / "nc.ckpt")
    save_checkpoint(CheckpointContents(trainable=views), path)
    loaded = load_checkpoint(path)
    for k, v in expected.items():
        assert_same_tensor(loaded.trainable[k], v, k)
    check_lazy(path, CheckpointContents(trainable=expected))


def test_numpy_inputs(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f64": rng.standard_normal(5),
        "f16": rng.standard_normal((2, 2)).astype(np.float16),
        "i8": np.array([-128, 0, 127], np.int8),
        "i16": np.array([-(2**15), 2**15 - 1], np.int16),
        "i32": np.array([-(2**31), 2**31 - 1], np.int32),
        "i64": np.array([-(2**63), 2**63 - 1, 0], np.int64),
        "u8": np.array([0, 255], np.uint8),
        "u16": np.array([0, 2**16 - 1], np.uint16),
        "u32": np.array([0, 2**32 - 1], np.uint32),
        "u64": np.array([0, 2**64 - 1], np.uint64),
        "bool": np.array([[True, False], [False, True]]),
        "c64": (rng.standard_normal(3) + 1j * rng.standard_normal(3)).astype(np.complex64),
        "c128": rng.standard_normal(2) + 1j * rng.standard_normal(2),
        "scalar": np.array(3.5, np.float32),
        "empty": np.zeros((0, 3), np.int32),
        "fortran": np.asfortranarray(rng.standard_normal((3, 5)).astype(np.float32)),
        "neg_strides": np.arange(20, dtype=np.int64).reshape(4, 5)[::-1, ::-2],
        "np_scalar_type": np.float64(2.5),  # a numpy scalar, not an array
    }
    path = str(tmp_path / "np.ckpt")
    save_checkpoint(CheckpointContents(frozen=arrays), path)
    loaded = load_checkpoint(path)
    for k, a in arrays.items():
        a = np.asarray(a)
        t = loaded.frozen[k]
        assert t.dtype == torch.from_numpy(np.zeros(0, a.dtype)).dtype, k
        assert tuple(t.shape) == a.shape, k
        assert raw_bytes(t) == raw_bytes(a), k
        np.testing.assert_array_equal(t.numpy(), a, err_msg=k)
    check_lazy(path, CheckpointContents(frozen={k: np.asarray(a) for k, a in arrays.items()}))


def test_big_endian_numpy_input(tmp_path):
    arrays = {
        "be_i32": np.arange(12, dtype=">i4").reshape(3, 4),
        "be_f64": np.array([1.5, -2.25, 1e-300, np.inf], dtype=">f8"),
        "be_u16": np.array([1, 258, 65535], dtype=">u2"),
        "be_c64": np.array([1 + 2j, -3.5j], dtype=">c8"),
        "be_i64_t": np.arange(6, dtype=">i8").reshape(2, 3).T,  # non-contiguous too
        "be_scalar": np.array(7.25, dtype=">f4"),
    }
    path = str(tmp_path / "be.ckpt")
    save_checkpoint(CheckpointContents(trainable=arrays), path)
    loaded = load_checkpoint(path)
    for k, a in arrays.items():
        little = a.astype(a.dtype.newbyteorder("<"))
        np.testing.assert_array_equal(loaded.trainable[k].numpy(), little, err_msg=k)
        assert raw_bytes(loaded.trainable[k]) == np.ascontiguousarray(little).tobytes(), k
    # the file holds little-endian bytes: the inline data of be_i32 is 0, 1, 2, ... as <i4
    with open_checkpoint(path) as reader:
        info = reader.trainable["be_i32"]
        assert file_bytes(path)[info.offset:info.offset + 48] == np.arange(12, dtype="<i4").tobytes()


def test_string_tensors(tmp_path):
    strings = {
        "grid": np.array([["a", "\u00e9t\u00e9"], ["", "\u65e5\u672c\u8a9e \U0001f600"]]),
        "objects": np.array(["x", "", "long " * 50], dtype=object),
        "scalar": np.array("only one"),
        "empty": np.array([], dtype=str).reshape(0, 2),
        "bytes": np.array([b"raw", "caf\u00e9".encode()]),
    }
    ck = CheckpointContents(frozen=strings, trainable={"w": torch.ones(2)})
    for mode in ("never", "params", "all"):
        roundtrip(tmp_path, ck, mode, name=f"{mode}.ckpt")
        with open_checkpoint(tmp_path / f"{mode}.ckpt") as reader:
            for name in strings:
                info = reader.frozen[name]
                assert info.dtype is DataType.STRING and info.storage == "strings"  # never external
                assert info.shape == strings[name].shape
            with pytest.raises(CheckpointError):
                reader.get_tensor("grid")  # strings have no torch form
    loaded = load_checkpoint(tmp_path / "never.ckpt")
    assert loaded.frozen["grid"][1, 1] == "\u65e5\u672c\u8a9e \U0001f600"
    assert loaded.frozen["bytes"].tolist() == ["raw", "caf\u00e9"]


# -- properties ---------------------------------------------------------------------------------------------------
def test_properties_of_all_types(tmp_path):
    props = {
        "int_min": -(2**63), "int_max": 2**63 - 1, "int": 42, "int_neg": -7, "int_zero": 0,
        "bool": True, "np_int": np.int32(-5),
        "f_tenth": 0.1, "f_pi": math.pi, "f_zero": 0.0, "f_neg_zero": -0.0, "f_big": 3.0e38, "f_tiny": 1e-45,
        "f_inf": float("inf"), "f_np": np.float64(2.5),
        "s_unicode": "v\u00e4lue \u65e5\u672c \U0001f600", "s_empty": "", "s_ascii": "hello-ODTC",
        "\u00e9_name": "unicode name", "": "empty name",
    }
    path = str(tmp_path / "p.ckpt")
    save_checkpoint(CheckpointContents(trainable={"w": torch.ones(1)}, properties=props), path)
    for got in (load_checkpoint(path).properties, open_checkpoint(path).properties):
        assert set(got) == set(props)
        assert got["int_min"] == -(2**63) and got["int_max"] == 2**63 - 1
        assert got["int"] == 42 and got["int_neg"] == -7 and got["bool"] == 1 and got["np_int"] == -5
        assert got["int_zero"] == 0 and type(got["int_zero"]) is int
        assert got["f_tenth"] == float(np.float32(0.1)) == 0.10000000149011612
        assert got["f_pi"] == float(np.float32(math.pi)) == 3.1415927410125732
        for k in ("f_zero", "f_neg_zero"):  # omitted on disk (the default): comes back as +0.0
            assert got[k] == 0.0 and math.copysign(1.0, got[k]) == 1.0
        assert got["f_big"] == float(np.float32(3.0e38))
        assert got["f_tiny"] == float(np.float32(1e-45)) and got["f_tiny"] > 0
        assert got["f_inf"] == math.inf and got["f_np"] == 2.5
        for k in ("int", "int_min", "int_max", "bool", "np_int"):
            assert type(got[k]) is int, k
        for k in ("f_tenth", "f_pi", "f_big", "f_np"):
            assert type(got[k]) is float, k
        assert got["s_unicode"] == "v\u00e4lue \u65e5\u672c \U0001f600" and got["s_empty"] == ""
        assert got["s_ascii"] == "hello-ODTC" and got["\u00e9_name"] == "unicode name" and got[""] == "empty name"
    # zero values are omitted on disk: an int 0 and a float 0.0 make a file no bigger than a property 1 / 1.0 would
    small = CheckpointContents(properties={"a": 0, "b": 0.0})
    nonzero = CheckpointContents(properties={"a": 1, "b": 1.0})
    save_checkpoint(small, tmp_path / "zero.ckpt")
    save_checkpoint(nonzero, tmp_path / "one.ckpt")
    assert os.path.getsize(tmp_path / "zero.ckpt") < os.path.getsize(tmp_path / "one.ckpt")
    assert load_checkpoint(tmp_path / "zero.ckpt").properties == {"a": 0, "b": 0.0}


def test_zero_float_property_stays_a_float(tmp_path):
    path = tmp_path / "zero.ckpt"
    save_checkpoint(CheckpointContents(properties={"i": 0, "f": 0.0}), path)
    got = load_checkpoint(path).properties
    assert type(got["i"]) is int
    assert type(got["f"]) is float
    assert type(open_checkpoint(path).properties["f"]) is float
    save_checkpoint(load_checkpoint(path), tmp_path / "again.ckpt")
    assert file_bytes(tmp_path / "again.ckpt") == file_bytes(path)


def test_properties_only_checkpoint(tmp_path):
    ck = CheckpointContents(properties={"only": "strings"})
    path = tmp_path / "p.ckpt"
    save_checkpoint(ck, path)
    loaded = load_checkpoint(path)
    assert loaded.properties == {"only": "strings"}
    assert not loaded.trainable and not loaded.frozen and not loaded.optimizer_groups


def test_empty_checkpoint(tmp_path):
    path = tmp_path / "empty.ckpt"
    save_checkpoint(CheckpointContents(), path)
    loaded = load_checkpoint(path)
    assert loaded == CheckpointContents()


# -- optimizer groups ---------------------------------------------------------------------------------------------
def test_optimizer_groups(tmp_path):
    params = {"fc1.weight": torch.randn(4, 3), "fc1.bias": torch.randn(4), "z\u00e9": torch.randn(()),
              "a": torch.randn(2, 2)}
    group0 = OptimizerGroup(step=123456789012, initial_learning_rate=0.001, states={
        n: {"momentum0": torch.randn_like(p), "momentum1": torch.rand_like(p)} for n, p in params.items()})
    other = OptimizerGroup(step=0, initial_learning_rate=0.0, states={
        "a": {"momentum0": torch.zeros(2, 2), "extra": torch.arange(3, dtype=torch.int64), "b": torch.ones(())}})
    empty = OptimizerGroup(step=-3, initial_learning_rate=-1.5)
    ck = CheckpointContents(trainable=params, frozen={"buf": torch.arange(5)},
                    optimizer_groups={"group0": group0, "groupX": other, "\u00e9mpty": empty})
    for mode in ("never", "params", "all"):
        loaded = roundtrip(tmp_path, ck, mode, name=f"{mode}.ckpt")
        g = loaded.optimizer_groups
        assert g["group0"].step == 123456789012 and g["group0"].initial_learning_rate == _f32(0.001)
        assert g["groupX"].step == 0 and g["groupX"].initial_learning_rate == 0.0
        assert g["\u00e9mpty"].step == -3 and g["\u00e9mpty"].initial_learning_rate == -1.5
        assert g["\u00e9mpty"].states == {}
        for n in params:
            for m in ("momentum0", "momentum1"):
                assert_same_tensor(g["group0"].states[n][m], group0.states[n][m], f"{n}/{m}")
        with open_checkpoint(tmp_path / f"{mode}.ckpt") as reader:
            assert list(reader.optimizer_groups) == sorted(ck.optimizer_groups, key=lambda s: s.encode())
            gi = reader.optimizer_groups["group0"]
            assert (gi.step, gi.initial_learning_rate) == (123456789012, _f32(0.001))
            assert list(gi.states) == sorted(params, key=lambda s: s.encode())
            assert list(gi.states["a"]) == ["momentum0", "momentum1"]


# -- nominal ------------------------------------------------------------------------------------------------------
def _nominal() -> CheckpointContents:
    return CheckpointContents(trainable={"w": torch.randn(3, 4), "b": torch.zeros(4, dtype=torch.float64)},
                      frozen={"idx": torch.arange(3), "flag": torch.ones(2, dtype=torch.bool)},
                      properties={"kind": "nominal"}, nominal=True)


def test_nominal_checkpoint_metadata(tmp_path):
    path = tmp_path / "nominal.ckpt"
    save_checkpoint(_nominal(), path)
    with open_checkpoint(path) as reader:
        assert reader.nominal
        assert list(reader.trainable) == ["b", "w"] and list(reader.frozen) == ["flag", "idx"]
        dtypes = {i.name: i.dtype for i in reader.tensors()}
        assert dtypes == {"w": DataType.FLOAT, "b": DataType.DOUBLE, "idx": DataType.INT64, "flag": DataType.BOOL}
        for info in reader.tensors():
            assert info.storage == "none" and info.shape == () and info.nbytes == 0
        with pytest.raises(CheckpointError, match="nominal"):
            reader.get_tensor("w")
        assert reader.properties == {"kind": "nominal"}
    # a nominal checkpoint holds no data: the size does not depend on the tensors' sizes
    big = _nominal()
    big.trainable["w"] = torch.randn(300, 400)
    save_checkpoint(big, tmp_path / "nominal_big.ckpt")
    assert file_bytes(tmp_path / "nominal_big.ckpt") == file_bytes(path)


@pytest.mark.usefixtures("io_path")
def test_nominal_checkpoint_load_and_resave(tmp_path):
    path = tmp_path / "nominal.ckpt"
    save_checkpoint(_nominal(), path)
    loaded = load_checkpoint(path)
    assert loaded.nominal and loaded.properties == {"kind": "nominal"}
    assert list(loaded.trainable) == ["b", "w"] and list(loaded.frozen) == ["flag", "idx"]
    dtypes = {n: t.dtype for n, t in {**loaded.trainable, **loaded.frozen}.items()}
    assert dtypes == {"w": torch.float32, "b": torch.float64, "idx": torch.int64, "flag": torch.bool}
    for t in (*loaded.trainable.values(), *loaded.frozen.values()):
        assert t.numel() == 0  # no data: placeholders of the right dtype
    save_checkpoint(loaded, tmp_path / "again.ckpt")
    assert file_bytes(tmp_path / "again.ckpt") == file_bytes(path)


# -- external data ------------------------------------------------------------------------------------------------
def _external_ck() -> CheckpointContents:
    return CheckpointContents(
        trainable={"w": random_tensor((3, 5), torch.float32, 1), "odd": random_tensor((5,), torch.uint8, 2),
                   "d": random_tensor((3,), torch.float64, 3)},
        frozen={"i64": random_tensor((2, 3), torch.int64, 4), "u64": random_tensor((1,), torch.uint64, 5),
                "s": torch.tensor(1.0)},
        optimizer_groups={"group0": OptimizerGroup(4, 0.01, {
            "w": {"momentum0": random_tensor((3, 5), torch.float32, 6),
                  "momentum1": random_tensor((3, 5), torch.float32, 7)},
            "odd": {"momentum0": random_tensor((5,), torch.uint8, 8)},
            "d": {"momentum0": random_tensor((3,), torch.float64, 9)}})},
        properties={"epoch": 3, "loss": 0.25, "tag": "ext"})


@pytest.mark.usefixtures("io_path")
@pytest.mark.parametrize("mode", ["never", "auto", "params", "all"])
def test_external_data_modes(tmp_path, mode):
    ck = _external_ck()
    path = str(tmp_path / "ck.ckpt")
    roundtrip(tmp_path, ck, mode)
    external = mode in ("params", "all")
    assert os.path.exists(path + ".data") == external
    assert load_checkpoint(path).properties == {"epoch": 3, "loss": 0.25, "tag": "ext"}
    with open_checkpoint(path) as reader:
        assert reader.has_external_data == external
        assert reader.data_path == path + ".data"
        for info in reader.tensors():
            is_ext = external and (info.kind != "momentum" or mode == "all")
            assert info.storage == ("external" if is_ext else "inline"), info
            if is_ext:  # the .data file holds the raw little-endian bytes at the recorded, aligned offset
                assert info.offset % (8 if info.dtype in (DataType.INT64, DataType.DOUBLE) else 4) == 0
                blob = file_bytes(path + ".data")[info.offset:info.offset + info.nbytes]
                src = ck.trainable.get(info.name) if info.kind == "trainable" else ck.frozen.get(info.name)
                if info.kind != "momentum":
                    assert blob == raw_bytes(src)
    if external:
        # blobs are packed in sorted-name order with only alignment padding: trainable d, odd, w; frozen i64, s, u64
        with open_checkpoint(path) as reader:
            offsets = [(reader.trainable[n].offset, n) for n in ("d", "odd", "w")]
            offsets += [(reader.frozen[n].offset, n) for n in ("i64", "s", "u64")]
        assert [n for _, n in sorted(offsets)] == ["d", "odd", "w", "i64", "s", "u64"]
        assert [o for o, _ in offsets] == [0, 24, 32, 96, 144, 148]


@pytest.mark.usefixtures("io_path")
def test_external_data_missing_is_reported(tmp_path):
    path = str(tmp_path / "ck.ckpt")
    save_checkpoint(_external_ck(), path, external_data="params")
    os.rename(path + ".data", path + ".moved")
    with pytest.raises(CheckpointError, match="external data"):
        load_checkpoint(path)


# -- lazy, zero-copy access ---------------------------------------------------------------------------------------
@pytest.mark.usefixtures("io_path")
def test_lazy_access_zero_copy_and_unaligned_int64(tmp_path):
    # several int64/double tensors of different lengths: flatbuffers only 4-aligns raw data, so some land at 4 mod 8
    tensors = {f"i{n}": torch.arange(n, dtype=torch.int64) * -(2**40) + n for n in range(1, 7)}
    tensors.update({f"d{n}": torch.linspace(-1, 1, n, dtype=torch.float64) for n in range(1, 7)})
    tensors["f"] = torch.randn(4, 4)
    tensors["u8"] = torch.arange(3, dtype=torch.uint8)
    path = str(tmp_path / "lazy.ckpt")
    save_checkpoint(CheckpointContents(trainable=tensors), path)
    misaligned = 0
    with open_checkpoint(path) as reader:
        for name, expected in tensors.items():
            info = reader.trainable[name]
            t = reader.get_tensor(name)
            assert_same_tensor(t, expected, name)
            assert t.data_ptr() % t.element_size() == 0
            np.testing.assert_array_equal(reader.numpy(info), expected.numpy())
            again = reader.get_tensor(name)
            if info.offset % expected.element_size():
                misaligned += 1
                assert t.data_ptr() != again.data_ptr(), f"{name}: unaligned data must be copied"
            else:
                assert t.data_ptr() == again.data_ptr(), f"{name}: aligned data should be mapped, not copied"
        f = reader.get_tensor("f")
        f += 1  # the mapping is copy-on-write: writes never reach the file
        assert torch.equal(reader.get_tensor("f"), tensors["f"] + 1)
    assert misaligned > 0, "no int64/double tensor ended up 4-aligned only: the test lost its point"
    assert_same_tensor(load_checkpoint(path).trainable["f"], tensors["f"], "f")
    with open_checkpoint(path) as reader:
        assert_same_tensor(reader.get_tensor("f"), tensors["f"], "f")


_USE_AFTER_CLOSE = """
import sys, numpy as np, torch
from lightning_ort_ckpt.format import CheckpointContents, save_checkpoint, open_checkpoint
path = sys.argv[1]
save_checkpoint(CheckpointContents(trainable={"w": torch.arange(4096.0)}), path, external_data=sys.argv[2])
with open_checkpoint(path) as reader:
    w = reader.get_tensor("w")
assert float(w.sum()) == 4096 * 4095 / 2
print("ok")
"""


@pytest.mark.usefixtures("io_path")
@pytest.mark.parametrize("mode", ["never", "params"])
def test_numpy_arrays_stay_valid_after_close(tmp_path, mode):
    path = str(tmp_path / "ck.ckpt")
    save_checkpoint(CheckpointContents(trainable={"w": torch.arange(4096.0)}), path, external_data=mode)
    with open_checkpoint(path) as reader:
        a = reader.numpy(reader.trainable["w"])
    assert float(a.sum()) == 4096 * 4095 / 2


@pytest.mark.usefixtures("io_path")
@pytest.mark.parametrize("mode", ["never", "params"])
def test_torch_tensors_stay_valid_after_close(tmp_path, mode):
    # in a subprocess: the failure mode is a segfault, which would take the whole test run down
    proc = subprocess.run([sys.executable, "-c", _USE_AFTER_CLOSE, str(tmp_path / "ck.ckpt"), mode],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr[-2000:])


@pytest.mark.usefixtures("io_path")
def test_lazy_access_external(tmp_path):
    ck = _external_ck()
    path = str(tmp_path / "ck.ckpt")
    save_checkpoint(ck, path, external_data="all")
    with open_checkpoint(path) as reader:
        for name, expected in {**ck.trainable, **ck.frozen}.items():
            t = reader.get_tensor(name)
            assert_same_tensor(t, expected, name)
            info = reader.trainable.get(name) or reader.frozen[name]
            assert info.storage == "external"
            if info.offset % t.element_size() == 0:  # mapped from .data, no copy (uint64 is only 4-aligned there)
                assert reader.get_tensor(name).data_ptr() == t.data_ptr()
        m = reader.torch(reader.optimizer_groups["group0"].states["d"]["momentum0"])
        assert_same_tensor(m, ck.optimizer_groups["group0"].states["d"]["momentum0"], "momentum")


# -- replacing a checkpoint ---------------------------------------------------------------------------------------
def _listing(tmp_path) -> list[str]:
    wait_for_cleanup()
    return sorted(os.listdir(tmp_path))


@pytest.mark.usefixtures("io_path")
def test_save_replaces_existing_checkpoint(tmp_path):
    path = str(tmp_path / "ck.ckpt")
    first = CheckpointContents(trainable={"w": torch.zeros(1000)}, properties={"v": 1})
    second = CheckpointContents(trainable={"w": torch.ones(3), "x": torch.arange(2)}, properties={"v": 2})
    save_checkpoint(first, path)
    reader = open_checkpoint(path)
    old = reader.get_tensor("w")
    save_checkpoint(second, path)
    roundtrip(tmp_path, second)
    assert load_checkpoint(path).properties == {"v": 2}
    assert torch.equal(old, torch.zeros(1000))  # a reader of the old file keeps seeing the old bytes
    reader.close()
    assert _listing(tmp_path) == ["ck.ckpt"]


@pytest.mark.usefixtures("io_path")
def test_switching_between_external_and_inline(tmp_path):
    path = str(tmp_path / "ck.ckpt")
    ck = _external_ck()
    save_checkpoint(ck, path, external_data="params")
    assert _listing(tmp_path) == ["ck.ckpt", "ck.ckpt.data"]
    save_checkpoint(ck, path, external_data="never")
    assert _listing(tmp_path) == ["ck.ckpt"]  # the stale .data is removed
    assert not open_checkpoint(path).has_external_data
    assert_checkpoints_equal(load_checkpoint(path), ck)
    save_checkpoint(ck, path, external_data="all")
    assert _listing(tmp_path) == ["ck.ckpt", "ck.ckpt.data"]
    assert_checkpoints_equal(load_checkpoint(path), ck)
    # external -> external with different contents replaces both files
    ck2 = _external_ck()
    ck2.trainable["w"] = ck2.trainable["w"] * 2
    save_checkpoint(ck2, path, external_data="params")
    assert _listing(tmp_path) == ["ck.ckpt", "ck.ckpt.data"]
    assert_checkpoints_equal(load_checkpoint(path), ck2)


def test_save_is_deterministic_and_independent_of_insertion_order(tmp_path):
    ck = _external_ck()
    shuffled = CheckpointContents(trainable=dict(reversed(list(ck.trainable.items()))),
                          frozen=dict(reversed(list(ck.frozen.items()))),
                          optimizer_groups=ck.optimizer_groups, properties=dict(reversed(list(ck.properties.items()))))
    save_checkpoint(ck, tmp_path / "a.ckpt")
    save_checkpoint(shuffled, tmp_path / "b.ckpt")
    assert file_bytes(tmp_path / "a.ckpt") == file_bytes(tmp_path / "b.ckpt")
    # and a loaded checkpoint re-saves to the same bytes, in every mode
    for mode in ("never", "params", "all"):
        p = str(tmp_path / f"{mode}.ckpt")
        save_checkpoint(ck, p, external_data=mode)
        save_checkpoint(load_checkpoint(p), p + "2", external_data=mode)
        assert file_bytes(p) == file_bytes(p + "2")
        if mode != "never":
            assert file_bytes(p + ".data") == file_bytes(p + "2.data")


def test_auto_external_data_past_two_gib_plans_without_allocating():
    """Planning works on sizes only: a 3.6 GB AdamW-like state (broadcast arrays, no memory behind them) needs its
    parameters and then its momentums in the .data file; "never" refuses, "auto" picks that layout."""
    from lightning_ort_ckpt.format import _writer as writer

    big = np.broadcast_to(np.zeros(1, np.float32), (300_000_000,))  # 1.2 GB each, nothing allocated
    ck = CheckpointContents(trainable={"w": big},
                    optimizer_groups={"group0": OptimizerGroup(1, 1e-3, {"w": {"momentum0": big, "momentum1": big}})})
    with pytest.raises(CheckpointSaveError, match="2 GiB FlatBuffers limit"):
        writer._plan_for_mode(ck, writer._Tensors("x.ckpt"), "never", "x.ckpt")
    with pytest.raises(CheckpointSaveError, match="2 GiB FlatBuffers limit"):
        writer._plan_for_mode(ck, writer._Tensors("x.ckpt"), "params", "x.ckpt")
    plan = writer._plan_for_mode(ck, writer._Tensors("x.ckpt"), "auto", "x.ckpt")
    assert plan.size < 4096 and plan.data_size == 3 * 1_200_000_000
