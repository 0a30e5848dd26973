"""The ``ort-ckpt`` command: look inside and check ORT checkpoints. Runs without torch.

``ort-ckpt inspect FILE [--json]`` lists tensors, optimizer groups, properties and totals (``--json``: strict JSON;
non-finite floats are the strings "nan", "inf", "-inf"); ``ort-ckpt verify FILE`` runs every check of the reader,
checks every tensor against its recorded checksum and that the Lightning metadata decodes (fully when torch is
installed), and exits 0 when the file is valid, 1 when it is not, naming what is wrong; ``ort-ckpt export FILE
--module pkg.mod:Class --output model.onnx`` writes a deployable ONNX model checked against ONNX Runtime (needs
torch). Failures print one ``error: ...`` line, never a traceback. ``FILE`` may be an fsspec URL (``s3://...``),
read with the store's default configuration (for S3: the ``AWS_*`` environment variables, ``AWS_ENDPOINT_URL``
included, or ``FSSPEC_S3_*``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import __version__
from .errors import CheckpointError, CorruptCheckpointError
from .format._store import store_for
from .format._reader import CheckpointReader, TensorInfo
from .format._shared_data import damage_note
from ._translation import FORMAT, MANIFEST


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ort-ckpt", description="Inspect and verify ONNX Runtime training "
                                     "checkpoints (ODTC files).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="list tensors, optimizer state and properties")
    p_inspect.add_argument("file")
    p_inspect.add_argument("--json", action="store_true", help="print one JSON document for scripts")
    p_verify = sub.add_parser("verify", help="validate the file completely; exit status 0 if valid, 1 if not")
    p_verify.add_argument("file")
    p_export = sub.add_parser("export", help="export a checkpoint to an ONNX inference model, checked against "
                              "ONNX Runtime")
    p_export.add_argument("file", help="an ORT or torch checkpoint")
    p_export.add_argument("--module", required=True,
                          help="your LightningModule class: 'package.module:ClassName' or 'file.py:ClassName'")
    p_export.add_argument("--output", "-o", required=True, help="the .onnx file to write")
    p_export.add_argument("--tolerance", type=float, default=1e-5,
                          help="largest accepted |ONNX Runtime - torch| on the example input (default 1e-5)")
    p_export.add_argument("--external-data", action="store_true", help="keep the weights in <output>.data")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except BrokenPipeError:  # `ort-ckpt inspect FILE | head`: the reader left; say nothing more
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a command line prints one error line, never a traceback
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    """Exit status: 0 done, 1 the file is invalid or the command failed (an ``error:`` line says why)."""
    if args.command == "export":
        return _export(args)
    try:
        with store_for(args.file).fetched(args.file) as local, CheckpointReader(local) as reader:  # a URL: downloaded first
            report = describe(reader)
            if local != args.file:  # the report names the URL, not the downloaded copy
                report["file"] = args.file
                report["files"] = {args.file + name[len(local):]: size for name, size in report["files"].items()}
            if args.command == "verify":
                reader.verify()
                report["lightning_check"] = _check_lightning(reader)
    except CheckpointError as e:
        if args.command == "inspect" and args.json:
            print(json.dumps({"file": args.file, "valid": False, "error": str(e)}))
        else:
            print(f"INVALID {e}" if args.command == "verify" else f"error: {e}", file=sys.stderr)
            if args.command == "verify" and (note := damage_note(args.file, str(e))):
                print(f"  {note}", file=sys.stderr)
        return 1
    if args.command == "verify":
        print(f"OK {args.file}: {_summary(report)}")
        verified = reader.checksums is not None and reader.checksums.usable
        print(f"  checksums: {report['checksums']}" + (", every tensor matches" if verified else ""))
        if report["lightning_check"]:
            print(f"  Lightning metadata: {report['lightning_check']}")
        for warning in report["ort_warnings"]:
            print(f"  note: {warning}")
        return 0
    print(json.dumps(_json_safe(report), indent=2, allow_nan=False) if args.json else _render(report))
    return 0


def _check_lightning(reader: CheckpointReader) -> str | None:
    """That the Lightning metadata decodes (raises CheckpointError if not); None for a file without it. With torch,
    the whole Lightning checkpoint dict is rebuilt as a resume would; without, the manifest's structure is checked."""
    if MANIFEST not in reader.properties:
        return None
    try:
        from ._translation.lightning_dict import from_ort
    except ImportError:  # torch is not installed: what can be checked without it
        manifest = _manifest(reader.properties[MANIFEST])
        if manifest is None:
            raise CorruptCheckpointError(f"its Lightning metadata ({MANIFEST}) does not decode", reader.path) from None
        missing = [n for n in manifest.get("state_dict", []) if n not in reader.trainable and n not in reader.frozen]
        if missing:
            raise CorruptCheckpointError(f"parameter {missing[0]!r} named in its Lightning metadata is missing",
                                         reader.path)
        return "the manifest decodes (torch is not installed: tensors not matched against it)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checkpoint = from_ort(reader.load(verify=False), reader.path)  # verified just before
    return f"decodes ({len(checkpoint)} keys, epoch {checkpoint.get('epoch')}, global step " \
           f"{checkpoint.get('global_step')})"


