"""One error family at every entry point, for input that is hostile above the byte level as well as below it:
files that are not checkpoints, Lightning metadata that is valid JSON but hostile, damaged random states and loop
counters, FIFOs, symlink loops, unreadable or endless companions, and the CLI's own failure modes. Real Trainers."""

from __future__ import annotations

import json
import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_ort_ckpt
from lightning_ort_ckpt import CheckpointError, CorruptCheckpointError, OrtCheckpoint, OrtCheckpointIO
from lightning_ort_ckpt.format import CheckpointContents, load_checkpoint, open_checkpoint, save_checkpoint
from lightning_ort_ckpt._translation import MANIFEST
from helpers.fits import Net, fit, name
from helpers.cli import run_cli

CASE_SECONDS = 300


def resume(tmp_path: Path, ckpt: Any, epochs: int = 2) -> Any:
    return fit(OrtCheckpoint(dirpath=tmp_path / "out"), epochs, ckpt_path=str(ckpt))


def assert_named_error(tmp_path: Path, path: Path, *words: str) -> None:
    """``path`` fails with our error naming it, through the plugin and through fit(ckpt_path=...)."""
    for attempt in (lambda: OrtCheckpointIO().load_checkpoint(path), lambda: resume(tmp_path, path)):
        with pytest.raises(CheckpointError) as err:
            attempt()
        assert str(path) in str(err.value)
        for w in words:
            assert w in str(err.value), (w, str(err.value))


