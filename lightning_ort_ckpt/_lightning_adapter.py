"""Every private Lightning name this project uses, in one place: a new Lightning release is this file to check.

Supported: ``pytorch-lightning`` / ``lightning`` from the floor pinned in ``pyproject.toml`` (2.5.3, the first with
``ModelCheckpoint(save_on_exception=...)``) to the newest release; ``scripts/floor.sh`` (run by ``.ci/run``) runs the
smoke tests on the floor, the whole suite runs on the newest.

Three kinds of use:

- **reads** of private attributes (:func:`raw_checkpoint_io`, :func:`resolve_ckpt_dir`, :func:`validation_follows`,
  :func:`trainer_of`) and of the fit loop's private state layout (:func:`fit_loop_state_at_step`): functions here;
- **overrides and calls** of ``ModelCheckpoint``'s private methods by ``OrtCheckpoint``: listed in
  :data:`MODEL_CHECKPOINT_PRIVATE` (the tests check that every supported Lightning has them);
- **the one wrap** of a Lightning function, :func:`install_ort_loader`: Lightning's torch loader (``_load``, bound
  as ``pl_load`` in ``core.saving`` and in ``TorchCheckpointIO``'s module) learns to read ORT files, recognized by
  content; everything else loads as before. It is what lets ``LightningModule.load_from_checkpoint`` read ORT files,
  and the main process of the spawn/fork launchers read the weights file its worker wrote with ``OrtCheckpointIO``
  (``_MultiProcessingLauncher`` reads it with the main process's ``TorchCheckpointIO``). ``import
  lightning_ort_ckpt`` installs it, in copies of Lightning already imported and, through an import hook, in those
  imported later; installing twice is a no-op. Within :func:`serving` it hands back a checkpoint dict already read
  instead of reading the file again (export reads the weights once, then builds the module with
  ``load_from_checkpoint``). This module imports neither torch nor Lightning.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import importlib.abc
import importlib.machinery
import os
import shutil
import sys
import tempfile
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

# (module, attribute) of Lightning's torch loader, per copy of Lightning: what install_ort_loader wraps
LOADER_BINDINGS = (
    ("pytorch_lightning.core.saving", "pl_load"),
    ("lightning_fabric.plugins.io.torch_io", "pl_load"),
    ("lightning.pytorch.core.saving", "pl_load"),
    ("lightning.fabric.plugins.io.torch_io", "pl_load"),
)

MODEL_CHECKPOINT_PRIVATE = (
    # methods OrtCheckpoint overrides (ModelCheckpoint calls them)
    "_save_topk_checkpoint", "_save_last_checkpoint", "_save_checkpoint", "_remove_checkpoint", "_link_checkpoint",
    "_find_last_checkpoints", "_monitor_candidates",
    # methods it calls
    "_should_skip_saving_checkpoint", "_get_metric_interpolated_filepath_name", "_should_remove_checkpoint",
    "_ModelCheckpoint__resolve_ckpt_dir",
)
"""The private methods of ``ModelCheckpoint`` that ``OrtCheckpoint`` overrides or calls. It also sets
``_every_n_train_steps``, ``_every_n_epochs`` and ``_train_time_interval`` (to combine triggers) and reads
``_last_global_step_saved``, and replaces ``_fs`` to pass ``storage_options`` (:func:`set_checkpoint_filesystem`)."""

_MARK = "reads_ort_checkpoints"
_SERVED: contextvars.ContextVar[tuple[str, Any] | None] = contextvars.ContextVar("ort_ckpt_served", default=None)


def raw_checkpoint_io(strategy: Any) -> Any:
    """The ``CheckpointIO`` given to ``strategy``, or None: the public ``checkpoint_io`` property would create and
    install a ``TorchCheckpointIO`` when there is none."""
    return strategy.__dict__.get("_checkpoint_io")


def resolve_ckpt_dir(callback: Any, trainer: Any) -> Any:
    """The directory ``ModelCheckpoint`` saves into for this trainer (its ``dirpath``, or the logger's)."""
    return callback._ModelCheckpoint__resolve_ckpt_dir(trainer)


def set_checkpoint_filesystem(callback: Any, dirpath: str, storage_options: dict[str, Any]) -> None:
    """Give ``ModelCheckpoint``'s own file-system calls (``_fs``: does a file exist, is the folder empty) the
    ``storage_options`` of its ``dirpath``; Lightning builds it without options."""
    from fsspec.core import url_to_fs

    callback._fs = url_to_fs(dirpath, **storage_options)[0]


def validation_follows(trainer: Any) -> bool | None:
    """The epoch loop's own test of whether validation runs after the current training batch; None where this
    Lightning has no such test."""
    loop = trainer.fit_loop
    try:
        return bool(loop.epoch_loop._should_check_val_fx(loop._data_fetcher))
    except AttributeError:
        return None


def trainer_of(module: Any) -> Any:
    """The Trainer a LightningModule is attached to, or None (``module.trainer`` raises when there is none)."""
    return module._trainer


def fit_loop_state_at_step(fit_loop: Any, step: int) -> dict[str, Any]:
    """A fresh fit loop's state with ``step`` optimizer steps done: Lightning derives ``global_step`` from these
    counters, not from the checkpoint's ``global_step`` key."""
    state = copy.deepcopy(fit_loop.state_dict())
    state["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"].update(
        ready=step, completed=step)
    state["epoch_loop.manual_optimization.optim_step_progress"]["total"].update(ready=step, completed=step)
    state["epoch_loop.state_dict"]["_batches_that_stepped"] = step
    return state


# -- the loader wrap --------------------------------------------------------------------------------------------
def install_ort_loader() -> None:
    """Teach Lightning's torch loader to read ORT files, in every copy of Lightning, now or when it is imported."""
    for module_name, attr in LOADER_BINDINGS:
        module = sys.modules.get(module_name)
        if module is not None:
            _wrap(module, attr)
    if not any(isinstance(f, _LoaderHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _LoaderHook())


@contextlib.contextmanager
def serving(path: str | os.PathLike[str], checkpoint: Any) -> Iterator[None]:
    """Within: Lightning's loader returns ``checkpoint`` for ``path`` instead of reading the file, so
    ``load_from_checkpoint`` builds the module (hparams, ``on_load_checkpoint``, strict loading) from what the caller
    has read already."""
    token = _SERVED.set((os.path.abspath(os.fspath(path)), checkpoint))
    try:
        yield
    finally:
        _SERVED.reset(token)


def _wrap(module: types.ModuleType, attr: str) -> None:
    original = getattr(module, attr, None)
    if original is not None and not getattr(original, _MARK, False):
        setattr(module, attr, _ort_aware(original))


def _ort_aware(original: Callable[..., Any]) -> Callable[..., Any]:
    def pl_load(path_or_url: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        from ._plugin import is_ort_checkpoint, load_ort_for_lightning  # torch and Lightning: loaded by now

        served = _SERVED.get()
        if (served is not None and isinstance(path_or_url, (str, os.PathLike))
                and os.path.abspath(os.fspath(path_or_url)) == served[0]):
            return served[1]
        if isinstance(path_or_url, (str, os.PathLike)):
            if not os.fspath(path_or_url).startswith(("http://", "https://")) and is_ort_checkpoint(path_or_url):
                return load_ort_for_lightning(path_or_url, map_location)
            from ._torch_files import load_torch_file  # weights_only=True unless asked otherwise; our error

            weights_only = args[0] if args else kwargs.pop("weights_only", None)
            return load_torch_file(original, path_or_url, map_location, weights_only)
        elif _is_ort_stream(path_or_url):
            with tempfile.TemporaryDirectory(prefix="ort-ckpt-") as tmp:
                path = os.path.join(tmp, "checkpoint.ckpt")
                with open(path, "wb") as f:
                    shutil.copyfileobj(path_or_url, f)
                return load_ort_for_lightning(path, map_location)
        return original(path_or_url, map_location, *args, **kwargs)

    setattr(pl_load, _MARK, True)
    pl_load.__wrapped__ = original  # type: ignore[attr-defined]
    return pl_load


def _is_ort_stream(stream: Any) -> bool:
    """Whether a seekable binary file object holds an ORT checkpoint (its position is left as it was)."""
    from .format._schema import FILE_IDENTIFIER

    if not all(callable(getattr(stream, m, None)) for m in ("read", "seek", "tell")):
        return False
    start = stream.tell()
    head = stream.read(8)
    stream.seek(start)
    return isinstance(head, bytes) and head[4:8] == FILE_IDENTIFIER


class _LoaderHook(importlib.abc.MetaPathFinder):
    """Wraps the loader in a copy of Lightning imported after ``lightning_ort_ckpt``: once one of
    :data:`LOADER_BINDINGS`' modules has run, its loader binding is replaced."""

    _targets = dict(LOADER_BINDINGS)

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None) -> Any:
        if fullname not in self._targets:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module
        attr = self._targets[fullname]

        def exec_and_wrap(module: types.ModuleType) -> None:
            exec_module(module)
            _wrap(module, attr)

        spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]  # this spec's loader only
        return spec
