"""Where a fit stands in its training data: the data position every checkpoint of a fit carries, and the resume that
puts each training loader back there, so a fit resumed in the middle of an epoch trains on exactly the batches the
uninterrupted run trained on.

What fixes an epoch's order is drawn when its first indices are asked for: ``RandomSampler`` seeds a generator of
its own from torch's (or takes the loader's ``generator``), ``DistributedSampler`` shuffles by its seed and epoch, a
custom sampler may use Python's or NumPy's generator. So each training loader's index sampler is wrapped while its
iterator is made (:func:`_torch_compat.index_sampler_as`), and its first draw records those states (the global
generators, the samplers' own, the samplers' epoch); the iterator's count of handed-out batches says how far the
epoch went. A checkpoint saves both, as plain numbers and hex strings (:data:`DATA_KEY`).

A resumed fit makes each loader's iterator as Lightning does, with the random states of the original iterator's
making (its workers' base seed), and at the first draw sets the recorded states, draws the same order, skips the
batches already trained at the sampler (their data is never loaded) and puts the random states back. A loader
without a sampler (an ``IterableDataset``) cannot skip without reading: with ``fast_forward_iterables`` its
batches are read and dropped, otherwise a warning names what repeats. Loaders with a ``state_dict`` of their own
(torchdata's ``StatefulDataLoader``) are left to Lightning, which saves and restores them itself.
"""

from __future__ import annotations

import collections
import itertools
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import _rng
from .._lightning import _lightning_adapter
from .._translation import _torch_compat
from ..errors import CheckpointWarning, CorruptCheckpointError

DATA_KEY = "lightning_ort_ckpt.data_position"
"""Where the data position travels inside the checkpoint dict: ``{"epoch", "batches", "loaders": [...]}``."""


@dataclass
class _Loader:
    """One training loader: its current iterator and what fixed that iterator's order."""

    loader: Any
    iterator: Any = None
    creation: dict[str, Any] | None = None  # torch's states when the iterator was made: its workers' base seed
    draw: dict[str, Any] | None = None  # every random state when the current order was drawn
    offset: int = 0  # batches of this epoch skipped, not handed out, by the current iterator

    def saved(self, ahead: int) -> dict[str, Any]:
        handed = _torch_compat.iterator_yielded(self.iterator) if self.iterator is not None else 0
        return {"consumed": max(0, self.offset + handed - ahead), "creation": self.creation, "draw": self.draw}


