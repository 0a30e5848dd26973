"""Issue 25's escapes on the input side, each through the entry point a user reaches it by: a torch file cut short,
damaged random states at fit(ckpt_path=...), a ``.data`` that leads out of the checkpoint's directory, the format
layer without torch, verification that streams instead of loading, and a placeholder hyperparameter that is called.
Real Trainers, real files, fresh processes where the process itself is what is measured."""

from __future__ import annotations

import copy
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

import lightning_ort_ckpt
from lightning_ort_ckpt import CheckpointError, CorruptCheckpointError, OrtCheckpoint, OrtCheckpointIO
from lightning_ort_ckpt._fit_state import _rng as rng
from lightning_ort_ckpt.errors import CheckpointWarning
from lightning_ort_ckpt.format import CheckpointContents, load_checkpoint, open_checkpoint, save_checkpoint
from lightning_ort_ckpt.format import _atomic as atomic
from lightning_ort_ckpt._translation import MANIFEST
from helpers.fits import Net, fit, name
from helpers.cli import no_torch_env, run_cli

ROOT = Path(__file__).resolve().parents[2]
RNG_KEY = "lightning_ort_ckpt.rng_states"


def run_python(code: str, env: dict[str, str] | None = None, *args: Any) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=300)


# -- 1. a torch file cut short ------------------------------------------------------------------------------------
def test_a_truncated_torch_checkpoint_is_our_error_at_the_plugin_and_at_fit(tmp_path):
    """torch's zip reader seeks before the start of a file cut inside its data (OSError EINVAL, no file name): that is
    the content, and it is our error naming the file, at every cut."""
    g = torch.Generator().manual_seed(0)
    whole = tmp_path / "whole.pt"
    torch.save({"state_dict": {"w": torch.randn(300, 300, generator=g)}, "epoch": 1}, whole)
    data = whole.read_bytes()
    path = tmp_path / "cut.ckpt"
    einval = 0
    for cut in range(1000, len(data), len(data) // 25):
        path.write_bytes(data[:cut])
        try:
            with fsspec.open(path, "rb") as f:  # as Lightning's loader opens it
                torch.load(f, weights_only=True)
        except OSError:  # what escaped before
            einval += 1
        except Exception:  # noqa: BLE001 - torch's own errors for other cuts
            pass
        with pytest.raises(CorruptCheckpointError, match="neither an ORT checkpoint nor a torch checkpoint") as err:
            OrtCheckpointIO().load_checkpoint(path)
        assert str(path) in str(err.value)
    assert einval > 0, einval  # some of these cuts do reach the bare OSError in torch
    path.write_bytes(data[:10_000])
    with pytest.raises(CorruptCheckpointError, match=str(path)):
        fit(OrtCheckpoint(dirpath=tmp_path / "out"), 2, ckpt_path=str(path))
    with pytest.raises(OSError):  # load_from_checkpoint of a torch file is Lightning's own loader, unchanged
        Net.load_from_checkpoint(path)


# -- 3. damaged random states ---------------------------------------------------------------------------------------
def _numpy_key(ck: CheckpointContents, rng_doc: dict[str, Any]) -> str:
    return rng_doc["numpy"]["__tuple__"][1]["__ndarray__"]


DAMAGE = {  # each edits the manifest's random states and the tensors they name
    "numpy_key_short": lambda ck, r: ck.frozen.__setitem__(_numpy_key(ck, r), np.zeros(10, np.uint32)),
    "numpy_key_empty": lambda ck, r: ck.frozen.__setitem__(_numpy_key(ck, r), np.zeros(0, np.uint32)),
    "numpy_key_float": lambda ck, r: ck.frozen.__setitem__(_numpy_key(ck, r), np.zeros(624, np.float32)),
    "numpy_tuple_short": lambda ck, r: r["numpy"].update(__tuple__=r["numpy"]["__tuple__"][:2]),
    "numpy_position_past_key": lambda ck, r: r["numpy"]["__tuple__"].__setitem__(2, 10**6),
    "numpy_position_negative": lambda ck, r: r["numpy"]["__tuple__"].__setitem__(2, -5),
    "python_position": lambda ck, r: ck.frozen.__setitem__(
        r["python"]["__tuple__"][1]["__tensor__"], torch.full((625,), 7, dtype=torch.int64).index_fill_(
            0, torch.tensor([624]), 10**6)),
    "python_not_a_triple": lambda ck, r: r.update(python={"__tuple__": [3]}),
    "torch_state_int64": lambda ck, r: ck.frozen.__setitem__(r["torch"]["__tensor__"],
                                                             torch.zeros(5056, dtype=torch.int64)),
    "cuda_not_a_list": lambda ck, r: r.update({"torch.cuda": 5}),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_random_states_fail_fit_with_our_error(tmp_path, good, damage):
    """Written by the real plugin, its random states damaged and the file rewritten by the format layer (fresh
    checksums: only the states are wrong): fit(ckpt_path=...) raises our error naming the file, never IndexError."""
    ck = load_checkpoint(good)
    manifest = json.loads(ck.properties[MANIFEST])
    DAMAGE[damage](ck, manifest["values"][RNG_KEY])
    ck.properties[MANIFEST] = json.dumps(manifest)
    path = tmp_path / "rng.ckpt"
    save_checkpoint(ck, path)
    with pytest.raises(CorruptCheckpointError, match="random states are damaged") as err:
        fit(OrtCheckpoint(dirpath=tmp_path / "out"), 2, ckpt_path=str(path))
    assert str(path) in str(err.value)


def test_a_damaged_state_sets_no_generator():
    """Every state is checked before any is set: a bad NumPy state leaves Python's generator as it was."""
    states = rng.capture()
    random.seed(1)
    states["python"] = copy.deepcopy(rng.capture()["python"])  # another valid state, which must not be applied
    random.seed(2)
    before = random.getstate()
    algorithm, key, _, has_gauss, gauss = states["numpy"]
    states["numpy"] = (algorithm, key, 625, has_gauss, gauss)
    with pytest.raises(ValueError, match="NumPy's random state has position 625"):
        rng.restore(states)
    assert random.getstate() == before


# -- 4. a .data outside the checkpoint's directory -----------------------------------------------------------------
@pytest.mark.parametrize("checksums", [True, False])
@pytest.mark.parametrize("how", ["symlink_out", "symlink_to_a_linked_directory"])
def test_a_data_file_outside_the_directory_is_refused(tmp_path, checksums, how):
    """A ``.data`` that leads outside the checkpoint's directory is not read, even when its bytes are the right ones
    (a copy of the real companion outside: checksums would pass) or when the file records no checksums."""
    g = torch.Generator().manual_seed(1)
    ckdir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    ckdir.mkdir()
    elsewhere.mkdir()
    path = ckdir / "model.ckpt"
    save_checkpoint(CheckpointContents(trainable={"w": torch.randn(256, 64, generator=g)}), path, external_data="params",
                    checksums=checksums)
    data = Path(atomic.data_path(str(path)))
    os.replace(data, elsewhere / data.name)
    if how == "symlink_out":
        os.symlink(os.path.relpath(elsewhere / data.name, ckdir), data)
    else:  # a link inside the directory to a directory outside it, and the .data through it
        os.symlink(elsewhere, ckdir / "sub")
        os.symlink(os.path.join("sub", data.name), data)
    for attempt in (lambda: load_checkpoint(path), lambda: open_checkpoint(path),
                    lambda: OrtCheckpointIO().load_checkpoint(path)):
        with pytest.raises(CorruptCheckpointError, match="outside the checkpoint's directory") as err:
            attempt()
        assert str(path) in str(err.value) and str(elsewhere / data.name) in str(err.value)
    out = run_cli("verify", path)
    assert out.returncode == 1 and out.stdout == "", (out.stdout, out.stderr)
    assert out.stderr.startswith(f"INVALID {path}") and "outside the checkpoint's directory" in out.stderr
    assert len(out.stderr.splitlines()) == 1
    # the same bytes beside the checkpoint are read
    data.unlink()
    os.replace(elsewhere / data.name, data)
    assert run_cli("verify", path).returncode == 0


def test_a_link_pair_into_another_directory_still_reads(tmp_path):
    """save_last="link" links a pair (``.ckpt`` and ``.data``) into the link's directory: the ``.data`` resolves
    beside the checkpoint the link resolves to, which counts as its directory."""
    g = torch.Generator().manual_seed(2)
    target = tmp_path / "a" / "epoch=1.ckpt"
    target.parent.mkdir()
    w = torch.randn(256, 64, generator=g)
    save_checkpoint(CheckpointContents(trainable={"w": w}), target, external_data="params")
    link = tmp_path / "b" / "last.ckpt"
    link.parent.mkdir()
    atomic.link(str(target), str(link))
    assert os.path.islink(atomic.data_path(str(link)))
    assert torch.equal(load_checkpoint(link).trainable["w"], w)
    assert run_cli("verify", link).returncode == 0


# -- 13. the format layer and the CLI without torch ----------------------------------------------------------------
def test_the_format_layer_and_the_cli_work_without_torch(tmp_path):
    arrays = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "n": np.array(7, np.int64),
              "h": np.arange(5, dtype=np.float16)}
    path = tmp_path / "np.ckpt"
    save_checkpoint(CheckpointContents(trainable={"w": arrays["w"]}, frozen={"n": arrays["n"], "h": arrays["h"]},
                               properties={"epoch": 3}), path, external_data="params")
    env = no_torch_env(tmp_path)
    code = """
import json, sys
import numpy as np
try:
    import torch
except ImportError:
    pass
else:
    sys.exit("torch was imported")
from lightning_ort_ckpt.format import load_checkpoint, open_checkpoint
ck = load_checkpoint(sys.argv[1])
tensors = {**ck.trainable, **ck.frozen}
with open_checkpoint(sys.argv[1], verify=True) as reader:
    lazy = {n: reader.get_tensor(n) for n in tensors}
    reader.verify()
print(json.dumps({n: [type(t).__name__, t.dtype.str, list(t.shape), t.tolist()] for n, t in tensors.items()}))
print(json.dumps({n: [type(t).__name__, t.dtype.str, t.tolist()] for n, t in lazy.items()}))
print("torch" in sys.modules and sys.modules["torch"] is not None)
"""
    out = run_python(code, env, path)
    assert out.returncode == 0, out.stderr
    loaded, lazy, torch_loaded = out.stdout.splitlines()
    assert torch_loaded == "False"
    expected = {n: ["ndarray", a.dtype.str, list(a.shape), a.tolist()] for n, a in arrays.items()}
    assert json.loads(loaded) == expected
    assert json.loads(lazy) == {n: v[:2] + v[3:] for n, v in expected.items()}
    for command in (["inspect", path], ["inspect", "--json", path], ["verify", path]):
        out = subprocess.run([sys.executable, "-m", "lightning_ort_ckpt", *map(str, command)], capture_output=True,
                             text=True, env=env, timeout=300)
        assert out.returncode == 0 and out.stderr == "", (command, out.stderr)
    assert "every tensor matches" in out.stdout


# -- 11. verification streams -----------------------------------------------------------------------------------------
_PEAK = """
import resource, runpy, sys
sys.argv = ["ort-ckpt", "verify", sys.argv[1]]
try:
    runpy.run_module("lightning_ort_ckpt", run_name="__main__")
except SystemExit as e:
    status = e.code
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(status, peak, file=sys.stderr)
"""


def _verify_peak(path: Path, env: dict[str, str] | None) -> tuple[str, int]:
    """``ort-ckpt verify path`` in a fresh process: its output, and its peak resident memory in bytes (VmHWM)."""
    out = run_python(_PEAK, env, path)
    status, peak = out.stderr.splitlines()[-1].split()
    assert status == "0", out.stdout + out.stderr
    return out.stdout, int(peak) << 10


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="VmHWM is Linux's")
def test_verify_holds_a_chunk_not_the_file(tmp_path, good):
    """`ort-ckpt verify` on a 360 MiB Lightning checkpoint (parameters in the file and in its .data) peaks no higher
    than on a 20 KiB one, give or take max(64 MiB, 5% of the file), with and without torch: it holds a chunk at a
    time. (Before, it held the file twice with torch, once without.)"""
    ck = load_checkpoint(good)
    manifest = json.loads(ck.properties[MANIFEST])
    for i in range(6):  # 60 MiB each, named in the Lightning metadata so the decode places them
        ck.frozen[f"big{i}"] = torch.full((15 << 20,), float(i))
        manifest["state_dict"].append(f"big{i}")
    ck.properties[MANIFEST] = json.dumps(manifest)
    big = tmp_path / "big.ckpt"
    save_checkpoint(ck, big, external_data="params")
    size = big.stat().st_size + Path(atomic.data_path(str(big))).stat().st_size
    assert size > 350 << 20
    for env in (None, no_torch_env(tmp_path)):
        small_out, small_peak = _verify_peak(good, env)
        big_out, big_peak = _verify_peak(big, env)
        assert "every tensor matches" in big_out and "Lightning metadata:" in big_out, big_out
        assert ("torch is not installed" in big_out) == (env is not None), big_out
        extra = big_peak - small_peak
        assert extra < max(64 << 20, size // 20), (env is not None, extra >> 20, size >> 20)


def test_verify_streams_and_still_finds_a_damaged_tensor(tmp_path):
    """The chunked hash is the checksum: one flipped byte in the middle of a large external tensor is found."""
    path = tmp_path / "ext.ckpt"
    g = torch.Generator().manual_seed(3)
    save_checkpoint(CheckpointContents(trainable={"a": torch.randn(3 << 20, generator=g), "b": torch.randn(8, generator=g)}),
                    path, external_data="params")
    with open_checkpoint(path) as reader:
        reader.verify()
        offset = reader.trainable["a"].offset + (5 << 20) + 3
    with open(atomic.data_path(str(path)), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    with open_checkpoint(path) as reader, pytest.raises(CorruptCheckpointError, match="parameter 'a'.*is damaged"):
        reader.verify()
    out = run_cli("verify", path)
    assert out.returncode == 1 and "'a'" in out.stderr


# -- 15. a hyperparameter that could not be saved --------------------------------------------------------------------
def halve(x: torch.Tensor) -> torch.Tensor:
    """A function as a hyperparameter: Lightning keeps it (it pickles), the checkpoint cannot (no pickle)."""
    return x / 2


class CallsItsActivation(Net):
    """A model whose hyperparameter is a function: saved as a description, it loads as a placeholder."""

    def __init__(self, activation: Any = torch.tanh) -> None:
        super().__init__()
        self.save_hyperparameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hparams.activation(self.layer(x))


USES = {
    "call": lambda u: u(torch.zeros(1)),
    "negate": lambda u: -u,
    "power": lambda u: 2 ** u,
    "round": lambda u: round(u),
    "floor": lambda u: math.floor(u),
    "format_spec": lambda u: f"{u:.3f}",
    "path": lambda u: os.fspath(u),
    "open": lambda u: open(u),
    "with": lambda u: u.__enter__(),
    "item_assignment": lambda u: u.__setitem__("a", 1),
    "delete_attribute": lambda u: delattr(u, "x"),
    "complex": lambda u: complex(u),
}


@pytest.fixture(scope="module")
def placeholder(tmp_path_factory) -> Any:
    d = tmp_path_factory.mktemp("unsaved")
    with pytest.warns(CheckpointWarning, match=r"\['hyper_parameters'\]\['activation'\] holds a builtins.function"):
        fit(OrtCheckpoint(dirpath=d), 1, net_class=lambda vals, sleep: CallsItsActivation(halve))
    return lightning_ort_ckpt.load_from_checkpoint(CallsItsActivation, d / name(0, 4))


def test_a_model_calling_an_unsaved_hyperparameter_gets_our_error(placeholder):
    with pytest.raises(CheckpointError, match="was not saved and cannot be used"):
        placeholder(torch.zeros(2, 4))
    assert "<unsaved builtins.function" in f"{placeholder.hparams.activation}"  # a log line still describes it


@pytest.mark.parametrize("use", sorted(USES))
def test_every_use_of_the_placeholder_is_our_error(placeholder, use):
    with pytest.raises(CheckpointError, match="was not saved and cannot be used"):
        USES[use](placeholder.hparams.activation)
