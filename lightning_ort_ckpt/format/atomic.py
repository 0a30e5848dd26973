"""Deprecated: 0.2's ``lightning_ort_ckpt.format.atomic`` is private since 0.3 (``format._atomic``); it goes in 0.4."""

from ._deprecated import moved_module

__getattr__ = moved_module(__name__, "lightning_ort_ckpt.format._atomic",
                           "its atomic commit is internal; save with lightning_ort_ckpt.save_checkpoint or "
                           "OrtCheckpointIO, which commit every file whole")
