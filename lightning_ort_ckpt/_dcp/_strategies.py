"""Lightning's sharded strategies: what ``OrtCheckpointIO`` saves and restores under them.

``ModelParallelStrategy`` (FSDP2) and ``FSDPStrategy`` do not save through the ``CheckpointIO``: their own
``save_checkpoint`` / ``load_checkpoint`` call torch.distributed.checkpoint (a pickled ``.metadata``) or
``torch.load``. While an ``OrtCheckpointIO`` is bound to one of them (:func:`attach`, from the plugin's ``bind``;
undone at its ``teardown``, which the strategy's ``teardown`` then calls), those two methods are ours (the
wrap itself is ``_lightning_adapter``'s):

- **sharded state** (``ModelParallelStrategy(save_distributed_checkpoint=True)``, the default;
  ``FSDPStrategy(state_dict_type="sharded")``): every rank writes its own shards through
  ``_dcp_storage.save_sharded``: the module state and optimizer states as Lightning built them (FSDP2's DTensors;
  FSDP1's ShardedTensors as DTensors viewing the same shards, :func:`as_dtensors`), loops, callbacks,
  hyper-parameters and the rest as values, and each rank's random states under its rank. The checkpoint is a
  directory. With ``async_save=True`` the step waits only for the copy of the rank's shards into staging memory
  allocated ahead (``_dcp_staging``); the write runs on the plugin's background queue. Loading asks torch.distributed.checkpoint's ``get_*_state_dict`` helpers for this run's shards and
  fills them through ``load_sharded``: at the same world size exactly the saved state, at another one the same
  tensors resharded (random states are restored on the ranks that saved them);
- **full state** (``save_distributed_checkpoint=False``, ``state_dict_type="full"``): Lightning gathers the state on
  every rank and rank 0 writes it through the plugin, one ORT file (to a URL as the base ``Strategy`` does: the
  strategies' own ``save_checkpoint`` would turn it into a local path); every rank loads that file and hands the full
  state to ``set_model_state_dict`` / ``set_optimizer_state_dict``, which keep each rank's shard.

Every other strategy (DDP, single device...) saves through the ``CheckpointIO``; one of several processes (DDP) has
its two methods wrapped too, only to put every rank's random states into the file rank 0 writes and give each rank
its own on load (:func:`own_random_states`). DeepSpeed is refused when the plugin is bound
(:class:`CheckpointConfigError`): its ZeRO checkpoints are DeepSpeed's own files.
"""

from __future__ import annotations

import functools
import random
import weakref
from typing import Any, Callable, Literal, NamedTuple, Protocol, TYPE_CHECKING

import torch

from .._fit_state import _rng
from .._lightning import _lightning_adapter
from .._recovery import _signals
from .._lightning._namespaces import namespace_of
from .._fit_state._rng import RNG_KEY
from .._translation._torch_compat import process_group_of, sharded_tensor_type
from .._translation.lightning_dict import clean_name
from ..errors import CheckpointConfigError
from ..format._store import Stores

if TYPE_CHECKING:
    from ._dcp_staging import ShardStager

class Plugin(Protocol):
    """What this module needs of an ``OrtCheckpointIO`` (layer 3: not imported here)."""

    stores: Stores
    """The store of each path, built once (a save's own ``storage_options``: one of its own)."""
    _reentry: _signals.Reentry  # its calls in progress: a sharded save in a signal handler waits for them too

    @property
    def async_save(self) -> bool: ...

    def run_in_order(self, fn: Callable[..., Any], *args: Any) -> None: ...

    def data_position(self) -> dict[str, Any]:
        """The fit's data position (and the validation due after this batch), keyed as a checkpoint keeps them
        (empty outside a fit)."""
        ...

    def wait(self) -> None: ...

    def teardown(self) -> None: ...

    def load_checkpoint(self, path: str, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]: ...

    def loaded(self, checkpoint: dict[str, Any], path: str) -> dict[str, Any]:
        """The plugin's last look at a checkpoint dict it read (random states kept for the train start)."""
        ...


SUPPORTED = ("DDPStrategy (and every strategy that saves through the CheckpointIO), ModelParallelStrategy, "
             "FSDPStrategy(state_dict_type='sharded' or 'full')")
RANKS_RNG_KEY = "lightning_ort_ckpt.rng_states_by_rank"
"""Where a full-state file keeps every rank's random states (rank 0 writes it; each rank restores its own)."""
WORLD_SIZE_KEY = "lightning_ort_ckpt.world_size"
"""The world size of a sharded save (a value in the checkpoint): which ranks' random states it holds."""


