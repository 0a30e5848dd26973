"""``ort-ckpt`` for whole runs: the paths ``verify`` and ``inspect`` take (files, sharded checkpoint folders, run
directories, local or remote, globs), and ``ort-ckpt ls RUN_DIR``, a local run as a table. A run directory is listed
by the checkpoint registry (``_registry``, the listing "last" and retention use): its committed and half-written
checkpoints; foreign files are left out. Runs without torch unless a sharded checkpoint's folder is met (torch wrote
it).

``ls`` shows each checkpoint of the directory with the step, epoch and monitored score its own metadata records
(none where the score is an older step's), its size on disk (a file with its ``.data``, or a folder's files; a file
hard-linked by several checkpoints, as frozen sharing's ``.data`` are, counts once, for the first checkpoint that
holds it), whether it is valid (the
reader's every structural check; ``--verify`` hashes every tensor too) or why not (last, so that a long reason moves
no other column), and which is the best (the ``best_model_path`` the newest checkpoint's callback state records),
which the last, and which are not among the top-k that state ranks (``unranked``).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from ._cli_text import shown as _shown
from ._cli_text import size as _size
from ._cli_text import table as _table
from .._restore._registry import Entry, Kind, State, scan
from .._translation import MANIFEST
from ..errors import CheckpointError, CheckpointWarning
from ..format._atomic import DATA_SUFFIX, FOLDER_COMMIT_NAME
from ..format._reader import CheckpointReader
from ..format._shared_data import repair as _repair
from ..format._shared_data import sharing_checkpoints
from ..format._store import Store, Stores

_GLOB_CHARS = "*?["
CHECKPOINT_SUFFIX = ".ckpt"  # Lightning's ModelCheckpoint.FILE_EXTENSION, which OrtCheckpoint keeps


def repair(paths: list[str]) -> list[str]:
    """``verify --repair``: make whole the checkpoints of ``paths`` (local files, and every checkpoint sharing a
    ``.data`` with one) whose shared ``.data`` holds a damaged frozen tensor another copy holds intact; a line for
    each damaged file, saying what was done."""
    files = sorted({c for p in paths if os.path.isfile(p) for c in [p, *sharing_checkpoints(p)]})
    lines = []
    for r in _repair(files):
        if r.lost:
            lines.append(f"NOT REPAIRED {_shown(r.damaged)}: frozen tensor {r.lost[0]!r} ({len(r.lost)} in all) is "
                         "damaged in every copy")
        else:
            lines.append(f"REPAIRED {_shown(r.damaged)}: {', '.join(repr(t) for t in r.tensors)} taken from the "
                         f"other copy; {', '.join(_shown(os.path.basename(c)) for c in r.checkpoints)} now link a "
                         "fresh, whole copy")
    return lines


def expand(paths: list[str], stores: Stores) -> tuple[list[tuple[str, str | None]], bool]:
    """The checkpoints ``paths`` name, in their order, each with None, or, for a path that named none, why; and
    whether they are several (a summary line follows): a glob is expanded, a run directory gives its
    checkpoints, anything else is itself."""
    found: list[tuple[str, str | None]] = []
    several = len(paths) > 1
    for path in paths:
        if not stores.of(path).local or os.path.lexists(path) or not any(c in path for c in _GLOB_CHARS):
            matches = [path]
        else:
            several = True
            matches = [p for p in sorted(glob.glob(path)) if not _part_of_another(p)]
            if not matches:
                found.append((path, "no file or folder matches"))
        for match in matches:
            if is_run_directory(match, stores.of(match)):
                several = True
                if stores.of(match).local and (why := unreadable(match)) is not None:
                    found.append((match, why))
                    continue
                inside = [(e.path, None) for e in sorted(checkpoints(match, stores.of(match)), key=lambda e: e.path)]
                found += inside or [(match, "a directory without checkpoints (no *.ckpt file or checkpoint "
                                            "folder)")]
            else:
                found.append((match, None))
    return list(dict.fromkeys(found)), several


def is_run_directory(path: str, store: Store) -> bool:
    """A directory, local or remote (``s3://bucket/run``), that is not itself a checkpoint (a committed or
    half-written checkpoint folder)."""
    if path.rstrip("/").endswith(CHECKPOINT_SUFFIX):
        return False
    return store.is_directory(path) and not store.exists(store.join(path, FOLDER_COMMIT_NAME))


def unreadable(directory: str) -> str | None:
    """Why the local ``directory`` cannot be listed (no permission, an I/O error), or None: a listing would
    otherwise pass for an empty directory."""
    try:
        os.scandir(directory).close()
    except OSError as e:
        return f"cannot read this directory ({e.strerror or e})"
    return None


def checkpoints(directory: str, store: Store) -> list[Entry]:
    """The committed and half-written checkpoints of ``directory`` (on ``store``), as the registry lists them."""
    return [e for e in scan(directory, store) if e.state is not State.FOREIGN]


def _part_of_another(path: str) -> bool:
    """A ``.data`` companion whose checkpoint exists, a hidden temporary: parts of another unit, not one."""
    name = os.path.basename(path)
    return name.startswith(".") or (name.endswith(DATA_SUFFIX) and os.path.exists(path[:-len(DATA_SUFFIX)]))


# -- ls --------------------------------------------------------------------------------------------------------------
def ls(directory: str, as_json: bool, verify: bool) -> int:
    """Print the table (or the JSON document) of ``directory``'s checkpoints; exit status 1 if one is not valid."""
    stores = Stores()  # the command's: one store per backend
    why = ("a URL: ort-ckpt ls lists a local directory (ort-ckpt verify URL checks every checkpoint of a remote run)"
           if not stores.of(directory).local else
           "not a directory (ort-ckpt ls takes a run's checkpoint directory)" if not os.path.isdir(directory) else
           unreadable(directory))
    if why is not None:
        message = f"{directory}: {why}"
        print(json.dumps({"ok": False, "error": message}) if as_json else f"error: {_shown(message)}",
              file=sys.stdout if as_json else sys.stderr)
        return 1
    rows = [_row(e, verify, stores) for e in checkpoints(directory, stores.of(directory))]
    rows.sort(key=lambda r: (r["step"] is None, r["step"] or 0, r["epoch"] or 0, r["link"] is not None, r["name"]))
    seen: set[tuple[int, int]] = set()
    for r in rows:
        r["bytes"], r["shared_bytes"] = _sizes(r.pop("files"), seen)
    _mark(rows)
    invalid = [r for r in rows if r["problem"]]
    total, shared = sum(r["bytes"] for r in rows), sum(r["shared_bytes"] for r in rows)
    if as_json:
        print(json.dumps({"directory": directory, "checkpoints": rows, "bytes": total, "shared_bytes": shared,
                          "invalid": len(invalid)}, indent=2, allow_nan=False, default=str))
        return 1 if invalid else 0
    monitor = next((r["monitor"] for r in rows if r["monitor"]), None)
    header = ["checkpoint", "step", "epoch", monitor or "score", "size", "", "valid"]  # the free text last: a
    # long reason never moves another row's columns
    table = [[_shown(r["name"] + (f" -> {r['link']}" if r["link"] else "")), _text(r["step"]), _text(r["epoch"]),
              _score(r["score"]), _size(r["bytes"]) + (f" (+{_size(r['shared_bytes'])} shared)"
                                                       if r["shared_bytes"] else ""),
              ", ".join(r["marks"]), "ok" if not r["problem"] else _shown(r["problem"])] for r in rows]
    for line in _table(header, table, right={1, 2, 3, 4}):
        print(line)
    check = "every tensor's checksum checked" if verify else "structure checked; --verify hashes every tensor"
    print(f"{len(rows)} checkpoint(s) in {_shown(directory)}, {_size(total)} on disk"
          + (f" ({_size(shared)} of hard-linked files counted once)" if shared else "")
          + f"; {len(invalid)} not valid ({check})")
    return 1 if invalid else 0


