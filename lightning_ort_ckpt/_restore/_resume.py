"""``ckpt_path="last"``: which checkpoint of a directory a fit resumes from, and the fallback when it cannot.

The registry lists the directory, newest first (``_registry``). Rank 0 reads each committed file candidate once, in
full (checksums verified), until one can resume a fit, and the plugin holds what it read for the load; the other
ranks take the newest by the listing (Lightning asks before the process group is up) and adopt rank 0's choice in
``setup`` (:func:`adopt`). A checkpoint folder (a sharded checkpoint) is chosen by its metadata: its shards are
checked while they load, on every rank, and a load that fails on any rank falls back, on every rank together, to
the next committed checkpoint (:func:`falling_back`). Where the directory holds checkpoints and none can be resumed,
"last" is a :class:`~.errors.CheckpointError` listing each and why, unless the user chose
``resume_fallback="scratch"``. A file whose weights do not fit the module being fit (a foreign file newer than the
run's own) is skipped like a damaged one, before Lightning's load would crash the fit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from . import _registry
from ._reading import is_ort_checkpoint, read_contents, to_lightning
from ._torch_files import load_torch_file
from .._translation import MANIFEST
from ..errors import CheckpointError, CheckpointWarning
from ..format import CheckpointContents
from ..format._shared_data import damage_note
from ..format._store import Store

ResumeFallback = Literal["raise", "scratch"]
"""What ``fit(ckpt_path="last")`` does when the directory holds checkpoints and none can be resumed: raise (the
default), or start from scratch (an explicit opt-in)."""


class Holder(Protocol):
    """The plugin, as "last" resolution hands it what it read."""

    def hold(self, path: str, found: Any, source: str | None = None) -> None: ...


@dataclass(frozen=True)
class LastChoice:
    """What one rank resolved ``ckpt_path="last"`` to."""

    path: str | None = None  # None: nothing to resume from
    folder: bool = False
    fallbacks: tuple[str, ...] = ()  # the committed checkpoints after it, newest first: where a failed load goes
    problems: tuple[tuple[str, str], ...] = field(default=(), compare=False)  # (checkpoint, why it cannot resume)

    def same(self, other: LastChoice) -> bool:
        return (self.path, self.folder) == (other.path, other.folder)


def resolve_last(entries: list[_registry.Entry], *, rank_zero: bool, io: Holder, store_of: Callable[[str], Store],
                 module: Any = None) -> LastChoice:
    """The newest committed checkpoint of ``entries`` that can resume a fit of ``module`` (see the module doc); on
    rank 0 a warning names each one skipped and why. ``store_of``: the caller's store of a path (one per tier)."""
    problems: list[tuple[str, str]] = []
    usable = [e for e in _registry.committed(entries) if e.problem is None]
    for entry in _registry.committed(entries):
        if entry.problem is not None:
            problems.append((entry.path, entry.problem))
            _warn_skipped(rank_zero, entry.path, entry.problem)
    for index, entry in enumerate(usable):
        rest = tuple(e.path for e in usable[index + 1:])
        if entry.kind is _registry.Kind.FOLDER or not rank_zero:
            return LastChoice(entry.path, entry.kind is _registry.Kind.FOLDER, rest, tuple(problems))
        try:
            found = resumable(entry.path, store_of(entry.path))
            misfit = _misfit(found, module)
            if misfit:
                raise CheckpointError(f"its weights do not fit the module being fit: {misfit}", entry.path)
        except CheckpointError as e:
            why = str(e).removeprefix(f"{entry.path}: ")
            note = damage_note(entry.path, str(e))  # a shared .data: how many checkpoints it takes with it
            problems.append((entry.path, why))
            _warn_skipped(rank_zero, entry.path, why + (f"; {note}" if note else ""))
            continue
        io.hold(entry.path, found)
        return LastChoice(entry.path, False, rest, tuple(problems))
    return LastChoice(problems=tuple(problems))


def unresumable(directory: str, choice: LastChoice) -> CheckpointError:
    """O1: the directory holds checkpoints and none can be resumed: a line for each and why (the warnings said
    more), then one hint."""
    lines = [f"  {_relative(path, directory)}: {_one_line(why)}" for path, why in choice.problems]
    repair = any(damage_note(path, why) for path, why in choice.problems)
    hint = (f"`ort-ckpt verify --repair {directory}` repairs a shared .data where another copy is intact; else fix or "
            "remove them, " if repair else "Fix or remove them, ")
    return CheckpointError("\n".join([
        f'ckpt_path="last": none of its {len(choice.problems)} checkpoint(s) can be resumed from:', *lines,
        f'{hint}or pass resume_fallback="scratch" to OrtCheckpoint to train from scratch beside them.']), directory)