def kind(strategy: Any) -> Literal["sharded", "full"] | None:
    """How ``strategy`` saves: ``"sharded"`` or ``"full"`` for the strategies handled here, None for those that
    save through the ``CheckpointIO``. Raises :class:`CheckpointConfigError` for DeepSpeed."""
    ns = namespace_of(strategy)
    if isinstance(strategy, ns.attr("strategies.DeepSpeedStrategy")):
        raise CheckpointConfigError(
            f"OrtCheckpoint cannot save under {type(strategy).__name__}: DeepSpeed writes its ZeRO checkpoints "
            f"itself, in its own files, and cannot reshard them. Supported strategies: {SUPPORTED}. Use "
            "ModelParallelStrategy or FSDPStrategy for sharded training, or Lightning's ModelCheckpoint with DeepSpeed")
    if not isinstance(strategy, (ns.attr("strategies.ModelParallelStrategy"), ns.attr("strategies.FSDPStrategy"))):
        return None
    sharded = _lightning_adapter.sharded_state_dict(strategy)
    return None if sharded is None else "sharded" if sharded else "full"


class Attachment(NamedTuple):
    """What :func:`attach` did, and its two undos."""

    undo: Callable[[], None]
    """The strategy's own save and load back, and the staging memory freed (the plugin's ``teardown``)."""
    close: Callable[[], None]
    """The staging memory freed and its step hooks removed; the strategy still saves and loads through the plugin
    (a plugin used alone keeps serving the strategy fit after fit)."""
    arm: Callable[[list[Any]], None]
    """The fit's optimizers exist: the staging memory waits for their first steps (``_staging_memory``)."""


