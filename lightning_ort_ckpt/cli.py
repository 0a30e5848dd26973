"""Deprecated: 0.2's ``lightning_ort_ckpt.cli`` is private since 0.3 (``_cli``); it goes in 0.4. The command is
``ort-ckpt`` (or ``python -m lightning_ort_ckpt``)."""

from .format._deprecated import moved_module

__getattr__ = moved_module(__name__, "lightning_ort_ckpt._command._cli",
                           "run the ort-ckpt command (or python -m lightning_ort_ckpt)")