# -- files that are neither ORT nor loadable torch checkpoints ----------------------------------------------------
@pytest.mark.parametrize("content", ["random", "empty", "truncated_torch", "text"])
def test_not_a_checkpoint_at_the_plugin_and_at_fit(tmp_path, content):
    path = tmp_path / "thing.ckpt"
    if content == "random":
        path.write_bytes(os.urandom(4096))
    elif content == "empty":
        path.write_bytes(b"")
    elif content == "truncated_torch":
        torch.save({"state_dict": Net().state_dict(), "epoch": 1}, tmp_path / "full.pt")
        data = (tmp_path / "full.pt").read_bytes()
        path.write_bytes(data[:len(data) // 2])
    else:
        path.write_text("not a checkpoint\n")
    assert_named_error(tmp_path, path, "neither an ORT checkpoint nor a torch checkpoint")


class _Evil:
    def __reduce__(self) -> Any:
        return (os.system, (f"touch {os.environ.get('EVIL_MARK', '/nonexistent/mark')}",))


def _evil_file(path: Path, mark: Path) -> None:
    os.environ["EVIL_MARK"] = str(mark)
    try:
        torch.save({"state_dict": Net().state_dict(), "payload": _Evil()}, path)
    finally:
        del os.environ["EVIL_MARK"]


def test_a_malicious_pickle_is_never_executed(tmp_path, good):
    """A torch file whose unpickling would run a command: through the plugin, fit(ckpt_path=...),
    load_from_checkpoint and fit(ckpt_path="last") (which picks it as the newest *.ckpt) it is refused, unrun."""
    mark = tmp_path / "pwned"
    evil = tmp_path / "evil.ckpt"
    _evil_file(evil, mark)
    assert_named_error(tmp_path, evil, "weights_only")
    with pytest.raises(pickle.UnpicklingError, match="weights_only"):  # a torch file: Lightning's own loader
        Net.load_from_checkpoint(evil)
    assert not mark.exists()
    # "last": the newest file in the directory is the malicious one; it is skipped, the sound one resumes
    d = tmp_path / "run"
    d.mkdir()
    (d / name(0, 4)).write_bytes(good.read_bytes())
    os.utime(d / name(0, 4), (1_000_000, 1_000_000))
    _evil_file(d / "zz-newest.ckpt", mark)
    with pytest.warns(UserWarning, match="zz-newest.ckpt"):
        trainer = fit(OrtCheckpoint(dirpath=d), 2, ckpt_path="last")
    assert trainer.ckpt_path == str(d / name(0, 4)) and trainer.global_step == 8
    assert not mark.exists()


# -- hostile Lightning metadata (valid JSON) -----------------------------------------------------------------------
def with_manifest(good: Path, path: Path, edit: Any) -> Path:
    ck = load_checkpoint(good)
    manifest = json.loads(ck.properties[MANIFEST])
    edit(manifest)
    depth = 50_000  # far beyond any recursion limit
    ck.properties[MANIFEST] = json.dumps(manifest).replace('"__DEEP__"', "[" * depth + "]" * depth)
    save_checkpoint(ck, path)  # fresh checksums: only the metadata is hostile
    return path


def _set_value(key: str, value: Any) -> Any:
    """Store ``value`` under the checkpoint key ``key`` (added to the keys the manifest decodes)."""
    def edit(m: dict[str, Any]) -> None:
        m["values"][key] = value
        if key not in m["keys"]:
            m["keys"].append(key)
    return edit


HOSTILE = {
    "deeply_nested": _set_value("hyper_parameters", "__DEEP__"),
    "tagged_device": _set_value("hyper_parameters", {"x": {"__device__": "no-such-device:7"}}),
    "tagged_numpy_overflow": _set_value("hyper_parameters", {"x": {"__numpy__": ["int8", 10**30]}}),
    "tagged_size": _set_value("hyper_parameters", {"x": {"__size__": "abc"}}),
    "tagged_bytes": _set_value("hyper_parameters", {"x": {"__bytes__": 5}}),
    "tagged_dict": _set_value("hyper_parameters", {"x": {"__dict__": [[1]]}}),
    "tagged_set": _set_value("hyper_parameters", {"x": {"__set__": [[1]]}}),
    "tagged_tensor_ref": _set_value("hyper_parameters", {"x": {"__tensor__": ["a", "b"]}}),
    "tagged_namespace": _set_value("hyper_parameters", {"x": {"__namespace__": [1]}}),
    "keys_not_a_list": lambda m: m.update(keys=7),
    "epoch_string": _set_value("epoch", "seven"),
    "global_step_nan": _set_value("global_step", {"__float__": "nan"}),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_lightning_metadata(tmp_path, good, case):
    path = with_manifest(good, tmp_path / "hostile.ckpt", HOSTILE[case])
    assert_named_error(tmp_path, path)
    with pytest.raises(CheckpointError, match="hostile.ckpt"):
        lightning_ort_ckpt.load_from_checkpoint(Net, path)
    out = run_cli("verify", path)
    assert out.returncode == 1 and "Traceback" not in out.stderr and "hostile.ckpt" in out.stderr, out.stderr
    out = run_cli("inspect", "--json", path)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    json.loads(out.stdout)


def _loop_counter(value: Any) -> Any:
    def edit(m: dict[str, Any]) -> None:
        loops = m["values"]["loops"]
        loops["fit_loop"]["epoch_progress"]["current"]["completed"] = value
    return edit


@pytest.mark.parametrize("value", [{"__float__": "nan"}, 10**30, -5, 1.5])
def test_loop_counters_that_would_train_forever(tmp_path, good, value):
    path = with_manifest(good, tmp_path / "counter.ckpt", _loop_counter(value))
    assert_named_error(tmp_path, path, "loop")


@pytest.mark.parametrize("damage", ["python_short", "torch_state", "numpy_kind", "python_overflow"])
def test_damaged_random_states(tmp_path, good, damage):
    ck = load_checkpoint(good)
    manifest = json.loads(ck.properties[MANIFEST])
    rng = manifest["values"]["lightning_ort_ckpt.rng_states"]
    if damage == "python_short":
        rng["python"] = {"__tuple__": [3, [1, 2, 3], None]}
    elif damage == "torch_state":
        ck.frozen[rng["torch"]["__tensor__"]] = torch.zeros(3, dtype=torch.uint8)
    elif damage == "numpy_kind":
        rng["numpy"]["__tuple__"][0] = "NOT-MT19937"
    else:
        rng["python"] = {"__tuple__": [3, [2**80] * 625, None]}
    ck.properties[MANIFEST] = json.dumps(manifest)
    path = tmp_path / "rng.ckpt"
    save_checkpoint(ck, path)
    with pytest.raises(CheckpointError, match="random states"):
        resume(tmp_path, path)


# -- paths that are not plain files --------------------------------------------------------------------------------
def test_fifo_and_symlink_loop_as_the_checkpoint(tmp_path):
    fifo = tmp_path / "pipe.ckpt"
    os.mkfifo(fifo)
    loop = tmp_path / "loop.ckpt"
    os.symlink(loop, loop)
    for path in (fifo, loop):
        for attempt in (lambda: load_checkpoint(path), lambda: OrtCheckpointIO().load_checkpoint(path)):
            with pytest.raises(CheckpointError, match=str(path)):
                attempt()
        out = run_cli("verify", path)
        assert out.returncode == 1 and "Traceback" not in out.stderr


@pytest.fixture()
def external(tmp_path) -> Path:
    path = tmp_path / "ext.ckpt"
    save_checkpoint(CheckpointContents(trainable={"w": torch.randn(256, 64)}), path, external_data="params")
    return path


@pytest.mark.parametrize("companion", ["fifo", "symlink_loop", "unreadable"])
def test_bad_data_companion(external, companion):
    data = Path(f"{external}.data")
    if companion == "unreadable":
        if os.geteuid() == 0:
            pytest.skip("root reads files whatever their mode")
        data.chmod(0)
    else:
        data.unlink()
        os.mkfifo(data) if companion == "fifo" else os.symlink(data, data)
    with pytest.raises(CheckpointError, match=str(external)):
        load_checkpoint(external)
    out = run_cli("verify", external)
    assert out.returncode == 1 and ".data" in out.stderr and "Traceback" not in out.stderr


def test_unreadable_data_companion_as_root(external):
    """Root bypasses file modes; an unreadable companion is one whose open fails: a directory in its place."""
    data = Path(f"{external}.data")
    data.unlink()
    data.mkdir(mode=0)
    with pytest.raises(CheckpointError, match=".data"):
        load_checkpoint(external)


def test_a_valid_file_with_a_huge_sparse_tail(tmp_path, external):
    """64 GiB of holes after the valid bytes, on the checkpoint and on its .data: nothing reads or holds them."""
    code = ("import resource, sys; from lightning_ort_ckpt.format import load_checkpoint; "
            f"ck = load_checkpoint({str(external)!r}); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")

    def peak_kib() -> int:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=CASE_SECONDS)
        assert out.returncode == 0, out.stderr
        return int(out.stdout)

    baseline = peak_kib()  # the same load without a tail: imports and the file itself
    for victim in (external, Path(f"{external}.data")):
        size = victim.stat().st_size
        os.truncate(victim, size + (64 << 30))
        assert peak_kib() < baseline + (256 << 10), baseline  # KiB: the 64 GiB the file claims are never read
        os.truncate(victim, size)


# -- the CLI: one error line and an exit status, never a traceback ------------------------------------------------
def test_cli_export_failures_are_one_line(tmp_path, good):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('this module fails at import')\n")
    needs_args = tmp_path / "needsargs.py"
    needs_args.write_text("from helpers.fits import Net\n"
                          "class Needy(Net):\n    def __init__(self, width):\n        super().__init__()\n")
    with_input = tmp_path / "withinput.py"
    with_input.write_text("import torch\nfrom helpers.fits import Net\n"
                          "class WithInput(Net):\n    example_input_array = torch.zeros(1, 4)\n"
                          "    def forward(self, x):\n        return self.layer(x)\n")
    unwritable = tmp_path / "ro"
    unwritable.mkdir()
    unwritable.chmod(stat.S_IRUSR | stat.S_IXUSR)
    cases = {
        "import": (f"{broken}:Net", tmp_path / "a.onnx", "this module fails at import"),
        "args": (f"{needs_args}:Needy", tmp_path / "c.onnx", "width"),
        "output": (f"{with_input}:WithInput", Path("/proc/forbidden/m.onnx") if os.geteuid() == 0
                   else unwritable / "m.onnx", "m.onnx"),
    }
    for case, (module, output, word) in cases.items():
        out = run_cli("export", good, "--module", module, "--output", output, cwd=Path(__file__).parents[1])
        assert out.returncode == 1, (case, out.stdout, out.stderr)
        assert out.stderr.startswith("error: ") and word in out.stderr, (case, out.stderr)
        assert "Traceback" not in out.stderr, (case, out.stderr)


def test_cli_closed_pipe_is_quiet(good):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get(
        "PYTHONPATH", "")])}
    out = subprocess.run(f"{sys.executable} -m lightning_ort_ckpt inspect --json {good} | head -c 10",
                         shell=True, capture_output=True, text=True, env=env, timeout=CASE_SECONDS)
    assert len(out.stdout) == 10 and "Traceback" not in out.stderr and "Error" not in out.stderr, out.stderr


