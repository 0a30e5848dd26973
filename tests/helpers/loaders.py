"""A DataLoader that shuffles and resumes mid-epoch (tests/translation/test_resume.py,
tests/conformance/test_preemption.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset


class ResumableShuffleLoader(DataLoader):
    """Shuffles like ``DataLoader(shuffle=True)`` (a fresh permutation from torch's global generator per epoch), and
    resumes mid-epoch: Lightning saves its ``state_dict`` with the loops and hands it back on restart."""

    def __init__(self, dataset: TensorDataset, batch_size: int) -> None:
        super().__init__(dataset, batch_size=batch_size)
        self._perm: torch.Tensor | None = None
        self._next = 0
        self._resume: tuple[torch.Tensor, int] | None = None

    def __iter__(self) -> Any:
        perm, start = self._resume if self._resume is not None else (torch.randperm(len(self.dataset)), 0)
        self._resume, self._perm = None, perm
        for b in range(start, len(self)):
            self._next = b + 1
            yield self.collate_fn([self.dataset[int(i)] for i in perm[b * self.batch_size:(b + 1) * self.batch_size]])

    def state_dict(self) -> dict[str, Any]:
        return {"perm": self._perm, "next": self._next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = (state["perm"], state["next"])