class TrainData:
    """The data positions of the fits of one strategy: watches the training loaders Lightning hands the strategy,
    says where they stand (:meth:`position`), and resumes them (:meth:`resume_at`)."""

    def __init__(self, strategy: Any, fast_forward_iterables: bool = False,
                 data_ready: Callable[[Any], None] = lambda strategy: None) -> None:
        self._strategy = weakref.ref(strategy)
        self._data_ready = data_ready  # told of every loader Lightning sets up (the plugin's staging waits then)
        self._fast_forward = fast_forward_iterables
        self._watched: dict[int, _Loader] = {}
        self._pending: list[Any] = []  # per training loader: the saved position to resume at, or None
        self._saved: Any = None  # the position of the checkpoint the fit resumes from, until train start
        self._path = ""
        self._unwrap = _lightning_adapter.wrap_process_dataloader(strategy, self._watch)

    def _trainer(self) -> Any:
        strategy = self._strategy()
        module = strategy.lightning_module if strategy is not None else None
        return _lightning_adapter.trainer_of(module) if module is not None else None

    def _watch(self, loader: Any) -> None:
        """A loader Lightning prepared: its iterators are made through :meth:`_make` from now on."""
        strategy = self._strategy()
        if strategy is not None:
            self._data_ready(strategy)
        if not isinstance(loader, torch.utils.data.DataLoader) or id(loader) in self._watched or _stateful(loader):
            return
        self._watched[id(loader)] = _Loader(loader)
        _torch_compat.intercept_iterators(loader, lambda original: self._make(loader, original))

    # -- saving ---------------------------------------------------------------------------------------------------
    def position(self) -> dict[str, Any] | None:
        """Where each training loader of the fit stands; None outside a fit's training."""
        trainer = self._trainer()
        loaders = _lightning_adapter.train_loaders(trainer) if trainer is not None else []
        if not loaders:
            return None
        # a batch fetched but not trained is not consumed: the resumed fit trains it (Lightning restarts it)
        ahead = _lightning_adapter.prefetched_batches(trainer) + _lightning_adapter.batches_in_flight(trainer)
        records = [self._watched.get(id(dl)) for dl in loaders]
        saved = [r.saved(ahead) if r is not None and r.loader is dl else None for r, dl in zip(records, loaders)]
        total = trainer.num_training_batches
        return {"epoch": int(trainer.current_epoch), "loaders": saved,
                "batches": int(total) if total != float("inf") else -1}

    # -- resuming -------------------------------------------------------------------------------------------------
    def resume_at(self, position: Any, path: str) -> None:
        """The fit resumes from the checkpoint ``path``, which saved ``position`` (None: it has none): each training
        loader's next iterator starts where it stood, where that is inside an epoch."""
        self._path, self._saved = path, position
        if position is None:
            self._pending = []
            return
        loaders = position.get("loaders") if isinstance(position, dict) else None
        batches = position.get("batches", -1) if isinstance(position, dict) else -1
        if not isinstance(loaders, list) or not isinstance(batches, int):
            raise CorruptCheckpointError("its data position is damaged (no list of loaders)", path)
        self._pending = [p if isinstance(p, dict) and 0 < _count(p.get("consumed"), path)
                         and (batches < 0 or p["consumed"] < batches) else None for p in loaders]

    def check_resumed(self, trainer: Any, inside_epoch: bool) -> None:
        """At train start, after Lightning restored its loops: a resume at an epoch boundary needs no position (the
        caller draws the next epoch again); one inside an epoch without a position for a loader says so."""
        saved, self._saved = self._saved, None
        if not inside_epoch:
            self._pending = []
            return
        done = _lightning_adapter.train_batches_done(trainer)
        entries = saved.get("loaders", []) if isinstance(saved, dict) else []
        for i, dl in enumerate(_lightning_adapter.train_loaders(trainer)):
            if done == 0 or (i < len(entries) and entries[i] is not None) or _stateful(dl):
                continue
            why = ("was saved without its data position (by ORT, Fabric or a version before 0.5)" if saved is None
                   else f"holds no data position for training loader {i} ({type(dl).__name__}, not a DataLoader)")
            warnings.warn(f"{self._path}: the checkpoint {why}: epoch {trainer.current_epoch} restarts from its "
                          f"first batch, and the {done} batches trained before the save are trained again",
                          CheckpointWarning, stacklevel=2)
            return

    def _index(self, loader: Any) -> int | None:
        """Which training loader of the current fit ``loader`` is (None: a validation loader, or no fit)."""
        trainer = self._trainer()
        loaders = _lightning_adapter.train_loaders(trainer) if trainer is not None else []
        return next((i for i, dl in enumerate(loaders) if dl is loader), None)

    def _peek(self, index: int | None) -> Any:
        """The saved position training loader ``index`` resumes at, or None."""
        return self._pending[index] if index is not None and index < len(self._pending) else None

    def _take(self, index: int | None) -> Any:
        """:meth:`_peek`, used up."""
        pending = self._peek(index)
        if pending is not None:
            self._pending[index] = None  # type: ignore[index]
        return pending

    def _make(self, loader: Any, original: Any) -> Any:
        """``iter(loader)``: a training loader's iterator gets an index sampler that records its draw, and, resuming,
        its workers' base seed as the original iterator had it, and its position."""
        record = self._watched[id(loader)]
        index = self._index(loader)
        if index is None:
            return original()
        sized = not isinstance(loader.dataset, torch.utils.data.IterableDataset)
        pending = self._peek(index) if sized else self._take(index)  # a sized one's is used at its first draw
        creation = pending.get("creation") if pending is not None else None
        before = torch.get_rng_state()
        if isinstance(creation, dict):
            _set_states(creation, loader, self._path, everything=False)
        record.creation = creation if isinstance(creation, dict) else _pack(_rng.capture(), loader)
        if sized:
            with _torch_compat.index_sampler_as(loader, lambda own: _IndexSampler(own, self, record)):
                iterator = original()
        else:
            iterator = original()
        if isinstance(creation, dict):
            torch.set_rng_state(before)
        record.iterator, record.offset = iterator, 0
        if pending is not None and not sized:
            self._skip_unsized(index, loader, iterator, _count(pending.get("consumed"), self._path))
        return iterator

    def _skip_unsized(self, index: int, loader: Any, iterator: Any, consumed: int) -> None:
        if not self._fast_forward:
            warnings.warn(f"{self._path}: training loader {index} reads an IterableDataset, which cannot be skipped "
                          f"without reading it: its {consumed} batches trained before the save are trained again "
                          "(OrtCheckpointIO(fast_forward_iterables=True) reads and drops them instead)",
                          CheckpointWarning, stacklevel=2)
            return
        for _ in range(consumed):
            next(iterator, None)

    def first_draw(self, record: _Loader) -> int:
        """An iterator's first indices are being drawn: set the resumed position's states (returns how many batches
        to skip) or record the states the uninterrupted run draws with (returns 0)."""
        pending = self._take(self._index(record.loader))
        if pending is None:
            record.draw, record.offset = _pack(_rng.capture(), record.loader), 0
            return 0
        record.draw, record.offset = pending.get("draw"), _count(pending.get("consumed"), self._path)
        if not isinstance(record.draw, dict):
            raise CorruptCheckpointError("its data position is damaged (no random states of the draw)", self._path)
        _set_states(record.draw, record.loader, self._path, everything=True)
        return record.offset

    def end_fit(self) -> None:
        """The fit is over: every loader gets its own iterators back, and no record holds an iterator (whose index
        sampler holds the record: the iterator, with its worker processes, goes when Lightning lets it go, never
        at a later garbage collection); nothing is pending."""
        for record in self._watched.values():
            _torch_compat.release_iterators(record.loader)
            record.iterator = None
        self._watched.clear()
        self._pending = []

    def close(self) -> None:
        """Also give the strategy its own ``process_dataloader`` back."""
        self.end_fit()
        self._unwrap()


