"""The random number generator states that decide a training run, for exact resume without re-seeding."""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch

from .errors import CheckpointWarning

RNG_KEY = "lightning_ort_ckpt.rng_states"
"""Where the random states travel inside the checkpoint dict (restored when training starts, see ``_binding``)."""


def capture() -> dict[str, Any]:
    """Python's, NumPy's and torch's global generators, and every CUDA device's when CUDA is in use."""
    version, internal, gauss = random.getstate()
    states: dict[str, Any] = {"python": (version, torch.tensor(internal, dtype=torch.int64), gauss),
                              "numpy": np.random.get_state(),
                              "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch.cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore(states: dict[str, Any]) -> None:
    """Set the generators captured by :func:`capture`."""
    random.setstate(_python_state(states["python"]))
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    cuda = states.get("torch.cuda")
    if cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() != len(cuda):
            warnings.warn(f"the checkpoint holds random states of {len(cuda)} CUDA devices, which this machine does "
                          "not have; CUDA random numbers will differ from the original run", CheckpointWarning)
        else:
            torch.cuda.set_rng_state_all(cuda)


def _python_state(state: Any) -> tuple[Any, ...]:
    """random.setstate wants (version, tuple of 625 ints, gauss); capture stores the ints as one tensor."""
    version, internal, gauss = state
    words = tuple(int(v) for v in (internal.tolist() if isinstance(internal, torch.Tensor) else internal))
    if not all(0 <= w < 2**32 for w in words):  # Mersenne Twister words; random.setstate would overflow
        raise ValueError("Python's random state holds a value that is not a 32-bit word")
    return version, words, gauss
