"""The random number generator states that decide a training run, for exact resume without re-seeding."""

from __future__ import annotations

import math
import random
import warnings
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointWarning

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
    """Set the generators captured by :func:`capture`. Every state is checked first, so a damaged one raises
    ``ValueError`` naming the generator before any generator is set, and never reaches one that would misread it
    (NumPy's takes any position into its key, and reads outside it)."""
    python, numpy_state, cpu, cuda = _checked(states)
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _checked(states: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], torch.Tensor, list[torch.Tensor] | None]:
    """The states as the generators' setters take them; ValueError for anything :func:`capture` does not write."""
    if not isinstance(states, dict) or not {"python", "numpy", "torch"} <= states.keys():
        raise ValueError("expected the states of Python's, NumPy's and torch's generators")
    cuda = states.get("torch.cuda")
    if cuda is not None and not (isinstance(cuda, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in cuda)):
        raise ValueError("the CUDA random states are not a list of tensors")
    checked_cuda = None
    if cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() != len(cuda):
            warnings.warn(f"the checkpoint holds random states of {len(cuda)} CUDA devices, which this machine does "
                          "not have; CUDA random numbers will differ from the original run", CheckpointWarning)
        else:
            checked_cuda = [_byte_state(t, torch.cuda.get_rng_state(i).numel(), f"CUDA device {i}'s random state")
                            for i, t in enumerate(cuda)]
    return (_python_state(states["python"]), _numpy_state(states["numpy"]),
            _byte_state(states["torch"], torch.get_rng_state().numel(), "torch's random state"), checked_cuda)


def _python_state(state: Any) -> tuple[Any, ...]:
    """random.setstate wants (version, tuple of 625 ints, gauss); capture stores the ints as one tensor."""
    if not isinstance(state, (tuple, list)) or len(state) != 3:
        raise ValueError("Python's random state is not a (version, words, gauss) triple")
    version, internal, gauss = state
    if version != random.Random.VERSION:
        raise ValueError(f"Python's random state has version {version!r}, not {random.Random.VERSION}")
    if isinstance(internal, torch.Tensor):
        if internal.dim() != 1 or internal.dtype.is_floating_point or internal.dtype.is_complex:
            raise ValueError("Python's random state is not a vector of integers")
        internal = internal.tolist()
    if not isinstance(internal, (tuple, list)) or len(internal) != _MT_WORDS + 1:
        raise ValueError(f"Python's random state does not hold {_MT_WORDS} words and a position")
    words = tuple(internal)
    if not all(isinstance(w, int) and 0 <= w < 2**32 for w in words):  # Mersenne Twister words; setstate overflows
        raise ValueError("Python's random state holds a value that is not a 32-bit word")
    if words[-1] > _MT_WORDS:
        raise ValueError(f"Python's random state has position {words[-1]}, past its {_MT_WORDS} words")
    if gauss is not None and not (isinstance(gauss, (int, float)) and math.isfinite(gauss)):
        raise ValueError("Python's random state holds a cached Gaussian that is not a number")
    return version, words, gauss


def _numpy_state(state: Any) -> tuple[Any, ...]:
    """np.random.set_state's legacy tuple (algorithm, 624 key words, position, has_gauss, cached_gaussian)."""
    if not isinstance(state, (tuple, list)) or len(state) != 5:
        raise ValueError("NumPy's random state is not the five values np.random.get_state() gives")
    algorithm, key, pos, has_gauss, gauss = state
    if algorithm != "MT19937":
        raise ValueError(f"NumPy's random state is of generator {algorithm!r}, not MT19937")
    if (not isinstance(key, np.ndarray) or key.shape != (_MT_WORDS,) or key.dtype.kind not in "iu"
            or (key.size and (key.min() < 0 or key.max() >= 2**32))):
        raise ValueError(f"NumPy's random state does not hold {_MT_WORDS} 32-bit words")
    if not _is_int(pos) or not 0 <= pos <= _MT_WORDS:
        raise ValueError(f"NumPy's random state has position {pos!r}, outside its {_MT_WORDS} words")
    if not _is_int(has_gauss) or has_gauss not in (0, 1):
        raise ValueError("NumPy's random state has a has_gauss flag that is neither 0 nor 1")
    if not (isinstance(gauss, (int, float, np.floating)) and math.isfinite(gauss)):
        raise ValueError("NumPy's random state holds a cached Gaussian that is not a number")
    return algorithm, key.astype(np.uint32), int(pos), int(has_gauss), float(gauss)


def _byte_state(state: Any, size: int, what: str) -> torch.Tensor:
    """A torch generator state: a vector of ``size`` bytes, as torch.get_rng_state gives."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
        raise ValueError(f"{what} is not a byte vector")
    if state.numel() != size:
        raise ValueError(f"{what} holds {state.numel()} bytes, not {size}")
    return state


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


_MT_WORDS = 624  # the Mersenne Twister's state, in 32-bit words (Python's and NumPy's)