def _manifest(text: Any) -> dict[str, Any] | None:
    """The Lightning manifest of this project, or None (another file, or damaged beyond decoding)."""
    try:
        doc = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == FORMAT else None


def _json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as the strings "nan", "inf", "-inf": JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _export(args: argparse.Namespace) -> int:
    from .export import export_onnx, load_module_class  # torch and onnxruntime: only for this command

    try:
        module_class = load_module_class(args.module)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001 - the user's module ran and failed (SyntaxError, SystemExit, ...)
        if isinstance(e, KeyboardInterrupt):
            raise
        print(f"error: cannot import --module {args.module}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    try:
        report = export_onnx(module_class, args.file, args.output, tolerance=args.tolerance,
                             external_data=args.external_data or None)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        where = f" ({e.filename})" if e.filename and os.fspath(e.filename) != args.output else ""
        print(f"error: cannot write {args.output}{where}: {e.strerror or e}", file=sys.stderr)
        return 1
    except TypeError as e:  # load_from_checkpoint could not construct the class (it needs arguments)
        print(f"error: cannot build {args.module} from the checkpoint: {e}", file=sys.stderr)
        return 1
    print(report)
    return 0


def describe(reader: CheckpointReader) -> dict[str, Any]:
    """Everything ``inspect`` shows, as plain data."""
    files = {reader.path: os.path.getsize(reader.path)}
    if reader.has_external_data:
        files[reader.data_path] = os.path.getsize(reader.data_path)
    params = [_tensor(i) for i in (*reader.trainable.values(), *reader.frozen.values())]
    groups = []
    for g in reader.optimizer_groups.values():
        momentums = [m for ms in g.states.values() for m in ms.values()]
        groups.append({"name": g.name, "step": g.step, "initial_learning_rate": g.initial_learning_rate,
                       "parameters": len(g.states), "momentum_names": sorted({m.name for m in momentums}),
                       "bytes": sum(m.nbytes for m in momentums),
                       "states": {p: [_tensor(m) for m in ms.values()] for p, ms in g.states.items()}})
    props = [{"name": n, "type": type(v).__name__, "value": v} for n, v in reader.properties.items()]
    every = reader.tensors()
    return {
        "file": reader.path, "files": files, "checksums": reader.checksum_status(), "version": reader.version,
        "nominal": reader.nominal,
        "external_data": reader.has_external_data, "parameters": params, "optimizer_groups": groups,
        "properties": props,
        "totals": {"trainable": len(reader.trainable), "frozen": len(reader.frozen),
                   "trainable_elements": sum(_numel(i) for i in reader.trainable.values()),
                   "frozen_elements": sum(_numel(i) for i in reader.frozen.values()),
                   "tensors": len(every), "data_bytes": sum(i.nbytes for i in every),
                   "file_bytes": sum(files.values())},
        "lightning": _lightning_summary(reader.properties.get(MANIFEST)),
        "ort_warnings": _ort_warnings(reader),
    }


def _lightning_summary(manifest: Any) -> dict[str, Any] | None:
    """Epoch, step and version of a Lightning run saved by this project (None for other files)."""
    doc = _manifest(manifest)
    if doc is None:
        return None
    try:
        found = doc["values"]
        return {"epoch": found.get("epoch"), "global_step": found.get("global_step"),
                "lightning_version": found.get("pytorch-lightning_version"),
                "keys": [str(k) for k in doc["keys"] if k != "state_dict"]}
    except (TypeError, ValueError, KeyError, AttributeError):
        return None


def _tensor(info: TensorInfo) -> dict[str, Any]:
    return {"name": info.name, "kind": info.kind, "dtype": info.dtype.name, "shape": list(info.shape),
            "bytes": info.nbytes, "storage": info.storage}


def _numel(info: TensorInfo) -> int:
    n = 1
    for d in info.shape:
        n *= d
    return n


def _ort_warnings(reader: CheckpointReader) -> list[str]:
    """What keeps ORT 1.19.2's CheckpointState from loading or training from this file."""
    out = []
    bad = sorted({i.dtype.name for i in reader.tensors() if not i.dtype.ort_loadable})
    if bad:
        out.append(f"ORT 1.19.2 cannot load tensors of type {', '.join(bad)}")
    if reader.nominal:
        out.append("nominal checkpoint: names and types only, no data to train from")
    return out


def _summary(r: dict[str, Any]) -> str:
    t = r["totals"]
    return (f"{t['trainable']} trainable and {t['frozen']} frozen tensors, {len(r['optimizer_groups'])} optimizer "
            f"group(s), {len(r['properties'])} properties, {_size(t['file_bytes'])}")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""  # unreachable


def _value(prop: dict[str, Any]) -> str:
    if prop["type"] == "float":
        return _f32(prop["value"])
    text = repr(prop["value"])
    return text if len(text) <= 100 else f"{text[:80]}... ({len(prop['value']):,} characters; --json shows all)"


def _f32(value: float) -> str:
    """The shortest text that reads back as the same float32 (the format's float type)."""
    return str(np.float32(value))


def _render(r: dict[str, Any]) -> str:
    lines = [f"{path}: {_size(size)}" for path, size in r["files"].items()]
    lines.append(f"format ODTC version {r['version']}; external data: {'yes' if r['external_data'] else 'no'}; "
                 f"nominal: {'yes' if r['nominal'] else 'no'}; {r['checksums']}")
    if r["parameters"]:
        width = max(len(p["name"]) for p in r["parameters"])
        lines += ["", f"{'parameter':<{width}}  {'kind':<9}  {'dtype':<14}  {'shape':<18}  {'bytes':>12}  storage"]
        for p in r["parameters"]:
            lines.append(f"{p['name']:<{width}}  {p['kind']:<9}  {p['dtype']:<14}  {str(p['shape']):<18}  "
                         f"{p['bytes']:>12,}  {p['storage']}")
    for g in r["optimizer_groups"]:
        lines += ["", f"optimizer group {g['name']}: step {g['step']}, initial learning rate "
                      f"{_f32(g['initial_learning_rate'])}, {g['parameters']} parameters, momentums "
                      f"{', '.join(g['momentum_names']) or '-'} ({_size(g['bytes'])})"]
    if r["lightning"]:
        lt = r["lightning"]
        lines += ["", f"Lightning checkpoint: epoch {lt['epoch']}, global step {lt['global_step']}, saved by "
                      f"Lightning {lt['lightning_version']}; also holds {', '.join(lt['keys'])}"]
    if r["properties"]:
        lines += ["", "properties:"]
        lines += [f"  {p['name']} ({p['type']}) = {_value(p)}" for p in r["properties"]]
    t = r["totals"]
    lines += ["", f"totals: {t['trainable']} trainable ({t['trainable_elements']:,} elements), {t['frozen']} frozen "
                  f"({t['frozen_elements']:,} elements), {t['tensors']} tensors, {_size(t['data_bytes'])} of data, "
                  f"{_size(t['file_bytes'])} on disk"]
    lines += [f"note: {w}" for w in r["ort_warnings"]]
    return "\n".join(lines)