_REASON_CHARACTERS = 200  # a reason longer than this is cut: each skipped file's warning gave it whole


def _one_line(why: str) -> str:
    why = " ".join(why.split())
    return why if len(why) <= _REASON_CHARACTERS else why[:_REASON_CHARACTERS - 3].rstrip() + "..."


def _relative(path: str, directory: str) -> str:
    """``path`` as a name inside ``directory`` where it is one (its own line says the directory), else whole."""
    for sep in ("/", "\\"):
        if path.startswith(directory.rstrip(sep) + sep):
            return path[len(directory.rstrip(sep)) + 1:]
    return path


def adopt(mine: LastChoice | None, agreed: LastChoice | None, io: Holder, store_of: Callable[[str], Store]) -> bool:
    """Whether this rank resumes from the checkpoint rank 0 resolved "last" to (``agreed``). Where this rank's
    listing chose another file (one rank 0 found damaged or weights only), the plugin is handed what rank 0's file
    holds (one read) for the load Lightning does of this rank's path; a folder, or no checkpoint on one side,
    cannot be handed over."""
    if mine is None or agreed is None:
        return mine is agreed
    if mine.same(agreed):
        return True
    if not (mine.path and agreed.path) or mine.folder or agreed.folder:
        return False
    try:
        found = resumable(agreed.path, store_of(agreed.path))
    except (CheckpointError, OSError):
        return False
    io.hold(mine.path, found, agreed.path)
    return True


def falling_back(load: Callable[[str], Any], choice: LastChoice, agree: Callable[[bool], bool],
                 on_fallback: Callable[[str], None], directory: str) -> Callable[[str], Any]:
    """F2: ``load`` (the strategy's) of the chosen checkpoint, which on any rank's failure (a checksum, a missing
    shard) goes, on every rank together (``agree``: one collective, True where every rank succeeded), to the next
    committed checkpoint, with a warning naming the damaged file; ``on_fallback`` learns where it went. When every
    candidate fails, every rank raises :func:`unresumable`."""

    def load_or_fall_back(path: str) -> Any:
        candidates = (path, *choice.fallbacks) if path == choice.path else (path,)
        problems = list(choice.problems)
        for index, candidate in enumerate(candidates):
            error: CheckpointError | None = None
            try:
                loaded = load(candidate)
            except CheckpointError as e:
                error, loaded = e, None
            if agree(error is None):
                if index:
                    on_fallback(candidate)
                return loaded
            why = str(error).removeprefix(f"{candidate}: ") if error else "another rank could not load it"
            problems.append((candidate, why))
            nxt = candidates[index + 1] if index + 1 < len(candidates) else "nothing: no older checkpoint is left"
            warnings.warn(f"{candidate} cannot be resumed from ({why}); every rank falls back to {nxt}",
                          CheckpointWarning, stacklevel=2)
        raise unresumable(directory, LastChoice(problems=tuple(problems)))

    return load_or_fall_back


def resumable(path: str, store: Store) -> CheckpointContents | dict[str, Any]:
    """What ``path`` holds, read once in full (every tensor checked against its checksum, the Lightning metadata
    decoded: the plugin's load takes the decoded dict as it is), if a fit can resume from it; else our error saying
    why. A torch file must load with ``weights_only=True``. A file ORT wrote alone is held as its contents: the
    plugin builds its optimizer state from them and the live optimizers when it loads it."""
    with warnings.catch_warnings():  # what the resume itself will say, said once
        warnings.simplefilter("ignore")
        if not is_ort_checkpoint(path, store):
            import torch  # loaded with Lightning by now

            with store.fetched(path) as local:
                found: Any = load_torch_file(torch.load, local, "cpu", True)
        else:
            found = read_contents(path, store)
            if MANIFEST not in found.properties:
                return found
            found = to_lightning(found, path)
    if not isinstance(found, dict) or "optimizer_states" not in found:
        raise CheckpointError("weights only", path)
    return found


