"""The one reader path from a checkpoint file to Lightning's checkpoint dict, for ``fit(ckpt_path=...)``,
``load_from_checkpoint``, ``"last"`` resolution, export and the CLI.

Files are told apart by content, not name: ORT files (``ODTC`` identifier) are translated back (``_translation``);
anything else goes to torch's loader with ``weights_only=True`` (``_torch_files``). Every file is read through its
store (``format._store``), so a URL is downloaded once, into a temporary folder, and read there with every check of
the reader.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from .._lightning import _lightning_adapter
from .._lightning._namespaces import loaded, namespace_of
from .._fit_state._data_position import DATA_KEY
from .._fit_state._rng import RNG_KEY
from .._fit_state._validation_resume import UNDECIDABLE_KEY, VALIDATION_KEY
from ._torch_files import load_torch_file
from .._translation.lightning_dict import MANIFEST, from_ort, plain_ort_to_lightning, with_aliases
from .._translation.optimizers import torch_state_from_ort
from ..errors import CheckpointError, CheckpointWarning, CorruptCheckpointError
from ..format import GROUP_ZERO, CheckpointContents, load_checkpoint, open_checkpoint
from ..format._schema import FILE_IDENTIFIER
from ..format._store import Store, store_for


def is_ort_checkpoint(path: str | os.PathLike[str], store: Store | None = None) -> bool:
    """Whether ``path`` (a file or an fsspec URL) holds an ORT checkpoint (by its file identifier, not its name).
    ``store``: the store of ``path`` (here and below), built by whoever knew the location first; None: a store
    without options (a local path, or Lightning's loader asking about one)."""
    path = os.fspath(path)
    return _store(path, store).read_head(path, 8)[4:8] == FILE_IDENTIFIER


def read_contents(path: str | os.PathLike[str], store: Store | None = None) -> CheckpointContents:
    """Every tensor of an ORT file, verified against its checksums, in memory of its own (downloaded once for a URL)."""
    path = os.fspath(path)
    with _store(path, store).fetched(path) as local:
        return load_checkpoint(local)


def _store(path: str, store: Store | None) -> Store:
    return store if store is not None else store_for(path)


def to_lightning(ck: CheckpointContents, path: str, strategy: Any = None) -> dict[str, Any]:
    """The Lightning checkpoint dict of an ORT file's contents, whether Lightning or ORT alone wrote it.

    A file ORT alone wrote carries no loop progress and no optimizer hyperparameters: with the ``strategy`` of the
    run that resumes it, loop progress is set to ORT's optimizer step and ``optimizer_states`` is built from ORT's
    moments and the live optimizers, and the module's tied parameters get their other names back (ORT stores a tied
    tensor once); without one the dict holds the weights only.
    """
    if MANIFEST in ck.properties:
        return from_ort(ck, path)
    version = (namespace_of(strategy) if strategy is not None else loaded()[0]).version
    checkpoint = plain_ort_to_lightning(ck, version)
    step = checkpoint["global_step"]
    warnings.warn(f"{path} was written by ONNX Runtime, not Lightning: weights and optimizer moments come from it, "
                  f"global_step is its optimizer step ({step}), the epoch starts at 0, and learning-rate schedulers "
                  "and callbacks start fresh", CheckpointWarning, stacklevel=3)
    if strategy is not None and strategy.lightning_module is not None:
        checkpoint["state_dict"] = with_aliases(checkpoint["state_dict"], strategy.lightning_module)
        checkpoint["loops"] = {"fit_loop": _lightning_adapter.fit_loop_state_at_step(
            strategy.lightning_module.trainer.fit_loop, step)}
        checkpoint["optimizer_states"] = _OptimizerStatesFromOrt(ck, strategy)
    return checkpoint


def read_lightning_checkpoint(path: str | os.PathLike[str], strategy: Any = None,
                              store: Store | None = None) -> dict[str, Any]:
    """The Lightning checkpoint dict of an ORT file (see :func:`to_lightning`)."""
    path = os.fspath(path)
    return to_lightning(read_contents(path, store), path, strategy)


class _OptimizerStatesFromOrt(Sequence):
    """``optimizer_states`` for a file ORT wrote, built when Lightning restores the optimizers: ORT stores no
    hyperparameters, so they are the live optimizers' own, and those exist only after the file was read."""

    def __init__(self, ck: CheckpointContents, strategy: Any) -> None:
        self._ck = ck
        self._strategy = strategy
        self._built: list[dict[str, Any]] | None = None

    def _states(self) -> list[dict[str, Any]]:
        if self._built is None:
            module, optimizers = self._strategy.lightning_module, list(self._strategy.optimizers)
            names = {id(p): n for n, p in module.named_parameters()}
            group = self._ck.optimizer_groups.get(GROUP_ZERO)
            self._built = [opt.state_dict() for opt in optimizers]
            if optimizers and group is not None and group.states:
                first = optimizers[0]
                if isinstance(first, (torch.optim.Adam, torch.optim.AdamW)):
                    order = [names.get(id(p), "") for g in first.param_groups for p in g["params"]]
                    self._built[0] = torch_state_from_ort(group, order, self._built[0])
                else:
                    warnings.warn(f"ORT's optimizer state is AdamW's; {type(first).__name__} starts fresh",
                                  CheckpointWarning, stacklevel=2)
        return self._built

    def __len__(self) -> int:
        return len(self._states())

    def __getitem__(self, index: Any) -> Any:
        return self._states()[index]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._states())


