"""The ``ort-ckpt`` command: look inside and check ORT checkpoints. Runs without torch.

``ort-ckpt inspect PATH... [--json]`` lists tensors (parameters, buffers and frozen parameters, and Lightning's
bookkeeping counted apart), optimizer groups, properties and totals, and checks the checksums of the smallest tensors
("damaged, run verify" when one fails; ``--json``: strict JSON; non-finite floats are the strings "nan", "inf",
"-inf"; the text shows characters a terminal would act on, in names and values taken from the file, as escapes like
``\x1b``); ``ort-ckpt verify PATH...`` runs every check of the reader, checks every tensor against its recorded
checksum, reading a chunk at a time (memory holds a chunk, not the file), and that the Lightning metadata decodes
(fully when torch is installed), and exits 0 when every checkpoint is valid, 1 when one is not, naming what is wrong.
A ``PATH`` is a file, an fsspec URL (``s3://...``, read with the store's default configuration: for S3 the
``AWS_*`` environment variables, ``AWS_ENDPOINT_URL`` included, or ``FSSPEC_S3_*``), a sharded checkpoint directory
(consolidated into a temporary file first, which needs torch), a run directory (its checkpoints) or a glob; several
end with one summary line (``_cli_runs``). ``ort-ckpt ls DIR`` shows a run as a table; ``ort-ckpt consolidate DIR
OUT.ckpt`` writes a sharded directory as one ORT file; ``ort-ckpt export FILE --module pkg.mod:Class --output
model.onnx`` writes a deployable ONNX model checked against ONNX Runtime (needs torch and the ``ort`` extra),
``--format safetensors`` the weights for Hugging Face's ``from_pretrained``.
Failures print one ``error: ...`` (or ``INVALID ...``) line per checkpoint, never a traceback, and exit 1; a warning
prints as one ``warning: ...`` line; every command takes ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import __version__
from ..errors import CheckpointError, CorruptCheckpointError
from ..format import CheckpointContents, OptimizerGroup
from ..format._store import Stores
from ..format._reader import CheckpointReader, TensorInfo
from ..format._shared_data import damage_note
from ._cli_runs import expand, healable, ls, reading, repair
from ._cli_text import first_line as _first_line
from ._cli_text import shown as _shown
from ._cli_text import size as _size
from ._cli_text import table as _table
from .._translation import FORMAT, MANIFEST


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ort-ckpt", description="Inspect and verify ONNX Runtime training "
                                     "checkpoints (ODTC files).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    json_help = "print one JSON document for scripts"
    paths_help = ("checkpoint files, sharded checkpoint folders, run directories (every checkpoint in them) or "
                  "globs ('ckpts/*.ckpt')")
    p_inspect = sub.add_parser("inspect", help="list tensors, optimizer state and properties")
    p_inspect.add_argument("paths", nargs="+", metavar="PATH", help=paths_help)
    p_inspect.add_argument("--json", action="store_true", help=json_help)
    p_verify = sub.add_parser("verify", help="validate checkpoints completely; exit status 0 if all are valid, 1 if "
                              "not")
    p_verify.add_argument("paths", nargs="+", metavar="PATH", help=paths_help)
    p_verify.add_argument("--json", action="store_true", help=json_help)
    p_verify.add_argument("--repair", action="store_true", help="first make whole each checkpoint whose shared "
                          ".data holds a damaged frozen tensor that another copy holds intact, and say so")
    p_ls = sub.add_parser("ls", help="the checkpoints of a run directory as a table: step, epoch, score, size, "
                          "valid, best and last")
    p_ls.add_argument("directory", help="a run's checkpoint directory (OrtCheckpoint's dirpath)")
    p_ls.add_argument("--verify", action="store_true", help="check every tensor's checksum too (reads everything)")
    p_ls.add_argument("--json", action="store_true", help=json_help)
    p_consolidate = sub.add_parser("consolidate", help="write a sharded checkpoint directory as one ORT checkpoint "
                                   "file (a tensor at a time)")
    p_consolidate.add_argument("directory", help="a sharded checkpoint directory (its checkpoint.ort-meta)")
    p_consolidate.add_argument("output", help="the ORT checkpoint file to write (and <output>.data past 2 GiB)")
    p_consolidate.add_argument("--json", action="store_true", help=json_help)
    p_export = sub.add_parser("export", help="export a checkpoint to an ONNX inference model, checked against "
                              "ONNX Runtime, or its weights as Hugging Face safetensors")
    p_export.add_argument("file", help="an ORT or torch checkpoint (safetensors: an ORT file or a sharded folder)")
    p_export.add_argument("--format", choices=["onnx", "safetensors"], default="onnx",
                          help="onnx (default): an inference model; safetensors: model.safetensors (or shards and "
                          "their index) in the --output folder, for from_pretrained")
    p_export.add_argument("--module",
                          help="your LightningModule class: 'package.module:ClassName' or 'file.py:ClassName' "
                          "(onnx: required)")
    p_export.add_argument("--prefix", default="",
                          help="safetensors: the submodule to write, named as inside it ('model' for "
                          "self.model = AutoModelFor...)")
    p_export.add_argument("--output", "-o", required=True,
                          help="the .onnx file to write (safetensors: the folder)")
    p_export.add_argument("--tolerance", type=_tolerance, default=1e-5,
                          help="largest accepted |ONNX Runtime - torch| on the example input (default 1e-5)")
    p_export.add_argument("--external-data", action="store_true", help="keep the weights in <output>.data")
    p_export.add_argument("--json", action="store_true", help=json_help)
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():  # put back as it was when the command ends (main may run in a caller's process)
            warnings.showwarning = _show_warning
            return _run(args)
    except BrokenPipeError:  # `ort-ckpt inspect FILE | head`: the reader left; say nothing more
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a command line prints one error line, never a traceback
        _say_error(f"{type(e).__name__}: {_first_line(e)}", args)
        return 1


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
    """A warning as one line in the user's terms (``warning: ...``), not Python's format with a source path, line
    number and code: the command's user did not write that code."""
    print(f"warning: {_first_line(Warning(str(message)))}", file=sys.stderr)