def _misfit(found: CheckpointContents | dict[str, Any], module: Any) -> str | None:
    """Why the weights of ``found`` (a Lightning checkpoint dict) cannot load into ``module``, as Lightning's load
    would find (a parameter or buffer of the module missing from the file under ``strict_loading``, or of another
    shape), or None. Entries the module does not have are not judged: a module may build more layers later, in
    ``configure_model``; nor is a module without any tensor yet, or a tensor not materialized yet."""
    weights = found.get("state_dict") if isinstance(found, dict) else None
    if module is None or not isinstance(weights, dict):
        return None
    own = {k: v for k, v in module.state_dict().items() if _known_shape(v)}
    missing = [k for k in own if k not in weights] if getattr(module, "strict_loading", True) else []
    shapes = [k for k in own if k in weights and tuple(getattr(weights[k], "shape", ())) != tuple(own[k].shape)]
    if missing:
        return f"the file lacks {missing[0]!r}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
    if shapes:
        k = shapes[0]
        return (f"{k!r} is {_shape(weights[k].shape)} in the file, {_shape(own[k].shape)} in the module"
                + (f" ({len(shapes) - 1} more differ)" if len(shapes) > 1 else ""))
    return None


def _known_shape(value: Any) -> bool:
    """A tensor whose shape is known: not a lazy module's parameter, not on the meta device, not a module's extra
    state (any object)."""
    import torch  # loaded with Lightning by now

    return isinstance(value, torch.Tensor) and not torch.nn.parameter.is_lazy(value) and not value.is_meta


def _shape(shape: Any) -> str:
    return "x".join(map(str, shape)) or "a scalar"


def _warn_skipped(rank_zero: bool, path: str, why: str) -> None:
    if rank_zero:
        warnings.warn(f"{path} cannot be resumed from ({why}); trying the next newest checkpoint", CheckpointWarning,
                      stacklevel=3)


class Resumption:
    """What ``ckpt_path="last"`` resolved to in one fit (:attr:`choice`, None where "last" was not asked), and
    what follows from it: O1's error, the ranks' agreement, the load that falls back."""

    def __init__(self, fallback: ResumeFallback) -> None:
        self.fallback = fallback
        self.choice: LastChoice | None = None

    def find(self, entries: list[_registry.Entry], directory: str, *, rank_zero: bool, alone: bool, io: Holder,
             store_of: Callable[[str], Store], module: Any = None) -> str | None:
        """Resolve "last" over ``entries`` for a fit of ``module`` (``alone``: one rank, which raises O1 at once;
        several ranks raise it together in :meth:`agree`)."""
        self.choice = resolve_last(entries, rank_zero=rank_zero, io=io, store_of=store_of, module=module)
        if alone and self.unresumable(self.choice):
            raise unresumable(directory, self.choice)
        if self.choice.path is None and self.choice.problems and rank_zero:
            warnings.warn(f'ckpt_path="last": no checkpoint in {directory} can be resumed from; training from '
                          'scratch (resume_fallback="scratch")', CheckpointWarning, stacklevel=3)
        elif not _registry.committed(entries) and rank_zero:  # the first fit of a run: nothing to say but that
            warnings.warn(f'ckpt_path="last": no checkpoint yet in {directory}, starting from step 0', UserWarning,
                          stacklevel=3)
        return self.choice.path

    def unresumable(self, choice: LastChoice | None) -> bool:
        """O1: "last" found checkpoints and none can be resumed, and the user did not opt in to start afresh."""
        return choice is not None and choice.path is None and bool(choice.problems) and self.fallback != "scratch"

    def agree(self, agree: Callable[[LastChoice | None, Callable[[LastChoice | None], bool]], LastChoice | None],
              directory: str, io: Holder, store_of: Callable[[str], Store]) -> None:
        """Take rank 0's choice through ``agree`` (``_ranks.agree``, which raises where a rank cannot follow);
        every rank raises O1 together."""
        mine = self.choice
        self.choice = agree(mine, lambda agreed: self.unresumable(agreed) or adopt(mine, agreed, io, store_of))
        if self.unresumable(self.choice):
            raise unresumable(directory, self.choice)  # type: ignore[arg-type]

    def is_last(self, path: str, absolute: Callable[[str], str]) -> bool:
        """Whether ``path`` is what "last" resolved to: one of the callback's own checkpoints, rotating as usual."""
        return self.choice is not None and self.choice.path is not None and \
            absolute(path) == absolute(self.choice.path)

    def loading(self, all_ranks: Callable[[bool], bool], directory: str,
                resumed: Callable[[str], None]) -> Callable[[Callable[[str], Any]], Callable[[str], Any]] | None:
        """F2: for a chosen folder, the wrap of the strategy's next load that falls back (:func:`falling_back`);
        ``resumed`` learns where it went."""
        choice = self.choice
        if choice is None or not choice.folder:
            return None

        def went(path: str) -> None:
            rest = choice.fallbacks[choice.fallbacks.index(path) + 1:]
            self.choice = LastChoice(path, False, rest)
            resumed(path)

        return lambda load: falling_back(load, choice, all_ranks, went, directory)
