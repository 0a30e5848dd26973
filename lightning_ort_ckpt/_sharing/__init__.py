"""Frozen sharing, the policy side: which frozen tensors a save links, from which copy (``_policy``), and the
independent copies a plugin tracks (``_copies``); the bytes are ``format._shared_data``'s."""

from __future__ import annotations

from ._policy import Decision, FrozenSharing

__all__ = ["Decision", "FrozenSharing"]