def _row(entry: Entry, verify: bool, stores: Stores) -> dict[str, Any]:
    folder = entry.kind is Kind.FOLDER
    row: dict[str, Any] = {"name": os.path.basename(entry.path), "path": entry.path,
                           "kind": "folder" if folder else "file", "step": entry.step, "epoch": entry.epoch,
                           "monitor": None, "score": None, "best_model_path": None, "ranks": None,
                           "problem": entry.problem,
                           "link": _link(entry.path), "files": _files(entry.path, folder)}
    if entry.state is State.HALF:
        row["problem"] = f"half-written: a checkpoint folder without {FOLDER_COMMIT_NAME} (its save did not finish)"
    elif folder:
        if verify and not row["problem"]:
            _verify_folder(row, entry.path, stores)
    else:
        _file_row(row, entry.path, verify)
    return row


def _files(path: str, folder: bool) -> list[str]:
    """Every file of a checkpoint: the file and its ``.data``, or everything in the folder."""
    if folder:
        return sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names)
    return [p for p in (path, path + DATA_SUFFIX) if os.path.exists(p)]


def _file_row(row: dict[str, Any], path: str, verify: bool) -> None:
    try:
        with reading(path) as reader:
            if verify:
                reader.verify()
            _from_metadata(row, reader)
            row["problem"] = healable(reader)
    except CheckpointError as e:
        row["problem"] = str(e).removeprefix(f"{path}: ")