def _say_error(message: str, args: argparse.Namespace, prefix: str = "error: ") -> None:
    """One error line on stderr, or, with ``--json``, one JSON document on stdout."""
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, "error": message}))
    else:
        print(f"{prefix}{message}", file=sys.stderr)


def _tolerance(text: str) -> float:
    """``--tolerance``: a finite number from 0 up, checked before anything is loaded or exported."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a tolerance (a number from 0 up, e.g. 1e-5)")
    return value


def _run(args: argparse.Namespace) -> int:
    """Exit status: 0 done, 1 a checkpoint is invalid or the command failed (a line says why)."""
    if args.command == "export":
        return _export(args)
    if args.command == "consolidate":
        return _consolidate(args)
    if args.command == "ls":
        return ls(args.directory, as_json=args.json, verify=args.verify)
    stores = Stores()  # the command's: one store per backend, for every path it names
    units, several = expand(args.paths, stores)
    for line in repair([p for p, nothing in units if nothing is None]) if getattr(args, "repair", False) else ():
        print(line, file=sys.stderr if args.json else sys.stdout)
    reports: list[dict[str, Any]] = []
    for path, nothing in units:
        if several and not args.json and args.command == "inspect" and reports:
            print()
        if nothing is None:
            reports.append(_one(args, path, stores))
            continue
        reports.append({"file": path, "valid": False, "error": nothing})  # a glob or directory without any
        if not args.json:
            print(f"{'INVALID' if args.command == 'verify' else 'error:'} {_shown(path)}: {_shown(nothing)}",
                  file=sys.stderr)
    failed = [r for r in reports if not r.get("valid", True)]
    if args.json:
        doc: Any = reports[0] if not several and len(reports) == 1 else {
            "checkpoints": reports, "summary": {"checkpoints": len(reports), "failed": len(failed)}}
        print(json.dumps(_json_safe(doc), indent=2, allow_nan=False))
    elif several:
        verb = "verified" if args.command == "verify" else "inspected"
        good = "OK" if args.command == "verify" else "readable"
        print(f"{verb} {len(reports)} checkpoint(s): {len(reports) - len(failed)} {good}, {len(failed)} "
              f"{'INVALID' if args.command == 'verify' else 'failed'}"
              + (f" ({', '.join(_shown(r['file']) for r in failed)})" if failed else ""))
    return 1 if failed else 0


def _one(args: argparse.Namespace, path: str, stores: Stores) -> dict[str, Any]:
    """Inspect or verify one checkpoint (a file, a URL or a sharded folder), printing what the command prints for
    it (nothing with ``--json``); its report, ``valid`` False when it failed."""
    verify = args.command == "verify"
    try:
        report, reader = _report(path, verify, stores)
    except ModuleNotFoundError as e:  # torch, to read a sharded checkpoint directory
        message = _missing_message(e, args.command)
        if not args.json:
            print(f"error: {message}", file=sys.stderr)
        return {"file": path, "valid": False, "error": message}
    except CheckpointError as e:
        if not args.json:
            print(f"INVALID {_first_line(e)}" if verify else f"error: {_first_line(e)}", file=sys.stderr)
            if verify and (note := damage_note(path, str(e))):
                print(f"  {_shown(note)}", file=sys.stderr)
        return {"file": path, "valid": False, "error": str(e)}
    if args.json:
        return report
    if verify:
        print(f"OK {_shown(path)}: {_summary(report)}")
        print(f"  checksums: {_shown(report['checksums'])}" + (", every tensor matches" if reader else ""))
        if report["lightning_check"]:
            print(f"  Lightning metadata: {report['lightning_check']}")
        for warning in report["ort_warnings"]:
            print(f"  note: {warning}")
        return report
    print(_render(report))
    if report.get("damaged"):
        healing = report["damaged"].startswith("damaged copy, healable")
        print(f"error: {_shown(path)}: {'' if healing else 'damaged, run verify: '}{_shown(report['damaged'])}",
              file=sys.stderr)
    return report


def _report(path: str, verify: bool, stores: Stores) -> tuple[dict[str, Any], bool]:
    """What ``inspect`` (or ``verify``) says of one checkpoint, and whether every tensor's checksum was checked.
    ``inspect`` checks the checksums of the smallest tensors, :data:`_INSPECT_HASH_BYTES` of them at most: a
    mismatch is reported as ``damaged`` (the report is still shown) and the report's ``valid`` is False."""
    from .._export._loading import single_file

    with (single_file(path, stores) as single, stores.of(single).fetched(single) as local, reading(local) as reader):
        report = describe(reader)  # a URL: downloaded first; a sharded directory: consolidated
        if local != path:  # the report names the URL or directory, not the local copy
            report["file"] = path
            report["files"] = {path + name[len(local):]: size for name, size in report["files"].items()}
        if verify:
            reader.verify()
            if (note := healable(reader)) is not None:  # whole for us, damaged for ORT: not valid
                raise CorruptCheckpointError(note, path)
            report["lightning_check"] = _check_lightning(reader)
        else:
            report["checksums_checked"], report["damaged"] = _spot_check(reader)
            report["damaged"] = report["damaged"] or healable(reader)
            report["valid"] = report["damaged"] is None
        return report, verify and reader.checksums is not None and reader.checksums.usable