def attach(strategy: Any, plugin: Plugin) -> Attachment | None:
    """Route ``strategy``'s saves and loads through ``plugin`` (its options, its random-state restore); returns how
    to undo it, or None for a strategy that uses the plugin by itself."""
    how = kind(strategy)
    if how is None:
        return _attach_ranks(strategy, plugin) if _several_ranks(strategy) else None
    from ._dcp_staging import ShardStager

    owner = weakref.ref(strategy)  # what the plugin keeps (the stager) and the strategy (its methods) hold it weakly
    stager = ShardStager()  # the staging memory of asynchronous sharded saves, allocated while async_save is on
    stager.prepare(functools.partial(_staged_shards, owner, weakref.ref(plugin)))

    def save(original: Any, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        served: Any = owner()  # (alive: it is calling)
        if kind(served) == "sharded":  # (as the plugin's own saves: deferred in a signal handler, ``_signals``)
            plugin._reentry.call(lambda: save_sharded_checkpoint(served, plugin, checkpoint, filepath,
                                                               storage_options, stager if plugin.async_save
                                                               else None), defer=True)
        else:  # Lightning's own: rank 0 writes the gathered state through the plugin, with every rank's random states
            full = {**checkpoint, RANKS_RNG_KEY: gather_random_states(served)}
            if plugin.stores.of(str(filepath)).local:
                original(full, filepath, storage_options=storage_options)
            else:  # Lightning's makes a URL a local path (``Path("s3://b/k")``: ``s3:/b/k``); what it does then:
                target = served.broadcast(filepath)
                if served.is_global_zero:
                    served.checkpoint_io.save_checkpoint(full, target, storage_options=storage_options)

    def load(original: Any, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from ._dcp_folder import is_sharded_checkpoint
        from .._restore._reading import is_ort_checkpoint

        served: Any = owner()  # (alive: it is calling)
        path = str(served.broadcast(checkpoint_path))
        store = plugin.stores.of(path)
        if is_sharded_checkpoint(path, store):
            return load_sharded_checkpoint(served, plugin, path)
        if is_ort_checkpoint(path, store):
            return load_full_checkpoint(served, plugin, path)
        return original(checkpoint_path, weights_only)  # Lightning's own files: its DCP folders, torch files

    def teardown(original: Any) -> None:
        original()
        plugin.teardown()  # ModelParallelStrategy's does not call it; a second call does nothing; it unwraps

    unwrap = _lightning_adapter.wrap_strategy_checkpointing(strategy, save, load, teardown)

    def undo() -> None:  # the plugin's teardown: every write is done by then
        unwrap()
        stager.close()

    return Attachment(undo, stager.close, stager.arm)


def _several_ranks(strategy: Any) -> bool:
    """Whether ``strategy`` runs one process per rank (DDP...): a ``ParallelStrategy`` of Lightning."""
    return isinstance(strategy, namespace_of(strategy).attr("strategies.ParallelStrategy"))


def _attach_ranks(strategy: Any, plugin: Plugin) -> Attachment:
    """A strategy whose rank 0 writes through the plugin (DDP): every rank's random states go into the file (one
    collective a generator, on every rank, as Lightning calls ``save_checkpoint`` on every rank), and each rank
    restores its own, as under a full-state save of a sharded strategy."""
    owner = weakref.ref(strategy)

    def save(original: Any, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        served: Any = owner()  # (alive: it is calling)
        if served.world_size > 1:
            checkpoint = {**checkpoint, RANKS_RNG_KEY: gather_random_states(served)}
        original(checkpoint, filepath, storage_options=storage_options)

    def load(original: Any, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint: dict[str, Any] = original(checkpoint_path, weights_only)
        return own_random_states(owner(), plugin, checkpoint, str(checkpoint_path))

    unwrap = _lightning_adapter.wrap_strategy_checkpointing(strategy, save, load, lambda original: original())
    return Attachment(unwrap, lambda: None, lambda optimizers: None)


def _staged_shards(strategy: weakref.ref[Any], plugin: weakref.ref[Plugin]) -> tuple[list[torch.Tensor],
                                                                                     list[Any]] | None:
    """What the plugin's next asynchronous sharded save will stage (None while its saves are synchronous or not
    sharded), for the staging memory to allocate ahead. The plugin keeps that memory fit after fit (its
    ``Attachment``), and the strategy the plugin: both held weakly, or the plugin would be on a reference cycle."""
    owner, io = strategy(), plugin()
    if owner is None or io is None or not io.async_save or kind(owner) != "sharded":
        return None
    return _local_shards(owner)


def _local_shards(strategy: Any) -> tuple[list[torch.Tensor], list[Any]] | None:
    """What an asynchronous sharded save will stage, without a collective: the module's parameters (DTensors: each
    rank's shard), its buffers and the optimizers (``_dcp_staging.ShardStager.prepare``)."""
    module = strategy.lightning_module
    return None if module is None else ([*module.parameters(), *module.buffers()], list(strategy.optimizers))


def gathers(strategy: Any) -> bool:
    """Whether the module of ``strategy`` is sharded: its state dict is gathered (a copy), never the module's own
    tensors, and asking the module for it starts a collective that every rank must join."""
    try:
        return kind(strategy) is not None
    except CheckpointConfigError:
        return True


def names_match(strategy: Any, state_dict: dict[str, Any]) -> bool:
    """Whether a gathered ``state_dict`` is the state of ``strategy``'s module: the same parameter names (judged
    by name, as it is a copy; no collective)."""
    module = strategy.lightning_module
    if module is None:
        return False
    params = {clean_name(n) for n, _ in module.named_parameters()}
    return bool(params) and params <= set(state_dict)


# -- sharded ----------------------------------------------------------------------------------------------------
def save_sharded_checkpoint(strategy: Any, plugin: Plugin, checkpoint: dict[str, Any], filepath: Any,
                            storage_options: Any = None, stager: ShardStager | None = None) -> None:
    """Every rank: its shards of the module and optimizer states, the values (rank 0's), its random states. With a
    ``stager`` (``async_save=True``) the values are encoded and the shards copied now, and the write runs on the
    plugin's background queue, in order with the deletions and links asked for after it; the first error of a
    background write is raised on every rank by the plugin's next call (every rank's write fails with it: the save
    is collective), or at the end of fit. Lightning's SLURM requeue save (``hpc_ckpt_N.ckpt``) is durable before
    it returns, as with the plugin's own saves."""
    from ._dcp_storage import flatten, save_flat

    plugin.wait()
    path = str(strategy.broadcast(str(filepath)))
    state = {**checkpoint, **plugin.data_position(), WORLD_SIZE_KEY: strategy.world_size,
             RNG_KEY: {_rank_key(strategy.global_rank): pack_random_states(_rng.capture())}}
    tree, flat = flatten(as_dtensors(state), path)
    store = plugin.stores.of(path, storage_options)
    if stager is None:
        save_flat(tree, flat, path, store=store)
    else:
        plugin.run_in_order(_write_later, tree, stager.stage(flat), path, store, stager.group())
        if _signals.must_be_durable(path):  # Lightning's requeue save: the job is requeued, and killed, next
            plugin.wait()


def _write_later(tree: Any, flat: dict[str, Any], path: str, store: Any, group: Any) -> None:
    from ._dcp_storage import save_flat

    save_flat(tree, flat, path, store=store, process_group=group)


def load_sharded_checkpoint(strategy: Any, plugin: Plugin, path: str) -> dict[str, Any]:
    """Fill this run's shards from the checkpoint (resharded when the world size differs) and return Lightning's
    checkpoint dict; the random states of this rank, if it saved any, are restored when training starts."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    from ._dcp_storage import load_sharded

    store = plugin.stores.of(path)
    values = load_sharded({}, path, store=store, others=False)  # the values only: no tensor is read
    model, rank = strategy.model, strategy.global_rank
    fitting = _lightning_adapter.fitting(strategy)
    state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
    if fitting and "optimizer_states" in values:
        state["optimizer_states"] = [get_optimizer_state_dict(model, opt) for opt in strategy.optimizers]
    saved_ranks = values.get(WORLD_SIZE_KEY)
    mine = isinstance(saved_ranks, int) and rank < saved_ranks
    if mine:
        state[RNG_KEY] = {_rank_key(rank): pack_random_states(_rng.capture())}
    # this run's shards (FSDP1's ShardedTensors filled through views), and the other tensors saved whole (scores...)
    values = load_sharded(as_dtensors(state), path, store=store)
    strict = strategy.lightning_module.strict_loading
    set_model_state_dict(model, state["state_dict"], options=StateDictOptions(strict=strict))
    for opt, opt_state in zip(strategy.optimizers, state.get("optimizer_states", [])):
        set_optimizer_state_dict(model, opt, opt_state)
    checkpoint = {k: v for k, v in values.items() if k not in (WORLD_SIZE_KEY, RNG_KEY)}
    checkpoint.update((k, state[k]) for k in ("state_dict", "optimizer_states") if k in state)
    if mine:
        checkpoint[RNG_KEY] = unpack_random_states(state[RNG_KEY][_rank_key(rank)])
    return plugin.loaded(checkpoint, path)


def as_dtensors(tree: Any) -> Any:
    """``tree`` with every ShardedTensor (FSDP1's sharded state dicts: ``FSDPStrategy(state_dict_type="sharded")``)
    as a DTensor viewing the same local shard, the form our sharded saves store (FSDP2's and DCP's own): the same
    global tensor, chunked along its first dimension over the ranks of its process group as ``torch.chunk`` does.
    A load fills the ShardedTensor through that view. Other leaves are left as they are."""
    if isinstance(tree, sharded_tensor_type()):
        return _dtensor_of(tree)
    if isinstance(tree, (dict, list)):
        items = list(tree.items()) if isinstance(tree, dict) else list(enumerate(tree))
        converted = [(k, as_dtensors(v)) for k, v in items]
        if all(new is old for (_, new), (_, old) in zip(converted, items)):
            return tree  # nothing sharded inside: the very object (any dict type, hyper-parameters included)
        return type(tree)(converted) if isinstance(tree, dict) else [v for _, v in converted]
    return tree


def _dtensor_of(sharded: Any) -> Any:
    import math

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    meta, group = sharded.metadata(), process_group_of(sharded)
    size, ranks = tuple(meta.size), dist.get_world_size(group)
    step = math.ceil(size[0] / ranks) if size else 0
    chunked = {(r, (r * step,) + (0,) * (len(size) - 1),
                (min(step, size[0] - r * step),) + size[1:]) for r in range(ranks) if size and r * step < size[0]}
    saved = {(dist.get_group_rank(group, m.placement.rank()), tuple(m.shard_offsets), tuple(m.shard_sizes))
             for m in meta.shards_metadata}
    shards = sharded.local_shards()
    if saved != chunked or len(shards) > 1:
        raise CheckpointConfigError(f"a sharded tensor of shape {list(size)} is not split along its first dimension "
                                    "over the ranks as FSDP splits parameters; OrtCheckpoint saves FSDPStrategy's "
                                    "state sharded only as FSDP (FULL_SHARD, SHARD_GRAD_OP) splits it")
    local = shards[0].tensor if shards else torch.empty((0, *size[1:]), dtype=meta.tensor_properties.dtype)
    mesh = DeviceMesh.from_group(group, local.device.type)
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(size),
                              stride=torch.empty(size, device="meta").stride())


def _rank_key(rank: int) -> str:
    return f"rank{rank}"


def pack_random_states(states: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One rank's random states (``_rng.capture``) as tensors of fixed shapes: a sharded save keeps one value of
    each non-tensor leaf (rank 0's), and the tensors of every rank under their own names."""
    _, words, gauss = states["python"]
    _, key, pos, has_gauss, np_gauss = states["numpy"]
    packed = {"python": words.clone(),
              "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
              "numpy": torch.from_numpy(key.astype("int64")),
              "numpy_rest": torch.tensor([pos, has_gauss, np_gauss], dtype=torch.float64),
              "torch": states["torch"].clone()}
    for i, t in enumerate(states.get("torch.cuda", [])):
        packed[f"torch.cuda.{i}"] = t.clone()
    return packed


def unpack_random_states(packed: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The states :func:`pack_random_states` packed, as ``_rng.restore`` takes them."""
    has_gauss, gauss = packed["python_gauss"].tolist()
    pos, np_has_gauss, np_gauss = packed["numpy_rest"].tolist()
    states: dict[str, Any] = {
        "python": (random.Random.VERSION, packed["python"], gauss if has_gauss else None),
        "numpy": ("MT19937", packed["numpy"].numpy().astype("uint32"), int(pos), int(np_has_gauss), np_gauss),
        "torch": packed["torch"]}
    cuda = [packed[k] for k in sorted((k for k in packed if k.startswith("torch.cuda.")),
                                      key=lambda k: int(k.rpartition(".")[2]))]
    if cuda:
        states["torch.cuda"] = cuda
    return states


def gather_random_states(strategy: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank's random states (:func:`pack_random_states`), on every rank: one tensor collective per generator
    (no pickled objects), on the strategy's device as its backend needs."""
    mine = pack_random_states(_rng.capture())
    ranks: dict[str, dict[str, torch.Tensor]] = {_rank_key(r): {} for r in range(strategy.world_size)}
    for name, tensor in mine.items():
        gathered = strategy.all_gather(tensor.to(strategy.root_device)).cpu()
        for r in range(strategy.world_size):
            ranks[_rank_key(r)][name] = gathered[r] if strategy.world_size > 1 else gathered
    return ranks


def own_random_states(strategy: Any, plugin: Plugin, checkpoint: dict[str, Any], path: str) -> dict[str, Any]:
    """``checkpoint`` (a file rank 0 wrote, with every rank's random states) with this rank's own random states,
    handed to ``plugin`` to restore when training starts; unchanged where the file holds no rank's but rank 0's."""
    by_rank = checkpoint.pop(RANKS_RNG_KEY, None)
    if isinstance(by_rank, dict):  # this rank's own random states, if it saved any
        mine = by_rank.get(_rank_key(strategy.global_rank))
        checkpoint.pop(RNG_KEY, None)
        if mine is not None:
            checkpoint[RNG_KEY] = unpack_random_states(mine)
        checkpoint = plugin.loaded(checkpoint, path)
    return checkpoint


# -- full state -------------------------------------------------------------------------------------------------
def load_full_checkpoint(strategy: Any, plugin: Plugin, path: str) -> dict[str, Any]:
    """Every rank reads the ORT file rank 0 wrote and keeps its shard of the module and optimizer states."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

    checkpoint = own_random_states(strategy, plugin, plugin.load_checkpoint(path), path)
    model = strategy.model
    strict = strategy.lightning_module.strict_loading
    set_model_state_dict(model, checkpoint["state_dict"], options=StateDictOptions(full_state_dict=True, strict=strict))
    states = checkpoint.get("optimizer_states")
    if states is not None and _lightning_adapter.fitting(strategy):
        if len(states) != len(strategy.optimizers):
            raise CheckpointConfigError(f"the run has {len(strategy.optimizers)} optimizers, the checkpoint holds "
                                        f"the state of {len(states)}", path)
        for opt, opt_state in zip(strategy.optimizers, states):
            if opt_state.get("state") and isinstance(next(iter(opt_state["state"])), int):  # torch's index keys
                opt_state = FullyShardedDataParallel.rekey_optim_state_dict(opt_state, OptimStateKeyType.PARAM_NAME,
                                                                            model)
            set_optimizer_state_dict(model, opt, opt_state, options=StateDictOptions(full_state_dict=True))
    return checkpoint
