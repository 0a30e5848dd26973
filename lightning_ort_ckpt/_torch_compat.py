"""Every private name of torch this package uses, in one place (as ``_lightning_adapter`` holds Lightning's and
``format/_fsspec_compat`` fsspec's). ``tests/test_one_house.py`` fails on a private attribute of torch's objects
read anywhere else, so a torch release that renames one of these breaks here, in one named function.

- ``Tensor._version``: the counter torch bumps on every in-place change of a tensor; frozen sharing and the
  asynchronous stager use it to know whether a tensor changed since they looked (no copy, no hash).
- ``state_dict._metadata``: the per-module ``version`` numbers ``Module.state_dict`` attaches to its
  ``OrderedDict`` (``_load_from_state_dict`` reads them to upgrade old layouts); a checkpoint keeps them.
- ``ShardedTensor`` (from ``torch.distributed._shard``) and its ``_process_group``: FSDP1's sharded state dicts.
"""

from __future__ import annotations

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
