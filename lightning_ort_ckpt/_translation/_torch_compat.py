"""Every private name of torch this package uses, in one place (as ``_lightning_adapter`` holds Lightning's and
``format/_fsspec_compat`` fsspec's). ``tests/conformance/test_one_house.py`` fails on a private attribute of torch's
objects read anywhere else, so a torch release that renames one of these breaks here, in one named function.

- ``Tensor._version``: the counter torch bumps on every in-place change of a tensor; frozen sharing and the
  asynchronous stager use it to know whether a tensor changed since they looked (no copy, no hash).
- ``state_dict._metadata``: the per-module ``version`` numbers ``Module.state_dict`` attaches to its
  ``OrderedDict`` (``_load_from_state_dict`` reads them to upgrade old layouts); a checkpoint keeps them.
- ``ShardedTensor`` (from ``torch.distributed._shard``) and its ``_process_group``: FSDP1's sharded state dicts.
- ``DataLoader._get_iterator`` (the method ``iter(loader)`` calls for a new iterator), the loader's index sampler
  (``_index_sampler``: its ``batch_sampler``, or its ``sampler`` without automatic batching) and an iterator's
  ``_num_yielded``: the data position of a training loader (``_data_position``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_METADATA = "_metadata"


def version_counter(tensor: Any) -> int:
    """How many in-place changes ``tensor`` has seen (torch's ``Tensor._version``)."""
    return int(tensor._version)


def state_dict_metadata(state_dict: Any) -> Any:
    """The ``_metadata`` a module's ``state_dict`` carries (its modules' versions), or None."""
    return getattr(state_dict, _METADATA, None)


def set_state_dict_metadata(state_dict: Any, metadata: Any) -> None:
    """Give ``state_dict`` the module versions ``metadata``, as ``Module.state_dict`` does."""
    setattr(state_dict, _METADATA, metadata)


def sharded_tensor_type() -> type:
    """FSDP1's ``ShardedTensor`` class (a private package of torch)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return ShardedTensor


def process_group_of(sharded: Any) -> Any:
    """The process group a ``ShardedTensor`` is sharded over."""
    return sharded._process_group


_CREATE = "_get_iterator"


def intercept_iterators(loader: Any, create: Any) -> None:
    """Make ``iter(loader)`` call ``create(original)`` where it would call ``loader._get_iterator()`` (this instance
    only; a persistent-workers loader calls it once, then resets the same iterator)."""
    original = getattr(loader, _CREATE)
    loader.__dict__[_CREATE] = lambda: create(original)


def release_iterators(loader: Any) -> None:
    """Undo :func:`intercept_iterators`."""
    loader.__dict__.pop(_CREATE, None)


@contextlib.contextmanager
def index_sampler_as(loader: Any, wrap: Any) -> Iterator[None]:
    """While the block runs (an iterator being made), the loader's index sampler is ``wrap(sampler)``: the iterator
    keeps that object, and asks it for indices at every epoch it serves (persistent workers too). The loader's own
    attribute is put back when the block ends; ``DataLoader`` forbids setting it, so it is set under the guard."""
    name = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    own = loader.__dict__[name]
    object.__setattr__(loader, name, wrap(own))
    try:
        yield
    finally:
        object.__setattr__(loader, name, own)


def iterator_yielded(iterator: Any) -> int:
    """How many batches a ``DataLoader`` iterator has handed out since it was made or last reset."""
    return int(iterator._num_yielded)