@contextlib.contextmanager
def reading(path: str) -> Iterator[CheckpointReader]:
    """The checkpoint ``path`` open for every command, as this library reads it (a frozen tensor damaged in a shared
    ``.data`` read from another copy, without a warning: :func:`healable` says it in the command's own terms)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        with CheckpointReader(path) as reader:
            yield reader


def healable(reader: CheckpointReader) -> str | None:
    """Why a checkpoint that read whole only through another copy of its shared ``.data`` is not valid: ONNX
    Runtime's reader has no such fallback (every command says it, and counts it as not valid); None otherwise."""
    if not reader.healed:
        return None
    name, other = reader.healed[0]
    more = f" (and {len(reader.healed) - 1} more)" if len(reader.healed) > 1 else ""
    return (f"damaged copy, healable: run `ort-ckpt verify --repair`: frozen tensor {name!r}{more} is damaged in "
            f"{reader.data_path}, intact in the other copy {other}")


def _verify_folder(row: dict[str, Any], path: str, stores: Stores) -> None:
    """``--verify`` of a sharded checkpoint: every shard's tensors hashed, through its consolidated copy."""
    from .._export._loading import single_file

    try:
        with single_file(path, stores) as single, reading(single) as reader:
            reader.verify()
    except CheckpointError as e:
        row["problem"] = str(e)


def _from_metadata(row: dict[str, Any], reader: CheckpointReader) -> None:
    """The monitored score and the callback's best path, from the file's Lightning metadata (only plain values; the
    score is a tensor of the file, read with its checksum checked). The step and epoch are the registry's."""
    try:
        doc = json.loads(str(reader.properties.get(MANIFEST, "null")))
        values = doc["values"]
    except (TypeError, ValueError, KeyError, RecursionError):
        return  # ORT wrote it: no Lightning metadata
    if not isinstance(values, dict):
        return
    callbacks = values.get("callbacks")
    for state in callbacks.values() if isinstance(callbacks, dict) else ():
        if isinstance(state, dict) and isinstance(state.get("monitor"), str):
            row["monitor"] = state["monitor"]
            row["best_model_path"] = state.get("best_model_path") if isinstance(state.get("best_model_path"),
                                                                                str) else None
            ranked = state.get("best_k_models")
            row["ranks"] = [os.path.basename(p) for p in ranked if isinstance(p, str)] \
                if isinstance(ranked, dict) else None
            scored_at = state.get("current_score_step")  # OrtCheckpoint's: the step the score was logged at
            if not isinstance(scored_at, int) or scored_at == row["step"]:  # else it is an older step's: stale
                row["score"] = _tensor_value(reader, state.get("current_score"))
            return


def _tensor_value(reader: CheckpointReader, ref: Any) -> float | None:
    name = ref.get("__tensor__") if isinstance(ref, dict) else None
    info = reader.frozen.get(name) if isinstance(name, str) else None
    if info is None or info.shape != () or info.storage == "none":
        return None
    reader.verify_tensor(info)
    return float(reader.numpy(info))


def _link(path: str) -> str | None:
    return os.readlink(path) if os.path.islink(path) else None


def _sizes(files: list[str], seen: set[tuple[int, int]]) -> tuple[int, int]:
    """Bytes of ``files`` not counted yet, and bytes already counted (hard links to a file listed before)."""
    new = shared = 0
    for f in files:
        try:
            st = os.stat(f)
        except OSError:
            continue
        key = (st.st_dev, st.st_ino)
        if key in seen:
            shared += st.st_size
        else:
            seen.add(key)
            new += st.st_size
    return new, shared


def _mark(rows: list[dict[str, Any]]) -> None:
    """``best``: the checkpoint the newest one's callback state calls best; ``last``: Lightning's last name, or
    the newest checkpoint when there is none; ``unranked``: not among the top-k that state ranks (a ``last`` copy, a
    periodic save)."""
    newest = next((r for r in reversed(rows) if r["best_model_path"]), None)
    best = os.path.basename(newest["best_model_path"]) if newest else None
    ranks = next((r["ranks"] for r in reversed(rows) if r.get("ranks")), None)
    lasts = [r for r in rows if r["name"].startswith("last") and not r["problem"]]
    last = lasts[-1]["name"] if lasts else next((r["name"] for r in reversed(rows) if not r["problem"]), None)
    for r in rows:
        r["ranked"] = None if ranks is None else r["name"] in ranks
        r["marks"] = [m for m, hit in (("best", r["name"] == best), ("last", r["name"] == last),
                                       ("unranked", r["ranked"] is False)) if hit]
        r["best"], r["last"] = "best" in r["marks"], "last" in r["marks"]
        del r["best_model_path"], r["ranks"]


def _text(value: int | None) -> str:
    return "-" if value is None else str(value)


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"