def test_cli_json_has_no_nan_tokens(tmp_path):
    path = tmp_path / "nan.ckpt"
    save_checkpoint(CheckpointContents(trainable={"w": torch.ones(2)}, properties={"loss": float("nan"),
                                                                          "best": float("inf")}), path)
    out = run_cli("inspect", "--json", path)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"non-JSON token {c}"))
    assert {p["name"]: p["value"] for p in report["properties"]} == {"loss": "nan", "best": "inf"}
    with open_checkpoint(path) as reader:
        assert reader.properties["best"] == float("inf")


def test_tensors_that_share_bytes(tmp_path):
    """A full load reads each tensor into memory of its own, so tensors pointing at the same bytes would each cost a
    copy (a thousand tensors on one 1 GB vector: 1 TB). No writer shares them: it is our error, before any read."""
    import struct

    g = torch.Generator().manual_seed(0)
    path = tmp_path / "shared.ckpt"
    tensors = {"a": torch.randn(64, 64, generator=g), "b": torch.randn(64, 64, generator=g)}
    save_checkpoint(CheckpointContents(trainable=tensors), path, checksums=False)
    with open_checkpoint(path) as reader:
        a, b = reader.trainable["a"].offset, reader.trainable["b"].offset
    data = bytearray(path.read_bytes())
    # b's raw_data field: the uoffset that points at b's vector (its length prefix, 4 bytes before its data)
    field = next(p for p in range(0, len(data) - 4, 4) if p + struct.unpack_from("<I", data, p)[0] == b - 4)
    struct.pack_into("<I", data, field, a - 4 - field)
    path.write_bytes(bytes(data))
    with open_checkpoint(path) as reader:
        assert reader.trainable["b"].offset == a  # the file parses; only a full load needs memory per tensor
    with pytest.raises(CorruptCheckpointError, match="'b' shares bytes with trainable tensor 'a'|'a' shares bytes"):
        load_checkpoint(path, verify=False)