FABRIC_KEY = "lightning_ort_ckpt.fabric"  # _fabric.FABRIC_KEY, which a fabric.save records (_fabric needs torch)
_INSPECT_HASH_BYTES = 64 << 20  # inspect hashes this much of the smallest tensors; verify hashes everything


def _spot_check(reader: CheckpointReader) -> tuple[int, str | None]:
    """How many tensors' checksums ``inspect`` checked (the smallest first, within its budget), and the first
    mismatch it met (None if none)."""
    if reader.checksums is None or not reader.checksums.usable:
        return 0, None
    checked = budget = 0
    for info in sorted(reader.tensors(), key=lambda i: i.nbytes):
        budget += info.nbytes
        if budget > _INSPECT_HASH_BYTES:
            break
        try:
            reader.verify_tensor(info)
        except CorruptCheckpointError as e:
            return checked, _first_line(e)
        checked += 1
    return checked, None


def _check_lightning(reader: CheckpointReader) -> str | None:
    """That the Lightning metadata decodes (raises CheckpointError if not); None for a file without it. With torch,
    the whole Lightning checkpoint dict is rebuilt as a resume would; without, the manifest's structure is checked."""
    if MANIFEST not in reader.properties:
        return None
    try:
        from .._translation.lightning_dict import EXTRA_PREFIX, from_ort
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
        checkpoint = from_ort(_stand_ins(reader, EXTRA_PREFIX), reader.path)  # the bytes were verified just before
    counters = _known(("epoch", checkpoint.get("epoch")), ("global step", checkpoint.get("global_step")))
    return _shown(f"decodes ({', '.join([f'{len(checkpoint)} keys', *counters])})")


