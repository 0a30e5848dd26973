"""When a save is ranked by the monitored metric: Orbax's save-decision policy, for ``OrtCheckpoint``.

A pure object (no Trainer): the callback tells it what each hook sees (the monitored value Lightning holds, the
step), and asks it what a save at this step is. The rule: a save is ranked by the monitored value only if that value
was computed at the step being saved (fresh). A stale value (older, or restored from the checkpoint resumed from)
is never ranked: the save is written unranked, or, when validation computes the value right after this very batch,
waits for it (:attr:`waiting`), and is then ranked by the hook that saves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class Origin(Enum):
    """Where the monitored value at hand came from."""

    NONE = "none"  # no value yet
    COMPUTED = "computed"  # logged by this run at ``step``
    RESTORED = "restored"  # the checkpoint's: stale until this run computes one


class Verdict(Enum):
    """What a save at this step is."""

    PLAIN = "plain"  # no monitored value to rank by: Lightning's own top-k rule
    RANKED = "ranked"  # ranked by a fresh value, as ModelCheckpoint ranks it
    WAIT = "wait"  # validation computes the value right after this batch: save then
    UNRANKED = "unranked"  # the value is stale: written unranked, kept as one of the newest
    LAST = "last"  # the last checkpoint (ModelCheckpoint's save_last): none of the newest N


@dataclass
class MonitoredValue:
    """The monitored value and the step it was computed at."""

    value: Any = None
    step: int | None = None
    origin: Origin = Origin.NONE


class SaveDecision:
    """Freshness of the monitored value, and the save that waits for it."""

    def __init__(self, monitor: str | None) -> None:
        self.monitor = monitor
        self.current = MonitoredValue()
        self.waiting: int | None = None
        """The step whose scheduled save waits for the value validation computes right after it; else None."""

    def builtin(self, metrics: dict[str, Any]) -> bool:
        """``monitor="step"`` or ``"epoch"`` without a logged metric of that name: Lightning's own candidates,
        computed at every save (its documented "keep the latest k" recipe)."""
        return self.monitor in ("step", "epoch") and self.monitor not in metrics

    def note(self, metrics: dict[str, Any], step: int) -> None:
        """What a hook sees: a new value object (Lightning replaces the tensor) was computed at ``step``."""
        value = metrics.get(self.monitor) if self.monitor is not None else None
        if value is not None and value is not self.current.value:
            self.current = MonitoredValue(value, step, Origin.COMPUTED)
            self.waiting = None  # a save waiting for this value is ranked by the hook that saves it

    def fresh(self, metrics: dict[str, Any], step: int) -> bool:
        if self.builtin(metrics):
            return True
        return self.current.origin is Origin.COMPUTED and self.current.step == step

    def verdict(self, candidates: dict[str, Any], metrics: dict[str, Any], step: int, save_top_k: int, *,
                batch_end: bool, validation_follows: bool) -> Verdict:
        """What the save ``ModelCheckpoint`` is about to make at ``step`` is; ``candidates`` are its candidates,
        ``metrics`` the values logged. ``batch_end``: the save happens at the end of a training batch, where
        validation may follow (``validation_follows``, asked only then)."""
        if self.monitor is None or self.monitor not in candidates or save_top_k == 0:
            return Verdict.PLAIN
        if self.fresh(metrics, step):
            return Verdict.RANKED
        if batch_end and validation_follows:
            self.waiting = step
            return Verdict.WAIT
        return Verdict.UNRANKED

    def ranks_now(self, metrics: dict[str, Any], step: int) -> bool:
        """Whether a fresh value is a trigger of its own now (monitoring: a save "on improvement"); a step or
        epoch count is no value that improves (the scheduled triggers save it)."""
        if self.monitor is None or self.builtin(metrics) or not self.fresh(metrics, step):
            return False
        self.waiting = None
        return True

    def candidates(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Lightning's candidates; after a resume, the value the run had when it was saved (stale), until this run
        computes one, so that scheduled saves happen as in the uninterrupted run."""
        if self.monitor is not None and self.monitor not in metrics and self.current.value is not None:
            return {**metrics, self.monitor: self.current.value}
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"monitor_value": self.current.value, "monitor_step": self.current.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        value = state.get("monitor_value")
        self.current = MonitoredValue(value, state.get("monitor_step"),
                                      Origin.RESTORED if value is not None else Origin.NONE)
