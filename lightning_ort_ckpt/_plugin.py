"""``OrtCheckpointIO``: every Lightning save writes an ORT checkpoint; loads read ORT and torch files alike.

``Trainer(plugins=[OrtCheckpointIO()])`` routes ``ModelCheckpoint`` and ``trainer.save_checkpoint`` through the
format layer (atomic, streaming). ``load_checkpoint`` decides by content: ORT files are translated back, anything
else goes to Lightning's ``TorchCheckpointIO``, so a run can switch formats midway. ``OrtCheckpointIO`` here is the class for
``pytorch_lightning`` Trainers, ``lightning_ort_ckpt.lightning.OrtCheckpointIO`` the one for ``lightning.pytorch``
(a Trainer accepts only plugins of its own copy of Lightning); both are :class:`OrtCheckpointIOMixin`.

Frozen tensors that did not change since the previous save to the same directory are not written again: the new
file's ``.data`` is a hard link to the previous one's (``share_frozen``, on by default; see ``sharing``).

A ``CheckpointIO`` receives only the checkpoint dict, yet ORT wants trainable parameters apart from buffers and
optimizer state keyed by parameter name. The plugin asks the Lightning strategy it is bound to for the module and
its optimizers (:meth:`OrtCheckpointIOMixin.bind`): ``OrtCheckpoint`` binds it in its ``setup``, and so does a small
callback that Lightning adds to every Trainer through its callback entry points (``lightning_ort_ckpt._binding``),
for a plugin used with Lightning's own ``ModelCheckpoint``. Where there is none (the plugin called directly, outside
a ``Trainer``), it saves every ``state_dict`` entry as frozen and optimizer state under index names ``param<i>``,
with a warning: the file still resumes exactly in Lightning, but ORT cannot train from it.

With ``async_save=True`` a save copies the tensors to CPU memory of its own, so training may change its own at once,
and returns (see ``staging``): it first waits until the previous save is written, so one checkpoint's worth of
staging memory is reused from save to save and saves never pile up; the parameters the optimizers hold and their
state are copied while training runs its next forward and backward pass, before any optimizer step. One background thread writes
files, deletes replaced ones and makes links in the order they were asked for, so nothing is deleted or linked
before the file it depends on is durable. An error there is raised at the next call into the plugin, or at the end
of fit (:meth:`teardown`).
"""

from __future__ import annotations

import atexit
import copy
import os
import queue
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import pytorch_lightning  # noqa: F401  (our dependency: makes its copy of Lightning count as loaded)
import torch
from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from . import _lightning_adapter, _rng, _sharing, _staging
from .errors import CheckpointError, CheckpointSaveError, CheckpointWarning, CorruptCheckpointError
from .format import GROUP_ZERO, CheckpointContents, OptimizerGroup, load_checkpoint, open_checkpoint
from .format import _store
from .format._diskio import open_regular
from .format._schema import FILE_IDENTIFIER
from .format._store import StorageOptions
from .format._writer import ExternalData
from ._namespaces import Namespace, loaded, namespace_of
from ._torch_files import load_torch_file
from ._translation.lightning_dict import MANIFEST, ModuleInfo, from_ort, plain_ort_to_lightning, to_ort, with_aliases
from ._translation.optimizers import torch_state_from_ort

RNG_KEY = "lightning_ort_ckpt.rng_states"
"""Where the RNG states travel inside the checkpoint dict (restored on load when fitting)."""

