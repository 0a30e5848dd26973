"""Bad input must give a CorruptCheckpointError that names the file and the fault: never a stray IndexError,
struct.error, UnicodeDecodeError, MemoryError, numpy/torch error, never a hang, never a huge allocation.

Every case here runs the real reader (``lightning_ort_ckpt.format._reader``) on real bytes; nothing is mocked.
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
import signal
import struct
import tracemalloc
import traceback
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.ort_reference import assert_same_checkpoint

from lightning_ort_ckpt import CheckpointError, CorruptCheckpointError
from lightning_ort_ckpt.format import (CheckpointContents, OptimizerGroup, load_checkpoint, open_checkpoint, save_checkpoint)
from lightning_ort_ckpt.format import _reader as reader_mod

CASE_SECONDS = 60  # no single case may take this long: a hang fails the test instead of stalling it (generous:
# a case takes milliseconds, and seconds on a loaded machine)


# -- a small checkpoint that uses every part of the format ------------------------------------------------------
def make_checkpoint() -> CheckpointContents:
    g = torch.Generator().manual_seed(1234)
    trainable = {
        "layer.weight": torch.randn(3, 4, generator=g),
        "layer.bias": torch.randn(4, generator=g),
        "scale": torch.tensor(1.5),  # 0-d
    }
    frozen = {
        "table": torch.randn(5, 7, generator=g),  # the only tensor with dims (5, 7): patched below
        "offsets": torch.arange(6, dtype=torch.int64).reshape(2, 3) * 1_000_000_007,
        "count": torch.tensor(-42, dtype=torch.int64),  # 0-d int64
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),  # zero elements: its dims are not tied to its data length
        "half": torch.randn(2, 2, generator=g).to(torch.float16),
    }
    states = {name: {"momentum0": torch.randn(t.shape, generator=g), "momentum1": torch.rand(t.shape, generator=g)}
              for name, t in trainable.items()}
    return CheckpointContents(
        trainable=trainable, frozen=frozen,
        optimizer_groups={"group0": OptimizerGroup(step=17, initial_learning_rate=1e-3, states=states)},
        properties={"epoch": 3, "global_step": -(2**40), "best_loss": 0.25, "run_name": "flip \u00e9t\u00e9",
                    "empty": ""})


def read_everything(path: Path) -> CheckpointContents:
    """Load the checkpoint both ways, touching every byte of every tensor."""
    ck = load_checkpoint(path)
    with reader_mod.CheckpointReader(path) as r:
        for info in r.tensors():
            a = r.numpy(info)
            if info.storage != "strings":
                t = r.torch(info)
                assert tuple(t.shape) == tuple(a.shape) == info.shape
                bytes(t.reshape(-1).view(torch.uint8).numpy())
            np.asarray(a).tobytes()
        for name in [*r.trainable, *r.frozen]:
            r.get_tensor(name)
        del a, t
    return ck




@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """The reference checkpoint, saved inline and with external data, plus its expected content."""
    assert load_checkpoint is reader_mod.load_checkpoint and open_checkpoint is reader_mod.open_checkpoint
    d = tmp_path_factory.mktemp("ref")
    ck = make_checkpoint()
    inline, external = d / "inline.ckpt", d / "external.ckpt"
    save_checkpoint(ck, inline, external_data="never")
    save_checkpoint(ck, external, external_data="params")
    expected = read_everything(inline)
    assert_same_checkpoint(expected, read_everything(external))
    assert expected.properties["run_name"] == "flip \u00e9t\u00e9"
    return {"ck": expected, "inline": inline.read_bytes(), "external": external.read_bytes(),
            "external_data": Path(str(external) + ".data").read_bytes()}


# -- helpers ----------------------------------------------------------------------------------------------------
class CaseTimeout(Exception):
    pass


@contextlib.contextmanager
def time_bound(seconds: float):
    """Fail (instead of hanging) when the body runs longer than ``seconds``."""
    def on_alarm(signum, frame):
        raise CaseTimeout(f"a single case ran longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def put(path: Path, data: bytes) -> None:
    """Give ``path`` new content on a new inode, so mappings of an earlier case never see it change."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def outcome(path: Path) -> str:
    """'ok' or 'corrupt'; anything else propagates with the case in the message."""
    try:
        read_everything(path)
        return "ok"
    except CorruptCheckpointError as e:
        assert str(e).startswith(f"{path}: "), str(e)
        assert e.path == str(path)
        return "corrupt"


