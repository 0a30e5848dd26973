"""The ``ort-ckpt`` command."""
