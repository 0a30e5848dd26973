"""One ORT checkpoint file from a sharded checkpoint directory, a tensor at a time.

ORT's ``CheckpointState`` is one file (with ``.data`` past 2 GiB); a sharded save is a directory of shard files
(``_dcp_folder``). :func:`consolidate` decodes the saved tree (a Lightning checkpoint's; a folder saved through the
public ``dcp.save`` has none: every item DCP saved, by its flattened name) with a stand-in for each large tensor (a
one-element tensor expanded to the saved shape: the right type and shape, no memory), translates it as any Lightning
save is translated (``to_ort``: trainable parameters, ORT's ``group0`` optimizer state, the manifest), then hands
the writer a :class:`~.format.Deferred` in place of each stand-in: the writer assembles that tensor from its chunks
(checksums verified) only when it streams it, and lets it go before the next. Memory: one tensor (plus one chunk of
it while it is copied in), whatever the checkpoint's size.

Optimizer state saved by ``torch.distributed.checkpoint.state_dict`` (what FSDP2 and ``ModelParallelStrategy`` save)
is keyed by parameter name, not torch's index: it is renumbered in ``param_groups`` order, and those names tell which
``state_dict`` entries the first optimizer trains (ORT's trainable parameters), as a live module would.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._dcp._dcp_folder import is_sharded_checkpoint, read_metadata
from .._dcp._dcp_metadata import Location, dtype_of
from .._dcp._dcp_reader import ShardFiles
from .._translation import values
from .._translation.lightning_dict import ModuleInfo, to_ort
from ..errors import CheckpointError, CorruptCheckpointError
from ..format import CheckpointContents, Deferred, StoredAs, save_checkpoint
from ..format._dtypes import from_torch
from ..format._store import Stores

_EAGER_BYTES = 64 << 10  # smaller tensors are read while the tree is decoded (step counters, scores): cheap, and
# the translation looks at some of their values (a common optimizer step)


def consolidate(src: str | os.PathLike[str], out: str | os.PathLike[str], *,
                storage_options: dict[str, Any] | None = None) -> None:
    """Write the sharded checkpoint directory ``src`` as one ORT ``CheckpointState`` file ``out`` (``out.data`` too
    past 2 GiB), which ONNX Runtime loads and, for a Lightning checkpoint dict, trains from; this library reads it
    back as the Lightning checkpoint it was. Streams one tensor at a time. ``storage_options``: fsspec's, for ``src``
    and ``out`` where they are URLs. Raises :class:`CorruptCheckpointError` naming the file on damage."""
    write_consolidated(os.fspath(src), os.fspath(out), Stores(storage_options))


def write_consolidated(src: str, out: str, stores: Stores) -> None:
    """:func:`consolidate`, through ``stores`` (one store for ``src`` and ``out`` where they share a backend)."""
    store = stores.of(src)
    if not store.is_directory(src):
        raise CheckpointError("a file, not a sharded checkpoint folder: it is one checkpoint file already, nothing to "
                              "consolidate" if store.exists(src) else "no such folder", src)
    doc = read_metadata(src, store)
    with ShardFiles(src, store) as files:
        stand_ins: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}

        def source(key: Any) -> torch.Tensor:
            t = doc["tensors"].get(key) if isinstance(key, str) else None
            if t is None:
                raise CorruptCheckpointError(f"the saved tree names a tensor {key!r} the metadata does not hold", src)
            dtype = dtype_of(t["dtype"])
            if math.prod(t["size"]) * dtype.itemsize <= _EAGER_BYTES:
                return files.tensor(t)
            stand_in = torch.empty(1, dtype=dtype).expand(t["size"])
            stand_ins[id(stand_in)] = (stand_in, t)
            return stand_in

        try:
            tree = values.decode(doc["tree"], source) if doc["tree"] is not None else _saved_items(doc, source, files)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CorruptCheckpointError(f"its saved tree does not decode ({e})", src) from None
        if not isinstance(tree, dict):
            raise CheckpointError(f"the saved state is a {type(tree).__name__}, not a dict: nothing ORT can load",
                                  src)
        tree, info = _renumbered(tree)
        try:
            contents = to_ort(tree, info, ort_compatible=True)
        except ValueError as e:
            raise CheckpointError(str(e), src) from None
        _defer(contents, stand_ins, files)
        save_checkpoint(contents, out, store=stores.of(out))


def _saved_items(doc: dict[str, Any], source: Callable[[Any], torch.Tensor], files: ShardFiles) -> dict[str, Any]:
    """The state of a folder saved through the public ``dcp.save`` with ``OrtStorageWriter`` (no Lightning tree in
    its metadata): every item DCP saved, by its flattened name (``model.weight``, ``optim.param_groups.0.lr``); an
    ``io.BytesIO`` item as its bytes."""
    items: dict[str, Any] = {fqn: source(fqn) for fqn in doc["tensors"]}
    for fqn, b in doc["bytes"].items():
        value = files.value(Location(b["file"], b["name"], b["kind"]))
        items[fqn] = value.getvalue() if isinstance(value, io.BytesIO) else value
    return items


def _defer(contents: CheckpointContents, stand_ins: dict[int, tuple[torch.Tensor, dict[str, Any]]],
           files: ShardFiles) -> None:
    """Each stand-in of ``contents`` replaced by a :class:`Deferred` that assembles the tensor when it is written."""

    def deferred(value: Any) -> Any:
        inner = value.tensor if isinstance(value, StoredAs) else value
        found = stand_ins.get(id(inner))
        if found is None:
            return value
        t = found[1]
        lazy = Deferred(from_torch(dtype_of(t["dtype"])), tuple(t["size"]), lambda: files.tensor(t))
        return StoredAs(lazy, value.dtype) if isinstance(value, StoredAs) else lazy

    for tensors in (contents.trainable, contents.frozen):
        for name in tensors:
            tensors[name] = deferred(tensors[name])
    for group in contents.optimizer_groups.values():
        for momentums in group.states.values():
            for name in momentums:
                momentums[name] = deferred(momentums[name])


def _renumbered(tree: dict[str, Any]) -> tuple[dict[str, Any], ModuleInfo | None]:
    """``tree`` with name-keyed optimizer states (``get_optimizer_state_dict``'s) keyed by torch's index, and what
    a live module would have said: the first optimizer's parameters, in order, are the trainable ones."""
    state_dict = tree.get("state_dict")
    optimizers = tree.get("optimizer_states")
    if not isinstance(state_dict, dict) or not isinstance(optimizers, list):
        return tree, None
    names: list[list[str]] = []
    renumbered = []
    for opt in optimizers:
        groups = opt.get("param_groups") if isinstance(opt, dict) else None
        params = [p for g in groups or [] if isinstance(g, dict) for p in g.get("params", [])]
        state = opt.get("state", {}) if isinstance(opt, dict) else {}
        if not params or not all(isinstance(p, str) for p in params) or not set(state) <= set(params):
            return tree, None  # torch's own index-keyed layout, or unknown: translated as it is
        index = {p: i for i, p in enumerate(params)}
        renumbered.append({**opt, "state": {index[k]: v for k, v in state.items()},
                           "param_groups": [{**g, "params": [index[p] for p in g["params"]]} for g in groups or []]})
        names.append(params)
    info = ModuleInfo(trainable={n for n in names[0] if n in state_dict} if names else set(), optimizer_params=names)
    return {**tree, "optimizer_states": renumbered}, info


@contextlib.contextmanager
def single_file(path: str | os.PathLike[str], stores: Stores | None = None) -> Iterator[str]:
    """``path`` itself, or, for a sharded checkpoint directory, a consolidated copy in a temporary folder for the
    length of the block (what export, artifacts and ``ort-ckpt inspect/verify`` read: the one reader path). An error
    of ours raised in the block names ``path``, not the copy. ``stores``: the caller's, which then has the store of
    what it yields too."""
    path, stores = os.fspath(path), stores if stores is not None else Stores()
    if not is_sharded_checkpoint(path, stores.of(path)):
        yield path
        return
    folder = tempfile.mkdtemp(prefix="ort-ckpt-consolidated-")
    try:
        out = os.path.join(folder, os.path.basename(path.rstrip("/")) or "checkpoint.ckpt")
        write_consolidated(path, out, stores)
        try:
            yield out
        except CheckpointError as e:  # name the user's directory, not our temporary copy of it
            e.path = path if e.path == out else e.path
            e.args = (str(e).replace(out, path), *e.args[1:])
            raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)