class OrtCheckpointIOMixin:
    """A Lightning ``CheckpointIO`` that writes ONNX Runtime training checkpoints (the behaviour of both
    ``OrtCheckpointIO`` classes).

    Args:
        external_data: where tensor bytes go, as in :func:`lightning_ort_ckpt.save_checkpoint`: ``"auto"`` (one file
            unless it would pass 2 GiB), ``"never"``, ``"params"`` or ``"all"``.
        ort_compatible: store float16/bfloat16/float8 tensors as float32, which ORT 1.19.2 can load (it cannot load
            the narrow types). Lossless for Lightning: the original dtypes are recorded and restored.
        async_save: write in the background; training goes on once the tensors are copied off its memory.
        share_frozen: frozen tensors (``requires_grad=False`` parameters, buffers) that did not change since the
            previous save to the same local directory are not written again: the new file's ``.data`` is a hard
            link to the previous one's (see ``sharing``), after the linked tensors are hashed against the checksums
            recorded with it (a write torch cannot see, through ``.data``, is caught). Only with
            ``external_data="auto"``, and never for URLs. On by default; ``"trusted"`` takes frozen parameters on
            torch's version counter without hashing them (a write through ``.data`` then goes unseen), ``False``
            turns sharing off.
        storage_options: fsspec's options for checkpoint URLs (``s3://...``; credentials, ``client_kwargs``...),
            see ``format.storage``; a ``storage_options`` Lightning passes to a save is merged over them.
    """

    def __init__(self, external_data: ExternalData = "auto", ort_compatible: bool = False,
                 async_save: bool = False, share_frozen: bool | Literal["trusted"] = True,
                 storage_options: StorageOptions | None = None) -> None:
        if share_frozen not in (True, False, "trusted"):
            raise ValueError(f'share_frozen must be True, False or "trusted", got {share_frozen!r}')
        self.external_data = external_data
        self.ort_compatible = ort_compatible
        self.async_save = async_save
        self.share_frozen = share_frozen
        self.storage_options = storage_options
        self._sharing = _sharing.FrozenSharing(trust_parameters=share_frozen == "trusted")
        self._worker: _Worker | None = None
        self._stager = _staging.Stager()  # staging memory of asynchronous saves, reused from save to save
        self._owner: weakref.ref[Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """The settings only (a spawn launcher pickles the Trainer): no thread, buffers or owner."""
        return {**self.__dict__, "_worker": None, "_stager": _staging.Stager(), "_owner": None,
                "_sharing": _sharing.FrozenSharing(self.share_frozen == "trusted")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        self._raise_background_error()
        options = {**(self.storage_options or {}), **(storage_options or {})}
        path = _store.local_path(path)
        strategy = self._owner_strategy(checkpoint.get("state_dict"))
        info = None
        if strategy is not None and strategy.lightning_module is not None:
            info = ModuleInfo.from_module(strategy.lightning_module, list(strategy.optimizers))
        else:
            warnings.warn(f"{path}: OrtCheckpointIO is not attached to a Trainer, so it cannot tell trainable "
                          "parameters from buffers; all are saved as frozen and optimizer state by index. Lightning "
                          "resumes it exactly; ORT can load it but not train from it.", CheckpointWarning, stacklevel=2)
        ck = to_ort({**checkpoint, RNG_KEY: _rng.capture()}, info, ort_compatible=self.ort_compatible)
        module = strategy.lightning_module if info is not None else None
        snap = (self._sharing.snapshot(ck, path, module)
                if self.share_frozen and self.external_data == "auto" and module is not None else None)
        if self.async_save:
            keep = snap.keep if snap is not None else set()
            staged, copy_later = self._stager.stage(
                ck, path, _staging.optimizer_tensors(strategy.optimizers if module is not None else []),
                module.state_dict(keep_vars=True).values() if module is not None else [], self.wait, keep)
            self._run_later(copy_later)
            if snap is not None:
                self._run_later(self._sharing.save, staged, path, snap, self.external_data, keep)
            else:
                self._run_later(_store.save, staged, path, external_data=self.external_data,
                                storage_options=options)
        elif snap is not None:
            self._sharing.save(ck, path, snap, self.external_data)
        else:
            _store.save(ck, path, external_data=self.external_data, storage_options=options)

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        self.wait()
        path = _store.local_path(path)
        if not is_ort_checkpoint(path, self.storage_options):
            torch_io = loaded()[0].fabric_attr("plugins.io.torch_io.TorchCheckpointIO")
            return load_torch_file(torch_io().load_checkpoint, path, map_location, weights_only)
        strategy = self._owner_strategy()
        checkpoint = read_lightning_checkpoint(path, strategy, self.storage_options)
        states = checkpoint.get(RNG_KEY)  # left in the dict: OrtCheckpoint may need them again (on_train_start)
        if states is not None and _fitting(strategy):  # validate/test/predict must not reseed the process
            try:
                _rng.restore(states)
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise CorruptCheckpointError(f"its saved random states are damaged ({e})", os.fspath(path)) from None
        return _map_location(checkpoint, map_location)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete a checkpoint and its ``.data`` file (after any save still being written)."""
        self._raise_background_error()
        if self.async_save:
            self._run_later(_store.remove, _store.local_path(path), self.storage_options)
        else:
            _store.remove(_store.local_path(path), self.storage_options)

    def link(self, target: str | os.PathLike[str], linkpath: str | os.PathLike[str]) -> None:
        """Make ``linkpath`` (and its ``.data``) a symbolic link to ``target``, once ``target`` is durable; on a
        store without links (``s3://``...), a copy of it."""
        self._raise_background_error()
        target, linkpath = _store.local_path(target), _store.local_path(linkpath)
        if self.async_save:
            self._run_later(_store.link_or_copy, target, linkpath, self.storage_options)
        else:
            _store.link_or_copy(target, linkpath, self.storage_options)

    def wait(self) -> None:
        """Block until background work is done; raise the first error it met."""
        if self._worker is not None:
            self._worker.join()
        self._raise_background_error()

    def teardown(self) -> None:
        """Lightning calls this at the end of fit: every file is durable when fit returns."""
        self.wait()

    def _run_later(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        if self._worker is None:
            self._worker = _Worker()
        self._worker.submit(fn, *args, **kwargs)

    def _raise_background_error(self) -> None:
        error = self._worker.take_error() if self._worker is not None else None
        if error is not None:
            if isinstance(error, CheckpointSaveError):
                raise error
            raise CheckpointSaveError(f"a background checkpoint task failed: {error}") from error

    def _owner_strategy(self, state_dict: dict[str, Any] | None = None) -> Any:
        """The strategy this plugin is bound to, while it still uses this plugin (and, given the ``state_dict``
        being saved, while its module holds those tensors); else None."""
        owner = self._owner() if self._owner is not None else None
        if owner is None:
            return None
        io = _lightning_adapter.raw_checkpoint_io(owner)
        if io is not self and getattr(io, "checkpoint_io", None) is not self:  # used bare, or wrapped (async)
            return None
        return owner if not state_dict or _holds(owner, state_dict) else None

    def bind(self, strategy: Any) -> None:
        """Remember the strategy that uses this plugin, weakly: ``OrtCheckpoint`` and the callback of
        ``lightning_ort_ckpt._binding`` call this in ``setup``, before anything is saved or restored."""
        self._owner = weakref.ref(strategy)


class _Worker:
    """One daemon thread running submitted calls in order; the first error stops the ones queued after it."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ort-ckpt-save", daemon=True)
        self._thread.start()
        atexit.register(self.join)  # a save queued just before the program ends is still written

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self._queue.put((fn, args, kwargs))

    def join(self) -> None:
        self._queue.join()

    def idle(self) -> bool:
        """Nothing queued or running: the buffers of earlier saves are free again."""
        return self._queue.unfinished_tasks == 0

    def take_error(self) -> BaseException | None:
        error, self._error = self._error, None
        return error

    def _run(self) -> None:
        while True:
            fn, args, kwargs = self._queue.get()
            try:
                if self._error is None:
                    fn(*args, **kwargs)
                elif hasattr(fn, "skipped"):  # a staging copy: release the optimizer steps waiting for it
                    fn.skipped()
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                self._error = e
            finally:
                self._queue.task_done()


def is_ort_checkpoint(path: str | os.PathLike[str], storage_options: StorageOptions | None = None) -> bool:
    """Whether ``path`` (a file or an fsspec URL) holds an ORT checkpoint (by its file identifier, not its name)."""
    if _store.is_remote(path):
        return _store.read_head(path, 8, storage_options)[4:8] == FILE_IDENTIFIER
    try:
        fd = open_regular(os.fspath(path))  # a FIFO must not block the test, nor a symlink loop raise
    except (OSError, CheckpointError):
        return False
    try:
        head = os.read(fd, 8)
    except OSError:
        return False
    finally:
        os.close(fd)
    return head[4:8] == FILE_IDENTIFIER


def read_lightning_checkpoint(path: str | os.PathLike[str], strategy: Any = None,
                              storage_options: StorageOptions | None = None, *,
                              optimizer_states: bool = True) -> dict[str, Any]:
    """The Lightning checkpoint dict of an ORT file, whether Lightning or ORT alone wrote it.

    A file ORT alone wrote carries no loop progress and no optimizer hyperparameters: with the ``strategy`` of the
    run that resumes it, loop progress is set to ORT's optimizer step and ``optimizer_states`` is built from ORT's
    moments and the live optimizers, and the module's tied parameters get their other names back (ORT stores a tied
    tensor once); without one the dict holds the weights only. ``optimizer_states=False`` reads the module's tensors
    only, lazily (views of the mapped file, verified as they are read), and leaves ``optimizer_states`` out.
    """
    path = os.fspath(path)
    with _store.fetched(path, storage_options) as local:
        if optimizer_states:
            ck = load_checkpoint(local)
        else:
            with open_checkpoint(local, verify=True) as reader:
                ck = reader.module_state()
    if MANIFEST in ck.properties:
        return from_ort(ck, path, optimizer_states=optimizer_states)
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


def read_any_checkpoint(path: str | os.PathLike[str], storage_options: StorageOptions | None = None) -> dict[str, Any]:
    """The Lightning checkpoint dict of an ORT file or of a torch ``.ckpt`` (Lightning's own format, loaded with
    ``weights_only=True``: no code in it runs), for artifacts; ``path`` may be an fsspec URL."""
    if is_ort_checkpoint(path, storage_options):
        return read_lightning_checkpoint(path, storage_options=storage_options)
    return _read_torch_checkpoint(path, storage_options, mmap=False)


def read_weights(path: str | os.PathLike[str], storage_options: StorageOptions | None = None) -> dict[str, Any]:
    """As :func:`read_any_checkpoint`, without ``optimizer_states``, for export: reads the module's tensors once,
    lazily, and none of the optimizer's (an ORT file's tensors are views of the mapped file, verified as they are
    read; a torch file is memory-mapped, ``torch.load(mmap=True)``)."""
    if is_ort_checkpoint(path, storage_options):
        return read_lightning_checkpoint(path, storage_options=storage_options, optimizer_states=False)
    checkpoint = _read_torch_checkpoint(path, storage_options, mmap=True)
    checkpoint.pop("optimizer_states", None)
    return checkpoint


def _read_torch_checkpoint(path: str | os.PathLike[str], storage_options: StorageOptions | None,
                           mmap: bool) -> dict[str, Any]:
    try:
        with _store.fetched(path, storage_options) as local:
            checkpoint = torch.load(local, map_location="cpu", weights_only=True, mmap=mmap)
    except CheckpointError:  # a remote file that cannot be fetched: ours already, naming it
        raise
    except Exception as e:  # noqa: BLE001 - torch raises many types for foreign or damaged files
        raise CorruptCheckpointError(f"neither an ORT checkpoint nor a torch checkpoint that loads with "
                                     f"weights_only=True ({type(e).__name__}: {e})", os.fspath(path)) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CorruptCheckpointError("a torch file, but not a Lightning checkpoint (no 'state_dict')", os.fspath(path))
    return checkpoint


def load_ort_for_lightning(path: str | os.PathLike[str], map_location: Any = None) -> dict[str, Any]:
    """An ORT file as Lightning's loader returns a checkpoint (for ``load_from_checkpoint`` and the spawn launcher's
    weights hand-back, see ``_lightning_adapter.install_ort_loader``): no random states restored, none left in."""
    checkpoint = read_lightning_checkpoint(path)
    checkpoint.pop(RNG_KEY, None)
    return _map_location(checkpoint, map_location)


def _holds(strategy: Any, state_dict: dict[str, Any]) -> bool:
    """Whether the strategy's module owns the memory of the checkpoint's tensors (state_dict entries are views)."""
    module = strategy.lightning_module
    if module is None:
        return False
    live = module.state_dict(keep_vars=True)
    return any(isinstance(t, torch.Tensor) and k in live and live[k].data_ptr() == t.data_ptr()
               for k, t in state_dict.items())


def _trainer_state(strategy: Any) -> Any:
    module = strategy.lightning_module if strategy is not None else None
    trainer = _lightning_adapter.trainer_of(module) if module is not None else None
    return trainer.state if trainer is not None else None


def _trainer_running(strategy: Any) -> bool:
    state = _trainer_state(strategy)
    return state is not None and state.status.value == "running"  # TrainerStatus.RUNNING in either Lightning


def _fitting(strategy: Any) -> bool:
    state = _trainer_state(strategy)
    return state is not None and state.fn is not None and state.fn.value == "fit"  # TrainerFn.FITTING


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _map_location(checkpoint: dict[str, Any], map_location: Any) -> dict[str, Any]:
    """Apply ``torch.load``-style ``map_location`` (a device, string, dict of locations or callable) to the loaded
    tensors, which are on the CPU (location ``"cpu"``)."""
    if map_location is None:
        return checkpoint
    if isinstance(map_location, dict):  # {"cuda:0": "cpu"}: only tensors saved at a key's location move
        target = map_location.get("cpu")
        return checkpoint if target is None else _map_location(checkpoint, target)
    if callable(map_location) and not isinstance(map_location, torch.device):
        # torch's convention: the callable gets the CPU data and its location, and None means "leave it there"
        return apply_to_collection(checkpoint, torch.Tensor, lambda t: _or(map_location(t, "cpu"), t))
    return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.to(map_location))


class OrtCheckpointIO(OrtCheckpointIOMixin, CheckpointIO):
    """A Lightning ``CheckpointIO`` writing ONNX Runtime training checkpoints, for ``pytorch_lightning`` Trainers
    (``lightning_ort_ckpt.lightning.OrtCheckpointIO`` is the one for ``lightning.pytorch``); arguments as in
    :class:`OrtCheckpointIOMixin`."""


def plugin_class_for(ns: Namespace) -> type[OrtCheckpointIOMixin]:
    """The ``OrtCheckpointIO`` class of that copy of Lightning."""
    if ns.trainer.__name__ == "lightning.pytorch":
        from .lightning import OrtCheckpointIO as for_lightning

        return for_lightning
    return OrtCheckpointIO