class _IndexSampler:
    """A loader's index sampler as one of its iterators holds it: every ``iter`` (each epoch of persistent workers
    too) draws through :class:`_Drawing`."""

    def __init__(self, own: Any, data: TrainData, record: _Loader) -> None:
        self.own, self._data, self._record = own, data, record

    def __iter__(self) -> _Drawing:
        return _Drawing(self)

    def __len__(self) -> int:
        return len(self.own)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.own, name)


class _Drawing:
    """The indices of one epoch, drawn when the first are asked for (as the sampler itself would draw them)."""

    def __init__(self, sampler: _IndexSampler) -> None:
        self._sampler = sampler
        self._indices: Any = None

    def __iter__(self) -> _Drawing:
        return self

    def __next__(self) -> Any:
        if self._indices is None:
            sampler = self._sampler
            before = _rng.capture()
            skip = sampler._data.first_draw(sampler._record)
            self._indices = iter(sampler.own)
            if skip:
                collections.deque(itertools.islice(self._indices, skip), maxlen=0)  # drawn, not loaded
                _rng.restore(before)
        return next(self._indices)


def _stateful(loader: Any) -> bool:
    """A loader that saves and restores its own position (Lightning's ``_Stateful``: torchdata's
    ``StatefulDataLoader``), which Lightning keeps in its loop state."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def _generators(loader: Any) -> list[torch.Generator]:
    """The generators that decide a loader's order and seeds, each once: the loader's, its samplers'."""
    found: list[torch.Generator] = []
    for owner in (loader, loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


def _samplers(loader: Any) -> list[Any]:
    return [s for s in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)) if hasattr(s, "set_epoch")]


def _pack(states: dict[str, Any], loader: Any) -> dict[str, Any]:
    """The random states that decide ``loader``'s order, as plain numbers and hex strings (pickle-free in every
    checkpoint layout): Python's, NumPy's and torch's generators, the loader's and samplers' own, the samplers'
    epoch."""
    version, words, gauss = states["python"]
    _, key, pos, has_gauss, cached = states["numpy"]
    epochs = [int(s.epoch) for s in _samplers(loader) if isinstance(getattr(s, "epoch", None), int)]
    return {"python": [int(version), np.asarray(words, dtype="<u4").tobytes().hex(), gauss],
            "numpy": [np.asarray(key, dtype="<u4").tobytes().hex(), int(pos), int(has_gauss), float(cached)],
            "torch": states["torch"].numpy().tobytes().hex(),
            "generators": [g.get_state().numpy().tobytes().hex() for g in _generators(loader)],
            "sampler_epoch": epochs[0] if epochs else None}


def _set_states(packed: dict[str, Any], loader: Any, path: str, everything: bool) -> None:
    """Set torch's generator and those of ``loader`` to ``packed`` (with ``everything``, Python's and NumPy's too,
    and the samplers' epoch); a damaged position is the checkpoint's error, raised before any state is set."""
    try:
        generators = _generators(loader)
        saved = [_bytes(h) for h in packed["generators"]]
        if len(saved) != len(generators):
            raise ValueError(f"it records {len(saved)} sampler generators, the loader has {len(generators)}")
        version, words, gauss = packed["python"]
        key, pos, has_gauss, cached = packed["numpy"]
        cpu = _bytes(packed["torch"])
        states = {"python": (version, np.frombuffer(bytes.fromhex(words), "<u4").tolist(), gauss),
                  "numpy": ("MT19937", np.frombuffer(bytes.fromhex(key), "<u4").copy(), pos, has_gauss, cached),
                  "torch": cpu}
        epoch = packed.get("sampler_epoch")
        if epoch is not None and not isinstance(epoch, int):
            raise ValueError(f"a sampler epoch of {epoch!r}")
        if everything:
            _rng.restore(states)  # checks every state before it sets any
        else:
            torch.set_rng_state(cpu)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        raise CorruptCheckpointError(f"its data position is damaged ({e})", path) from None
    for g, state in zip(generators, saved):
        g.set_state(state)
    if everything and epoch is not None:
        for sampler in _samplers(loader):
            sampler.set_epoch(epoch)


def _bytes(text: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(bytes.fromhex(text)), dtype=torch.uint8)


def _count(value: Any, path: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CorruptCheckpointError(f"its data position is damaged (a batch count of {value!r})", path)
    return value