def expect_corrupt(path: Path, *words: str, loaders=("load", "open")) -> CorruptCheckpointError:
    """Both entry points fail with a CorruptCheckpointError naming ``path`` and containing every word."""
    err = None
    for how in loaders:
        with time_bound(CASE_SECONDS), pytest.raises(CorruptCheckpointError) as info:
            if how == "load":
                load_checkpoint(path)
            else:
                read_everything(path)
        err = info.value
        msg = str(err)
        assert isinstance(err, CheckpointError) and isinstance(err, ValueError)
        assert msg.startswith(f"{path}: "), msg
        for w in words:
            assert w.lower() in msg.lower(), f"{w!r} not in {msg!r}"
    return err


# A tiny flatbuffers walker for locating fields to patch (independent of the reader under test).
def _u32(b: bytes, pos: int) -> int:
    return struct.unpack_from("<I", b, pos)[0]


def _field(b: bytes, table: int, slot: int) -> int | None:
    vt = table - struct.unpack_from("<i", b, table)[0]
    vt_size = struct.unpack_from("<H", b, vt)[0]
    if 4 + 2 * slot >= vt_size:
        return None
    voff = struct.unpack_from("<H", b, vt + 4 + 2 * slot)[0]
    return table + voff if voff else None


def _deref(b: bytes, pos: int) -> int:
    return pos + _u32(b, pos)


def _vtable_entry(b: bytes, table: int, slot: int) -> int:
    return table - struct.unpack_from("<i", b, table)[0] + 4 + 2 * slot


def _tensor_table(b: bytes, name: str) -> int:
    root = _u32(b, 0)
    ms = _deref(b, _field(b, root, 1))
    for slot in (0, 1):
        vec = _deref(b, _field(b, ms, slot))
        for i in range(_u32(b, vec)):
            t = _deref(b, vec + 4 + 4 * i)
            s = _deref(b, _field(b, t, 0))
            if b[s + 4:s + 4 + _u32(b, s)].decode() == name:
                return t
    raise KeyError(name)


def _patch(b: bytes, pos: int, fmt: str, value) -> bytes:
    out = bytearray(b)
    struct.pack_into(fmt, out, pos, value)
    return bytes(out)


def _replace_once(b: bytes, old: bytes, new: bytes) -> bytes:
    assert b.count(old) == 1, f"{old!r} occurs {b.count(old)} times"
    return b.replace(old, new)


# -- truncation -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["inline", "external"])
def test_truncated_at_every_length(tmp_path, saved, variant):
    path = tmp_path / "t.ckpt"
    if variant == "external":
        Path(str(path) + ".data").write_bytes(saved["external_data"])
    data = saved[variant]
    put(path, data)
    assert_same_checkpoint(read_everything(path), saved["ck"])
    loaded_short: list[int] = []
    with time_bound(60):
        for n in range(len(data)):
            put(path, data[:n])
            try:
                got = outcome(path)
            except Exception:
                pytest.fail(f"truncated to {n} of {len(data)} bytes: {traceback.format_exc()}")
            if got == "ok":
                # Only the trailing alignment padding (after the last string's NUL) may go: the rest is still a
                # valid FlatBuffer, as flatbuffers' own Verifier agrees, and it must load to the same content.
                assert data[n:] == bytes(len(data) - n) and len(data) - n < 4 and data[n - 1] == 0, \
                    f"truncated to {n} of {len(data)} bytes still loaded"
                assert_same_checkpoint(read_everything(path), saved["ck"])
                loaded_short.append(n)
    assert len(loaded_short) < 4


