"""``OrtCheckpointIO``: every Lightning save writes an ORT checkpoint; loads read ORT and torch files alike.

``Trainer(plugins=[OrtCheckpointIO()])`` routes ``ModelCheckpoint`` and ``trainer.save_checkpoint`` through the
format layer (atomic, streaming) and the store of each path (``format._store``: the local disk, or any fsspec URL).
``load_checkpoint`` decides by content (``_reading``): ORT files are translated back, anything else goes to
Lightning's ``TorchCheckpointIO``, so a run can switch formats midway. ``OrtCheckpointIO`` here is the class for
``pytorch_lightning`` Trainers, ``lightning_ort_ckpt.lightning.OrtCheckpointIO`` the one for ``lightning.pytorch``
(a Trainer accepts only plugins of its own copy of Lightning); both are :class:`OrtCheckpointIOMixin`.

A ``CheckpointIO`` receives only the checkpoint dict, yet ORT wants trainable parameters apart from buffers and
optimizer state keyed by parameter name. The plugin asks the Lightning strategy it is bound to for the module and
its optimizers (:meth:`OrtCheckpointIOMixin.bind`): ``OrtCheckpoint`` and ``BindCheckpointIO`` bind it in their
``setup``, a Fabric script with ``plugin.bind(fabric.strategy)``. Left unbound (deprecated, with a ``FutureWarning``;
goes in 0.6) it binds itself when Lightning hands it to a strategy (``_lightning_adapter.CHECKPOINT_IO_ASSIGNMENT``),
or, in a process that received its Trainer pickled (``ddp_spawn``), at the first save or load its strategy asks.
Called directly, outside a Trainer, it saves every
``state_dict`` entry as frozen and optimizer state under index names ``param<i>``, with a warning: ORT cannot train
from such a file. The random states a file carries are restored when training starts
(:meth:`OrtCheckpointIOMixin.restore_random_states`, called by ``OrtCheckpoint``, ``BindCheckpointIO``, or the
callback the plugin adds to a Trainer that has neither: ``_train_start``), after Lightning built the data loaders,
as in the uninterrupted run.

Frozen tensors that did not change since the previous save to the same directory are not written again where the
store can link files: the new file's ``.data`` is a hard link to one of two independent copies written before
(``share_frozen``, on by default; see ``_sharing``).

With ``async_save=True`` a save copies the tensors to CPU memory of its own (``_staging``), so training may change
its own at once, and returns; one background thread (``_async_saver``) writes files, deletes replaced ones and
makes links in the order they were asked for. An error there is raised at the next call into the plugin, or at the
end of fit (:meth:`~OrtCheckpointIOMixin.teardown`), which also stops the thread and frees the staging memory.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Literal

import pytorch_lightning  # noqa: F401  (our dependency: makes its copy of Lightning count as loaded)
from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO

from . import _sharing
from ._dcp import _strategies
from ._fit_state import _train_start, _validation_resume
from ._lightning import _fabric, _lightning_adapter
from ._recovery import _promotion, _signals
from ._saving import _save_contents, _staging
from ._saving._async_saver import BackgroundSaves, InlineSaves, SaveExecutor
from ._lightning._namespaces import loaded
from ._plugin_binding import StrategyBinding
from ._restore._reading import is_ort_checkpoint, map_location_of, read_contents, read_torch_file, to_lightning
from .errors import CheckpointConfigError, CheckpointError, CheckpointSaveError, CheckpointWarning
from .format import CheckpointContents
from .format._store import StorageOptions, Store, Stores, keep_spares, local_path, wait_for_cleanup
from .format._writer import ExternalData

_EXTERNAL_DATA = ("auto", "never", "params", "all")
_SETTINGS = ("external_data", "ort_compatible", "async_save", "share_frozen", "storage_options",
             "fast_forward_iterables")


class OrtCheckpointIOMixin(StrategyBinding):
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
            link to the previous one's (see ``_sharing``), after the linked tensors are hashed against the checksums
            recorded with it (a write torch cannot see, through ``.data``, is caught). Only with
            ``external_data="auto"``, and never for URLs. On by default; ``"trusted"`` takes frozen parameters on
            torch's version counter without hashing them (a write through ``.data`` then goes unseen), ``False``
            turns sharing off.
        storage_options: fsspec's options for checkpoint URLs (``s3://...``; credentials, ``client_kwargs``...),
            see ``format._fsspec_store``; a ``storage_options`` Lightning passes to a save is merged over them.
        fast_forward_iterables: a fit resumed inside an epoch reads and drops the batches already trained from a
            training loader of an ``IterableDataset`` (which has no sampler to skip them at); by default it warns
            that they are trained again. Map-style loaders skip at the sampler, without reading (``_data_position``).
    """

    def __init__(self, external_data: ExternalData = "auto", ort_compatible: bool = False,
                 async_save: bool = False, share_frozen: bool | Literal["trusted"] = True,
                 storage_options: StorageOptions | None = None, fast_forward_iterables: bool = False) -> None:
        if share_frozen not in (True, False, "trusted"):
            raise CheckpointConfigError(f'share_frozen must be True, False or "trusted", got {share_frozen!r}')
        if external_data not in _EXTERNAL_DATA:
            raise CheckpointConfigError(f"external_data must be one of {', '.join(map(repr, _EXTERNAL_DATA))}, "
                                        f"got {external_data!r}")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise CheckpointConfigError(f"storage_options must be a dict of fsspec options, got "
                                        f"{type(storage_options).__name__}")
        self.external_data = external_data
        self.ort_compatible = ort_compatible
        self.share_frozen = share_frozen
        self.storage_options = storage_options
        self.fast_forward_iterables = fast_forward_iterables
        self._start(async_save)
        self._assignment = _lightning_adapter.CHECKPOINT_IO_ASSIGNMENT.hold_while(self)  # deprecated; until ``bind``

    def _start(self, async_save: bool) -> None:
        """The per-process state: none of it travels to a spawned process (the launcher pickles the Trainer)."""
        self._sharing = _sharing.FrozenSharing(trust_parameters=self.share_frozen == "trusted")
        self._executors: dict[bool, SaveExecutor] = {False: InlineSaves(), True: BackgroundSaves()}
        self._executor = self._executors[bool(async_save)]  # where every save and its file work run
        self._owner: weakref.ref[Any] | None = None
        self._fabric: _fabric.FabricSaves | None = None  # the saves of the Fabric strategy this plugin serves
        self._attachment: _strategies.Attachment | None = None  # how a sharded strategy is served (``attach``)
        self._unwrap: Callable[[], None] | None = None  # what ``teardown`` undoes of it
        self._held: tuple[str, Any, str] | None = None  # what "last" resolution read: (path, what, read from)
        self._train_start = _train_start.TrainStart()  # what a resumed fit restores when training starts
        self._reentry = _signals.Reentry()  # its calls in progress: a save in a signal handler waits for them
        self._promotion: Callable[[str], str | None] | None = None  # where a save goes first (_tiers, _promotion)
        self._spares: Callable[[], None] | None = None  # from the first save to teardown: ``format._store.keep_spares``
        self._assignment = _nothing  # lets go of the setter wrap's hold (``__init__`` takes it)
        self._found_by: str | None = None  # how the strategy was found without being bound, until that is warned of

    def __getstate__(self) -> dict[str, Any]:
        """The settings only: no thread, buffers or owner."""
        return {k: getattr(self, k) for k in _SETTINGS}

    def __setstate__(self, state: dict[str, Any]) -> None:
        async_save, self.storage_options = state.pop("async_save"), state.pop("storage_options", None)
        state.setdefault("fast_forward_iterables", False)
        self.__dict__.update(state)
        self._start(async_save)

    @property
    def storage_options(self) -> StorageOptions | None:
        return self.stores.storage_options

    @storage_options.setter
    def storage_options(self, value: StorageOptions | None) -> None:
        """New options, new stores: each built at its first path and kept (``format._store.Stores``)."""
        self.stores = Stores(value)

    @property
    def async_save(self) -> bool:
        return self._executor is self._executors[True]

    @async_save.setter
    def async_save(self, value: bool) -> None:
        """Switch executors between saves (a benchmark compares both): the work of the previous one ends first."""
        self.wait()
        self._executor = self._executors[bool(value)]

    # -- saving -------------------------------------------------------------------------------------------------
    @_signals.guarded(defer=True)
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        self._raise_background_error()
        self._warn_if_found()
        if self._spares is None:  # saves written over the files saves before them retired, until teardown
            self._spares = keep_spares()
        if _lightning_adapter.launcher_weights(path, checkpoint):
            return _save_torch(checkpoint, path)  # Lightning's launcher hands weights to the main process
        target = local_path(path)
        path = (self._promotion(target) if self._promotion else None) or target  # a fast-tier path first, copied
        fabric = self._fabric.layout(checkpoint) if self._fabric is not None else None
        strategy = self._owner_strategy(checkpoint.get("state_dict")) if fabric is None else None
        ck, strategy = _save_contents.ort_contents(checkpoint, path, fabric, strategy, self.data_position,
                                                   self.ort_compatible)
        module = strategy.lightning_module if strategy is not None else None
        store = self.stores.of(path, storage_options)
        decided = self._sharing.decide(ck, path, module if self.share_frozen else None, self.external_data, store)
        owned = self._executor.own(
            ck, path, _staging.optimizer_tensors(strategy.optimizers if module is not None else []),
            module.state_dict(keep_vars=True).values() if module is not None else [], self.wait, decided.keep,
            direct=store.in_memory(path))  # (written at memory speed: _async_saver)
        self._executor.run(decided.write, owned.contents, path, owned.keep, store, owned.when_read)
        if path != target:
            self._executor.run(_promotion.copy_verified, path, target, self.stores.of(target, storage_options))
        if _signals.must_be_durable(target):  # Lightning's requeue save: the job is requeued, and killed, next
            self.wait()

    def promote(self, source: Callable[[str], str | None] | None) -> None:
        """Until called again, a save of a path for which ``source`` names another (a fast-tier path) is written there
        and then copied to its path (``_promotion``); None: saves go where they are asked to."""
        self._promotion = source

    # -- loading ------------------------------------------------------------------------------------------------
    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        self.wait()
        self._warn_if_found()
        path = local_path(path)
        held, self._held = self._held, None
        found = held[1] if held is not None and held[0] == path else None
        store = self.stores.of(path)
        if found is None and not is_ort_checkpoint(path, store):
            return read_torch_file(path, map_location, weights_only)
        strategy = self._owner_strategy()
        if found is None:
            found = read_contents(path, store)
        elif held is not None and held[2] != path:  # rank 0's choice, for this rank's: the Trainer names it
            path = held[2]
            if strategy is not None and _lightning_adapter.fitting(strategy):
                _lightning_adapter.set_resumed_path(_lightning_adapter.trainer_of(strategy.lightning_module), path)
        checkpoint = to_lightning(found, path, strategy) if isinstance(found, CheckpointContents) else found
        return _fabric.fabric_state(map_location_of(self.loaded(checkpoint, path), map_location))

    def data_position(self) -> dict[str, Any]:
        """``{DATA_KEY: where each training loader of the bound fit stands}``, with ``{VALIDATION_KEY: step}`` at a
        training batch's end that validation follows (``_validation_resume``); ``{}`` outside a fit."""
        return {**self._train_start.position(), **_validation_resume.due(self._owner_strategy())}

    def loaded(self, checkpoint: dict[str, Any], path: str) -> dict[str, Any]:
        """``checkpoint`` (read from ``path``) is what the bound fit resumes from: its random states and data
        position are restored when training starts (:meth:`restore_random_states`). Returns it."""
        strategy = self._owner_strategy()
        fitting = strategy is not None and _lightning_adapter.fitting(strategy)
        trainer = _lightning_adapter.trainer_of(strategy.lightning_module) if fitting else None
        self._train_start.resume_from(checkpoint, path, trainer, self)
        return checkpoint

    def hold(self, path: str, found: Any, source: str | None = None) -> None:
        """What resolving ``ckpt_path="last"`` read from ``source`` (``path`` itself by default; another rank's choice
        where this rank's listing chose ``path``): the load of ``path`` that follows takes it, not a re-read, and the
        Trainer's ``ckpt_path`` names ``source``."""
        self._held = (path, found, source if source is not None else path)

    def restore_random_states(self, trainer: Any) -> None:
        """Restore the random states of the checkpoint this fit resumed from, where the uninterrupted run had them:
        called when training starts (``on_train_start``, by ``OrtCheckpoint``, ``BindCheckpointIO`` or
        ``_train_start.RestoreRandomStates``; see :func:`_train_start.restore`)."""
        self._train_start.at_train_start(trainer)

    # -- the directory ------------------------------------------------------------------------------------------
    @_signals.guarded(defer=False)
    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete a checkpoint and its ``.data`` file (after any save still being written). Retention calls this
        once the file that replaces it is stored: a deletion that fails is a ``CheckpointWarning`` naming the file,
        which stays, and training goes on."""
        self._raise_background_error()
        path = local_path(path)
        self._executor.run(self._retire, self.stores.of(path), path)

    def _retire(self, store: Store, path: str) -> None:
        """Remove through the store, first keeping a reserve of a shared ``.data`` that is a copy's last name."""
        if store.links:
            self._sharing.before_remove(path)
        _remove(store, path)

    @_signals.guarded(defer=False)
    def link(self, target: str | os.PathLike[str], linkpath: str | os.PathLike[str]) -> None:
        """Make ``linkpath`` (and its ``.data``) a symbolic link to ``target``, once ``target`` is durable; on a
        store without links (``s3://``...), a copy of it."""
        self._raise_background_error()
        target, linkpath = local_path(target), local_path(linkpath)
        self._executor.run(self.stores.of(linkpath).link_or_copy, target, linkpath)

    @_signals.guarded(defer=False)
    def run_in_order(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` where this plugin's saves run (inline, or on the background queue with
        ``async_save=True``), in order with the saves, deletions and links asked for before and after it."""
        self._executor.run(fn, *args)

    # -- life cycle ---------------------------------------------------------------------------------------------
    @_signals.guarded(defer=False)
    def wait(self) -> None:
        """Block until background work is done; raise the first error it met."""
        self._executor.join()
        self._raise_background_error()

    def teardown(self) -> None:
        """Lightning calls this at the end of fit (and of validate, test, predict): every file is durable, every
        replaced file deleted, the background thread stopped, the staging memory freed and the optimizer hook
        removed when it returns; an error of a background save is raised here."""
        errors = [executor.close() for executor in self._executors.values()]
        self._sharing.close()
        self._held = None
        self._train_start.end_fit()
        unwrap, self._unwrap = self._unwrap, None
        if unwrap is not None:
            unwrap()
        spares, self._spares = self._spares, None
        if spares is not None:
            spares()
        wait_for_cleanup()
        _raise(next((e for e in errors if e is not None), None))

    def _raise_background_error(self) -> None:
        _raise(self._executor.take_error())



def _save_torch(state_dict: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """The module's weights that Lightning's spawn and fork launchers hand from the worker to the main process,
    which reads them with its own ``CheckpointIO``: Lightning's ``TorchCheckpointIO`` where only the worker's
    ``OrtCheckpoint`` installed ours. Lightning's transient file, written by Lightning's own writer, in a folder
    of its own, which the launcher removes."""
    loaded()[0].fabric_attr("plugins.io.torch_io.TorchCheckpointIO")().save_checkpoint(state_dict, path)


def _nothing() -> None:
    """No hold on the setter wrap to let go of: a plugin unpickled in a spawned process takes none."""


def _raise(error: BaseException | None) -> None:
    if error is not None:
        if isinstance(error, CheckpointSaveError):
            raise error
        raise CheckpointSaveError(f"a background checkpoint task failed: {error}") from error


def _remove(store: Store, path: str) -> None:
    """``store.remove``, with a failure as a warning: only a clean-up failed, the newer checkpoint is stored."""
    try:
        store.remove(path)
    except (CheckpointError, OSError) as e:
        text = str(e) if isinstance(e, CheckpointError) else f"{path}: cannot delete it ({type(e).__name__}: {e})"
        warnings.warn(f"{text}; the old checkpoint stays there, training goes on", CheckpointWarning, stacklevel=2)


class OrtCheckpointIO(OrtCheckpointIOMixin, CheckpointIO):
    """A Lightning ``CheckpointIO`` writing ONNX Runtime training checkpoints, for ``pytorch_lightning`` Trainers
    (``lightning_ort_ckpt.lightning.OrtCheckpointIO`` is the one for ``lightning.pytorch``); arguments as in
    :class:`OrtCheckpointIOMixin`."""
