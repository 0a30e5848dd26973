"""torch optimizer state <-> ORT optimizer groups.

ORT's ``Optimizer`` reads one group, ``group0``, with per-parameter momentums ``momentum0`` (AdamW's first moment,
torch's ``exp_avg``) and ``momentum1`` (second moment, ``exp_avg_sq``), and a group ``step``. So the first torch
optimizer, when it is Adam-like, is stored as ``group0`` under those names; every other piece of per-parameter state
keeps its torch name (``step``, ``max_exp_avg_sq``, ``momentum_buffer``, ``sum``, ``square_avg``...), and every other
optimizer gets a group of its own, ``optimizer<i>``. ORT ignores the names it does not read and keeps them on save.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..format import GROUP_ZERO, OptimizerGroup

ORT_MOMENTUMS = {"exp_avg": "momentum0", "exp_avg_sq": "momentum1"}
_TORCH_NAMES = {v: k for k, v in ORT_MOMENTUMS.items()}


def group_name(index: int, state_dict: dict[str, Any], names_known: bool) -> str:
    """``group0`` for a first optimizer ORT can train with (Adam-like, parameters named), else ``optimizer<i>``."""
    return GROUP_ZERO if index == 0 and names_known and is_adam_like(state_dict) else f"optimizer{index}"


def is_adam_like(state_dict: dict[str, Any]) -> bool:
    """Every parameter's state has tensor ``exp_avg`` and ``exp_avg_sq`` (Adam, AdamW, and their amsgrad forms)."""
    states = state_dict.get("state", {})
    return bool(states) and all(
        all(isinstance(s.get(k), torch.Tensor) for k in ORT_MOMENTUMS) and not set(_TORCH_NAMES) & set(s)
        for s in states.values())


def momentum_name(state_key: str, group: str) -> str:
    return ORT_MOMENTUMS.get(state_key, state_key) if group == GROUP_ZERO else state_key


def common_step(state_dict: dict[str, Any]) -> int:
    """The step shared by all parameters (ORT's group ``step``), or 0 when they differ or there is none."""
    steps = {_as_int(s.get("step")) for s in state_dict.get("state", {}).values()}
    step = steps.pop() if len(steps) == 1 else None
    return step if step is not None else 0


def initial_learning_rate(state_dict: dict[str, Any]) -> float:
    groups = state_dict.get("param_groups") or [{}]
    lr = groups[0].get("initial_lr", groups[0].get("lr", 0.0))
    return float(lr) if isinstance(lr, (int, float)) or isinstance(lr, torch.Tensor) and lr.numel() == 1 else 0.0


def torch_state_from_ort(group: OptimizerGroup, names: list[str], live: dict[str, Any]) -> dict[str, Any]:
    """A state dict for a live Adam-like optimizer from an ORT group; hyperparameters stay those of ``live``.

    ``names`` are the live optimizer's parameters in torch's index order; ``live`` is its ``state_dict()``.
    """
    state = {}
    for index, name in enumerate(names):
        momentums = group.states.get(name)
        if momentums is None or not all(m in momentums for m in _TORCH_NAMES):
            continue
        state[index] = {"step": torch.tensor(float(group.step)),
                        **{_TORCH_NAMES[m]: momentums[m] for m in _TORCH_NAMES}}
    return {"state": state, "param_groups": copy.deepcopy(live["param_groups"])}


def _as_int(step: Any) -> int | None:
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()
    if isinstance(step, (int, float)) and float(step).is_integer():
        return int(step)
    return None