def _known(*named: tuple[str, Any]) -> list[str]:
    """``name value`` for each value the file holds (a Fabric save has no epoch, step or Lightning version)."""
    return [f"{name} {value}" for name, value in named if value is not None]


def _stand_ins(reader: CheckpointReader, values_prefix: str) -> CheckpointContents:
    """The file's checkpoint for decoding its Lightning metadata without reading its tensors: parameters, buffers
    and optimizer state as meta tensors of their stored shape and type (the decode places them; it never reads their
    bytes, which verification has just hashed a chunk at a time). Tensors inside Lightning's other keys (named
    ``values_prefix``...: random states, hyperparameter arrays) are decoded as values, so they are the file's, as
    zero-copy views: memory stays that of a chunk, not of the checkpoint (a full load would hold it all)."""
    import torch

    def stand_in(info: TensorInfo) -> Any:
        if info.storage == "strings":
            return reader.numpy(info)
        if info.storage != "none" and info.name.startswith(values_prefix):
            return reader.torch(info)
        return torch.empty(info.shape if info.storage != "none" else (0,), dtype=info.dtype.to_torch(),
                           device="meta")

    return CheckpointContents(trainable={n: stand_in(i) for n, i in reader.trainable.items()},
                      frozen={n: stand_in(i) for n, i in reader.frozen.items()},
                      optimizer_groups={g.name: OptimizerGroup(g.step, g.initial_learning_rate,
                                                               {p: {m: stand_in(i) for m, i in ms.items()}
                                                                for p, ms in g.states.items()})
                                        for g in reader.optimizer_groups.values()},
                      properties=dict(reader.properties), nominal=reader.nominal)


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


def _consolidate(args: argparse.Namespace) -> int:
    try:
        from .._export._consolidate import consolidate  # torch: a sharded checkpoint was written with it
    except ModuleNotFoundError as e:
        return _missing(e, args)
    try:
        consolidate(args.directory, args.output)
    except CheckpointError as e:
        return _failed(_first_line(e), args)
    except OSError as e:
        return _failed(f"cannot consolidate {_shown(args.directory)} into {_shown(args.output)}: "
                       f"{e.strerror or e}", args)
    _done(f"consolidated {_shown(args.directory)} into {_shown(args.output)}", args,
          {"directory": args.directory, "output": args.output})
    return 0


def _export(args: argparse.Namespace) -> int:
    try:
        from ..export import export_onnx, export_safetensors, load_module_class  # torch: only for this command
    except ModuleNotFoundError as e:
        return _missing(e, args)
    if args.format == "safetensors":
        try:
            st_report = export_safetensors(args.file, args.output, prefix=args.prefix)
        except CheckpointError as e:
            return _failed(_first_line(e), args)
        except OSError as e:
            return _failed(f"cannot export {_shown(args.file)} to {_shown(args.output)}: {e.strerror or e}", args)
        _done(str(st_report), args, dataclasses.asdict(st_report))
        return 0
    if args.module is None:
        return _failed("--format onnx needs --module, your LightningModule class ('package.module:ClassName' or "
                       "'file.py:ClassName')", args)
    try:
        module_class = load_module_class(args.module)
    except CheckpointError as e:
        return _failed(_first_line(e), args)
    except BaseException as e:  # noqa: BLE001 - the user's module ran and failed (SyntaxError, SystemExit, ...)
        if isinstance(e, KeyboardInterrupt):
            raise
        return _failed(f"cannot import --module {_shown(args.module)}: {type(e).__name__}: {_first_line(e)}", args)
    try:
        report = export_onnx(module_class, args.file, args.output, tolerance=args.tolerance,
                             external_data=args.external_data or None)
    except CheckpointError as e:
        return _failed(_first_line(e), args)
    except ModuleNotFoundError as e:  # onnx or onnxruntime, imported when the export reaches them
        return _missing(e, args)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and os.fspath(e.filename) != args.output else ""
        return _failed(f"cannot write {_shown(args.output)}{_shown(where)}: {e.strerror or e}", args)
    except TypeError as e:  # load_from_checkpoint could not construct the class (it needs arguments)
        return _failed(f"cannot build {_shown(args.module)} from the checkpoint: {_first_line(e)}", args)
    except Exception as e:  # noqa: BLE001 - the user's module failed inside the export: one line, not a traceback
        return _failed(f"cannot export {_shown(args.file)} with {_shown(args.module)}: {type(e).__name__}: "
                       f"{_first_line(e)}", args)
    _done(str(report), args, dataclasses.asdict(report))
    return 0