def test_truncated_external_data_at_many_lengths(tmp_path, saved):
    path = tmp_path / "t.ckpt"
    put(path, saved["external"])
    data = saved["external_data"]
    dpath = Path(str(path) + ".data")
    for n in sorted({0, 1, 3, 4, 8, len(data) // 2, len(data) - 4, len(data) - 1}):
        put(dpath, data[:n])
        try:
            got = outcome(path)
        except Exception:
            pytest.fail(f".data truncated to {n} of {len(data)} bytes: {traceback.format_exc()}")
        assert got == "corrupt", f".data truncated to {n} bytes still loaded"


# -- random damage ----------------------------------------------------------------------------------------------
_WORDS = (0, 1, 0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFC, 4, 8, 0x10000)


def _mutate(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    out = bytearray(data)
    kind = rng.randrange(5)
    if kind == 0:  # one bit
        pos, bit = rng.randrange(len(out)), rng.randrange(8)
        out[pos] ^= 1 << bit
        desc = f"bit {bit} of byte {pos}"
    elif kind == 1:  # one byte, any new value
        pos = rng.randrange(len(out))
        out[pos] = (out[pos] + rng.randrange(1, 256)) % 256
        desc = f"byte {pos} -> {out[pos]}"
    elif kind == 2:  # several bytes
        positions = [rng.randrange(len(out)) for _ in range(rng.randrange(2, 9))]
        for pos in positions:
            out[pos] = rng.randrange(256)
        desc = f"bytes {positions}"
    elif kind == 3:  # an aligned 32-bit word (offsets, lengths, vtable entries) set to an interesting value
        pos = rng.randrange(len(out) // 4) * 4
        value = rng.choice(_WORDS + (len(out), len(out) - pos, rng.randrange(2**32)))
        struct.pack_into("<I", out, pos, value)
        desc = f"u32 at {pos} -> {value:#x}"
    else:  # a 16-bit field (vtable entries) at an even position
        pos = rng.randrange(len(out) // 2) * 2
        value = rng.choice((0, 2, 4, 0xFFFF, 0x8000, rng.randrange(2**16)))
        struct.pack_into("<H", out, pos, value)
        desc = f"u16 at {pos} -> {value:#x}"
    return bytes(out), desc


@pytest.mark.parametrize("variant,cases,seed", [("inline", 3000, 20241121), ("external", 1200, 77)])
def test_random_byte_damage(tmp_path, saved, variant, cases, seed):
    path = tmp_path / "r.ckpt"
    if variant == "external":
        Path(str(path) + ".data").write_bytes(saved["external_data"])
    data = saved[variant]
    rng = random.Random(seed)
    counts = {"ok": 0, "corrupt": 0, "unverifiable": 0}
    for i in range(cases):
        damaged, desc = _mutate(rng, data)
        put(path, damaged)
        try:
            with time_bound(CASE_SECONDS):
                result = outcome(path)
                if result == "ok":  # checksums: damage never changes a tensor silently
                    with open_checkpoint(path) as reader:
                        usable = reader.checksums is not None and reader.checksums.usable
                    # Unless the damage made the file look like one that ORT re-saved (the property bag and the
                    # record gone, or the optimizer groups emptied as by include_optimizer_state=False): then the
                    # tensors that are there are still the saved ones.
                    counts["unverifiable"] += not usable
                    assert_same_tensors(load_checkpoint(path), saved["ck"], all_there=usable)
                counts[result] += 1
        except Exception:
            pytest.fail(f"case {i} ({desc}) raised something other than CorruptCheckpointError:\n"
                        f"{traceback.format_exc()}")
    # Both outcomes happen: damage to the structure or to tensor data is caught; damage to padding, or to a value
    # outside every tensor (a property, a step), loads, with every tensor as saved.
    assert counts["ok"] > cases // 50 and counts["corrupt"] > cases // 2, counts
    assert counts["unverifiable"] < cases // 40, counts  # (a hang fails its case: CASE_SECONDS; no timed total)


def assert_same_tensors(actual: CheckpointContents, expected: CheckpointContents, all_there: bool = True) -> None:
    """Every parameter, buffer and momentum (``all_there``; else every one ``actual`` has): same name, dtype, shape
    and bytes."""
    def tensors(ck: CheckpointContents) -> dict[str, torch.Tensor]:
        out = {f"param:{n}": t for n, t in {**ck.trainable, **ck.frozen}.items()}
        out.update({f"state:{g}/{p}/{m}": t for g, grp in ck.optimizer_groups.items()
                    for p, ms in grp.states.items() for m, t in ms.items()})
        return out

    got, want = tensors(actual), tensors(expected)
    assert got.keys() == want.keys() if all_there else got.keys() <= want.keys()
    for key, t in want.items():
        if key not in got:
            continue
        assert got[key].dtype == t.dtype and got[key].shape == t.shape, key
        assert got[key].reshape(-1).view(torch.uint8).numpy().tobytes() == \
            t.reshape(-1).view(torch.uint8).numpy().tobytes(), key


# -- specific faults --------------------------------------------------------------------------------------------
def test_wrong_identifier(tmp_path, saved):
    path = tmp_path / "id.ckpt"
    put(path, saved["inline"][:4] + b"ODTX" + saved["inline"][8:])
    expect_corrupt(path, "identifier", "ODTX")


@pytest.mark.parametrize("version", [0, 1, 3, 99, -2])
def test_unsupported_version(tmp_path, saved, version):
    b = saved["inline"]
    root = _u32(b, 0)
    pos = _field(b, root, 0)
    assert struct.unpack_from("<i", b, pos)[0] == 2
    path = tmp_path / "v.ckpt"
    put(path, _patch(b, pos, "<i", version))
    expect_corrupt(path, "version", f"version {version} is not supported")


def test_absent_version(tmp_path, saved):
    b = saved["inline"]
    root = _u32(b, 0)
    path = tmp_path / "v0.ckpt"
    put(path, _patch(b, _vtable_entry(b, root, 0), "<H", 0))  # the field is gone: version reads as 0
    expect_corrupt(path, "version 0 is not supported")


@pytest.mark.parametrize("variant", ["inline", "external"])
def test_dims_claiming_2_to_40_elements(tmp_path, saved, variant):
    path = tmp_path / "huge.ckpt"
    if variant == "external":
        Path(str(path) + ".data").write_bytes(saved["external_data"])
    put(path, _replace_once(saved[variant], struct.pack("<2q", 5, 7), struct.pack("<2q", 2**20, 2**20)))
    word = "need"  # "... need 4,398,046,511,104 bytes, but its data holds 140" / "needs bytes ... which has only"
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    try:
        err = expect_corrupt(path, "'table'", word)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "4,398,046,511," in str(err), str(err)  # 4 x 2**40 bytes (inline: the size; external: the end)
    assert peak < 4 << 20, f"reading a lying header allocated {peak:,} bytes"
    grew_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - maxrss
    assert grew_kb < 64 << 10, f"peak RSS grew by {grew_kb:,} KiB"


@pytest.mark.parametrize("variant", ["inline", "external"])
def test_negative_dim(tmp_path, saved, variant):
    path = tmp_path / "neg.ckpt"
    if variant == "external":
        Path(str(path) + ".data").write_bytes(saved["external_data"])
    put(path, _replace_once(saved[variant], struct.pack("<2q", 5, 7), struct.pack("<2q", 5, -7)))
    expect_corrupt(path, "'table'", "negative")


@pytest.mark.parametrize("dims", [(0, 2**62), (2**62, 0), (0, 2**63 - 1), (2**61, 0)])
def test_zero_element_tensor_with_unrepresentable_shape(tmp_path, saved, dims):
    """A zero-element tensor needs no bytes whatever its other dims are, but numpy and torch cannot make it."""
    b = saved["inline"]
    t = _tensor_table(b, "empty")
    dims_vec = _deref(b, _field(b, t, 2))
    assert struct.unpack_from("<I2q", b, dims_vec) == (2, 0, 3)
    path = tmp_path / "zero.ckpt"
    put(path, bytes(b[:dims_vec + 4]) + struct.pack("<2q", *dims) + bytes(b[dims_vec + 20:]))
    expect_corrupt(path, "'empty'", "too large")


@pytest.mark.parametrize("dims", [(0, 2**40), (2**20, 0), (0, 0)])
def test_zero_element_tensor_with_large_but_valid_shape(tmp_path, saved, dims):
    """The reader accepts any representable zero-element shape (in a file without checksums, as ORT writes it);
    with checksums, a shape that differs from the one saved is damage."""
    path = tmp_path / "zero_ok.ckpt"
    for checksums in (False, True):
        save_checkpoint(saved["ck"], path, external_data="never", checksums=checksums)
        b = path.read_bytes()
        dims_vec = _deref(b, _field(b, _tensor_table(b, "empty"), 2))
        put(path, bytes(b[:dims_vec + 4]) + struct.pack("<2q", *dims) + bytes(b[dims_vec + 20:]))
        if checksums:
            expect_corrupt(path, "'empty'", "shape")
        else:
            assert tuple(read_everything(path).frozen["empty"].shape) == dims


def test_more_dimensions_than_numpy_allows(tmp_path):
    path = tmp_path / "deep.ckpt"
    save_checkpoint(CheckpointContents(trainable={"deep": torch.zeros((1,) * 65)}), path)  # ORT's format has no dim limit
    expect_corrupt(path, "'deep'", "65 dimensions")
    save_checkpoint(CheckpointContents(trainable={"deep": torch.zeros((1,) * 64)}), path)
    assert read_everything(path).trainable["deep"].ndim == 64


@pytest.mark.parametrize("code", [0, 21, 99, -1, 2**31 - 1])
def test_unknown_data_type(tmp_path, saved, code):
    b = saved["inline"]
    t = _tensor_table(b, "table")
    pos = _field(b, t, 3)
    assert struct.unpack_from("<i", b, pos)[0] == 1  # FLOAT
    path = tmp_path / "dt.ckpt"
    put(path, _patch(b, pos, "<i", code))
    expect_corrupt(path, "'table'", f"unknown data type {code}")


def test_data_type_changed_to_a_wider_type(tmp_path, saved):
    b = saved["inline"]
    t = _tensor_table(b, "table")
    path = tmp_path / "dt2.ckpt"
    put(path, _patch(b, _field(b, t, 3), "<i", 11))  # DOUBLE: 35 elements need 280 bytes, 140 are there
    expect_corrupt(path, "'table'", "DOUBLE", "280")


def test_missing_data_file(tmp_path, saved):
    path = tmp_path / "ext.ckpt"
    put(path, saved["external"])
    err = expect_corrupt(path, "missing", f"{path}.data")
    assert err.path == str(path)


def test_short_data_file(tmp_path, saved):
    path = tmp_path / "ext.ckpt"
    put(path, saved["external"])
    data = saved["external_data"]
    Path(str(path) + ".data").write_bytes(data[:-5])
    expect_corrupt(path, "has only", f"{len(data) - 5:,}", f"{path}.data")


def test_data_file_is_a_directory(tmp_path, saved):
    path = tmp_path / "ext.ckpt"
    put(path, saved["external"])
    os.mkdir(str(path) + ".data")
    os.mkdir(str(path) + ".data/sub")  # a directory's st_size is not a file length
    expect_corrupt(path, ".data")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.ckpt"
    path.write_bytes(b"")
    expect_corrupt(path, "0 bytes")


def test_seven_byte_file(tmp_path):
    path = tmp_path / "seven.ckpt"
    path.write_bytes(b"\x08\0\0\0ODT")
    expect_corrupt(path, "7 bytes")


def test_directory(tmp_path):
    path = tmp_path / "adir.ckpt"
    path.mkdir()
    expect_corrupt(path, "directory")


def test_nonexistent_path(tmp_path):
    path = tmp_path / "nope" / "missing.ckpt"
    expect_corrupt(path, "no such")


def test_fifo_does_not_hang(tmp_path):
    path = tmp_path / "pipe.ckpt"
    os.mkfifo(path)
    expect_corrupt(path, "regular file")


def test_zip_file(tmp_path):
    path = tmp_path / "model.ckpt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x04K\x01." * 100)
    expect_corrupt(path, "identifier")


def test_text_file(tmp_path):
    path = tmp_path / "notes.ckpt"
    path.write_text("epoch,loss\n1,0.5\n2,0.25\n" * 20)
    expect_corrupt(path, "identifier")


def test_random_bytes_with_the_right_identifier(tmp_path):
    rng = random.Random(5)
    path = tmp_path / "noise.ckpt"
    for size in (8, 9, 16, 64, 1000, 5000):
        for _ in range(40):
            body = bytearray(rng.randbytes(size))
            body[4:8] = b"ODTC"
            if rng.random() < 0.5:  # a plausible root offset
                struct.pack_into("<I", body, 0, rng.randrange(0, size, 4))
            put(path, bytes(body))
            with time_bound(CASE_SECONDS):
                try:
                    got = outcome(path)
                except Exception:
                    pytest.fail(f"{size} random bytes: {traceback.format_exc()}")
            assert got == "corrupt"


def test_invalid_utf8_name(tmp_path, saved):
    b = saved["inline"]
    i = b.index(b"layer.weight")
    path = tmp_path / "utf.ckpt"
    put(path, b[:i] + b"\xff" + b[i + 1:])
    expect_corrupt(path, "UTF-8")


def test_reference_checkpoint_still_reads(tmp_path, saved):
    """Sanity: the undamaged bytes, written through the same helpers, load to the original content."""
    path = tmp_path / "good.ckpt"
    put(path, saved["inline"])
    assert_same_checkpoint(read_everything(path), saved["ck"])
