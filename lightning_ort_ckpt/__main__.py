"""``python -m lightning_ort_ckpt`` is the ``ort-ckpt`` command."""

import sys

from ._command._cli import main

sys.exit(main())