def _failed(message: str, args: argparse.Namespace) -> int:
    _say_error(message, args)
    return 1


def _done(text: str, args: argparse.Namespace, doc: dict[str, Any]) -> None:
    print(json.dumps(_json_safe({"ok": True, **doc}), allow_nan=False) if args.json else text)


_INSTALL = {"torch": "torch (pip install torch; see docs/guide.md, Install)",
            "onnx": 'the ort extra (pip install ".[ort]" in a checkout of lightning-ort-ckpt)',
            "onnxruntime": 'the ort extra (pip install ".[ort]" in a checkout of lightning-ort-ckpt; '
                           "onnxruntime-training has wheels for CPython 3.11 on x86_64 Linux only)"}


def _missing_message(e: ModuleNotFoundError, command: str) -> str:
    """What a missing package means: torch for a sharded checkpoint; onnx and onnxruntime for the export (which
    to install); any other module is the user's code's own error."""
    top = (e.name or "").partition(".")[0]
    if top not in _INSTALL:
        return f"{type(e).__name__}: {_first_line(e)}"
    return f"ort-ckpt {command} needs {top}, which is not installed: install {_INSTALL[top]}"


def _missing(e: ModuleNotFoundError, args: argparse.Namespace) -> int:
    return _failed(_missing_message(e, args.command), args)


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
    module_frozen, bookkeeping = _frozen_parts(reader)
    for p in params:
        p["role"] = ("parameter" if p["kind"] == "trainable" else
                     "Lightning bookkeeping" if p["name"] in bookkeeping else "buffer or frozen parameter")
    return {
        "file": reader.path, "files": files, "checksums": reader.checksum_status(), "version": reader.version,
        "nominal": reader.nominal,
        "external_data": reader.has_external_data, "parameters": params, "optimizer_groups": groups,
        "properties": props,
        "totals": {"trainable": len(reader.trainable), "frozen": len(reader.frozen),
                   "trainable_elements": sum(_numel(i) for i in reader.trainable.values()),
                   "frozen_elements": sum(_numel(i) for i in reader.frozen.values()),
                   "buffers_or_frozen_parameters": len(module_frozen),
                   "buffers_or_frozen_parameters_elements": sum(_numel(reader.frozen[n]) for n in module_frozen),
                   "lightning_bookkeeping": len(bookkeeping),
                   "tensors": len(every), "data_bytes": sum(i.nbytes for i in every),
                   "file_bytes": sum(files.values())},
        "lightning": _lightning_summary(reader.properties.get(MANIFEST)),
        "ort_warnings": _ort_warnings(reader),
    }


def _frozen_parts(reader: CheckpointReader) -> tuple[list[str], list[str]]:
    """The file's frozen tensors in two parts: the module's (buffers and frozen parameters: ORT calls both frozen;
    the names its Lightning metadata lists as the ``state_dict``) and the rest, Lightning's bookkeeping stored as
    tensors (random states, callback scores). A file without our Lightning metadata (ORT wrote it) has none."""
    manifest = _manifest(reader.properties.get(MANIFEST))
    names = manifest.get("state_dict") if manifest is not None else None
    if manifest is None or not isinstance(names, list):
        return list(reader.frozen), []
    module = set(names) | {v for v in (manifest.get("aliases") or {}).values() if isinstance(v, str)}
    return [n for n in reader.frozen if n in module], [n for n in reader.frozen if n not in module]


def _lightning_summary(manifest: Any) -> dict[str, Any] | None:
    """Epoch, step and version of a Lightning run saved by this project (None for other files). Only plain values
    are shown: a damaged manifest may hold anything there (a list nested 800 deep would outgrow the JSON encoder's
    recursion), and ``verify`` says what is wrong with it."""
    doc = _manifest(manifest)
    if doc is None:
        return None
    try:
        found = doc["values"]
        return {"epoch": _plain(found.get("epoch")), "global_step": _plain(found.get("global_step")),
                "lightning_version": _plain(found.get("pytorch-lightning_version")),
                "keys": [k for k in doc["keys"] if isinstance(k, str) and k != "state_dict"]}
    except (TypeError, ValueError, KeyError, AttributeError):
        return None


