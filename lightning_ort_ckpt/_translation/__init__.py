"""Layer 2: Lightning checkpoint dict <-> ORT checkpoint (names, optimizer mapping, metadata encoding).

The constants here are importable without torch, for tools that only read files.
"""

MANIFEST = "lightning.checkpoint"
"""String property holding the JSON manifest that maps a Lightning checkpoint onto the ORT file."""
FORMAT = "lightning-ort-ckpt"
"""The manifest's ``format`` value."""