def read_any_checkpoint(path: str | os.PathLike[str], store: Store | None = None) -> dict[str, Any]:
    """The Lightning checkpoint dict of an ORT file or of a torch ``.ckpt`` (Lightning's own format, loaded with
    ``weights_only=True``: no code in it runs), for artifacts; ``path`` may be an fsspec URL."""
    store = _store(os.fspath(path), store)
    if is_ort_checkpoint(path, store):
        return read_lightning_checkpoint(path, store=store)
    return _read_torch_checkpoint(path, store, mmap=False)


def read_weights(path: str | os.PathLike[str], store: Store | None = None) -> dict[str, Any]:
    """As :func:`read_any_checkpoint`, without ``optimizer_states``, for export: reads the module's tensors once,
    lazily, and none of the optimizer's (an ORT file's tensors are views of the mapped file, verified as they are
    read; a torch file is memory-mapped, ``torch.load(mmap=True)``)."""
    path = os.fspath(path)
    store = _store(path, store)
    if is_ort_checkpoint(path, store):
        with store.fetched(path) as local:
            with open_checkpoint(local, verify=True) as reader:
                ck = reader.module_state()
        return from_ort(ck, path, optimizer_states=False) if MANIFEST in ck.properties else to_lightning(ck, path)
    checkpoint = _read_torch_checkpoint(path, store, mmap=True)
    checkpoint.pop("optimizer_states", None)
    return checkpoint


def read_torch_file(path: str | os.PathLike[str], map_location: Any = None,
                    weights_only: bool | None = None) -> dict[str, Any]:
    """A file that is not an ORT checkpoint, through Lightning's own ``TorchCheckpointIO`` (``weights_only=True``
    unless the caller explicitly passed False; our error for a file torch cannot load)."""
    torch_io = loaded()[0].fabric_attr("plugins.io.torch_io.TorchCheckpointIO")
    return load_torch_file(torch_io().load_checkpoint, path, map_location, weights_only)


def _read_torch_checkpoint(path: str | os.PathLike[str], store: Store, mmap: bool) -> dict[str, Any]:
    path = os.fspath(path)
    try:
        with store.fetched(path) as local:
            checkpoint = torch.load(local, map_location="cpu", weights_only=True, mmap=mmap)
    except CheckpointError:  # a remote file that cannot be fetched: ours already, naming it
        raise
    except Exception as e:  # noqa: BLE001 - torch raises many types for foreign or damaged files
        raise CorruptCheckpointError(f"neither an ORT checkpoint nor a torch checkpoint that loads with "
                                     f"weights_only=True ({type(e).__name__}: {e})", path) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CorruptCheckpointError("a torch file, but not a Lightning checkpoint (no 'state_dict')", path)
    return checkpoint


def load_ort_for_lightning(path: str | os.PathLike[str], map_location: Any = None,
                           store: Store | None = None) -> dict[str, Any]:
    """An ORT file as Lightning's loader returns a checkpoint (for ``load_from_checkpoint``, see
    ``_lightning_adapter.OrtLoading``): no random states left in."""
    checkpoint = read_lightning_checkpoint(path, store=store)
    checkpoint.pop(RNG_KEY, None)
    checkpoint.pop(DATA_KEY, None)
    checkpoint.pop(VALIDATION_KEY, None)
    checkpoint.pop(UNDECIDABLE_KEY, None)
    return map_location_of(checkpoint, map_location)


def enable_ort_loading() -> None:
    """Teach Lightning's loader (``LightningModule.load_from_checkpoint``, ``torch_io``) to read ORT files in the
    copies of Lightning imported so far, for the rest of the process (:func:`disable_ort_loading` undoes it): an
    explicit, process-wide opt-in, the one thing of ours that outlives a call. Any file that is not an ORT
    checkpoint goes to Lightning's own loader, exactly as before. Nothing else turns it on: a Trainer's loads go
    through its ``OrtCheckpointIO``; ``lightning_ort_ckpt.load_from_checkpoint`` turns it on for its call only.
    """
    _lightning_adapter.ORT_LOADING.acquire(is_ort_checkpoint, load_ort_for_lightning)


def disable_ort_loading() -> None:
    """Undo :func:`enable_ort_loading` (Lightning's loader is its own again once every enable is undone)."""
    _lightning_adapter.ORT_LOADING.release()


@contextlib.contextmanager
def serving(path: str | os.PathLike[str], checkpoint: dict[str, Any]) -> Iterator[None]:
    """Within: ``load_from_checkpoint(path)`` builds the module from ``checkpoint``, already read, instead of reading
    the file again (export and artifacts read the weights once)."""
    enable_ort_loading()
    try:
        with _lightning_adapter.serving(path, checkpoint):
            yield
    finally:
        disable_ort_loading()


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def map_location_of(checkpoint: dict[str, Any], map_location: Any) -> dict[str, Any]:
    """Apply ``torch.load``-style ``map_location`` (a device, string, dict of locations or callable) to the loaded
    tensors, which are on the CPU (location ``"cpu"``)."""
    if map_location is None:
        return checkpoint
    if "hyper_parameters" in checkpoint:  # no tensors to move there; rebuilding an OmegaConf config would resolve it
        rest = map_location_of({k: v for k, v in checkpoint.items() if k != "hyper_parameters"}, map_location)
        return {**rest, "hyper_parameters": checkpoint["hyper_parameters"]}
    if isinstance(map_location, dict):  # {"cuda:0": "cpu"}: only tensors saved at a key's location move
        target = map_location.get("cpu")
        return checkpoint if target is None else map_location_of(checkpoint, target)
    if callable(map_location) and not isinstance(map_location, torch.device):
        # torch's convention: the callable gets the CPU data and its location, and None means "leave it there"
        return apply_to_collection(checkpoint, torch.Tensor, lambda t: _or(map_location(t, "cpu"), t))
    return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.to(map_location))