def _plain(value: Any) -> Any:
    """``value`` if it is a JSON number, string, boolean or null, else a short word that says it is not."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return f"<damaged: a {type(value).__name__}>"


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
    return (f"{t['trainable']} parameters, {_module_frozen(t)}, {len(r['optimizer_groups'])} optimizer "
            f"group(s), {len(r['properties'])} properties, {_size(t['file_bytes'])}")


def _module_frozen(t: dict[str, Any]) -> str:
    """The frozen tensors in words: buffers and frozen parameters apart from Lightning's bookkeeping."""
    words = f"{t['buffers_or_frozen_parameters']} buffers or frozen parameters"
    if t["lightning_bookkeeping"]:
        words += f", {t['lightning_bookkeeping']} tensors of Lightning's bookkeeping (random states, callback state)"
    return words


def _value(prop: dict[str, Any]) -> str:
    if prop["type"] == "float":
        return _f32(prop["value"])
    text = _shown(repr(prop["value"]))
    return text if len(text) <= 100 else f"{text[:80]}... ({len(prop['value']):,} characters; --json shows all)"


def _f32(value: float) -> str:
    """The shortest text that reads back as the same float32 (the format's float type)."""
    return str(np.float32(value))


def _render(r: dict[str, Any]) -> str:
    """The text report; every name and value from the file goes through :func:`_shown`."""
    lines = [f"{_shown(path)}: {_size(size)}" for path, size in r["files"].items()]
    lines.append(f"format ODTC version {r['version']}; external data: {'yes' if r['external_data'] else 'no'}; "
                 f"nominal: {'yes' if r['nominal'] else 'no'}; {_shown(r['checksums'])}")
    if r["parameters"]:
        lines += ["", *_table(["parameter", "kind", "dtype", "shape", "bytes", "storage"],
                              [[_shown(p["name"]), "lightning" if p["role"] == "Lightning bookkeeping" else p["kind"],
                                p["dtype"], str(p["shape"]), f"{p['bytes']:,}",
                                p["storage"]] for p in r["parameters"]], right={4})]
    for g in r["optimizer_groups"]:
        lines += ["", f"optimizer group {_shown(g['name'])}: step {g['step']}, initial learning rate "
                      f"{_f32(g['initial_learning_rate'])}, {g['parameters']} parameters, momentums "
                      f"{_shown(', '.join(g['momentum_names'])) or '-'} ({_size(g['bytes'])})"]
    if r["lightning"]:
        lt = r["lightning"]
        kind = "Fabric checkpoint" if FABRIC_KEY in lt["keys"] else "Lightning checkpoint"
        known = _known(("epoch", lt["epoch"]), ("global step", lt["global_step"]),
                       ("saved by Lightning", lt["lightning_version"]))
        holds = ", ".join(k for k in lt["keys"] if k != FABRIC_KEY) or "nothing else"
        lines += ["", _shown(f"{kind}: {', '.join(known)}; also holds {holds}" if known else f"{kind}: holds {holds}")]
    if r["properties"]:
        lines += ["", "properties:"]
        lines += [f"  {_shown(p['name'])} ({p['type']}) = {_value(p)}" for p in r["properties"]]
    t = r["totals"]
    frozen = t["buffers_or_frozen_parameters"]
    bookkeeping = (f", {t['lightning_bookkeeping']} of Lightning's bookkeeping (random states, callback state)"
                   if t["lightning_bookkeeping"] else "")
    lines += ["", f"totals: {t['trainable']} trainable ({t['trainable_elements']:,} elements), {frozen} frozen "
                  f"({t['buffers_or_frozen_parameters_elements']:,} elements){bookkeeping}, {t['tensors']} tensors, "
                  f"{_size(t['data_bytes'])} of data, {_size(t['file_bytes'])} on disk",
              "  trainable: parameters ORT trains; frozen: buffers and frozen parameters of the module"]
    if "checksums_checked" in r:
        lines.append(f"checksums: {r['checksums_checked']} of {t['tensors']} tensors checked"
                     + (" (verify checks every tensor)" if r["checksums_checked"] < t["tensors"] else ""))
    lines += [f"note: {w}" for w in r["ort_warnings"]]
    return "\n".join(lines)
