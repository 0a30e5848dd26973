"""Deprecated: 0.2's ``lightning_ort_ckpt.plugin`` is private since 0.3; it goes in 0.4. The plugin is
``lightning_ort_ckpt.OrtCheckpointIO``; its readers moved to ``lightning_ort_ckpt._reading``."""

from .format._deprecated import moved_module

__getattr__ = moved_module(
    __name__, "lightning_ort_ckpt._plugin",
    "import OrtCheckpointIO from lightning_ort_ckpt (from lightning_ort_ckpt.lightning for lightning.pytorch), and "
    "load files with lightning_ort_ckpt.load or lightning_ort_ckpt.load_from_checkpoint",
    {name: f"lightning_ort_ckpt._reading:{name}" for name in (
        "is_ort_checkpoint", "read_lightning_checkpoint", "read_any_checkpoint", "read_weights",
        "load_ort_for_lightning")} | {"RNG_KEY": "lightning_ort_ckpt._rng:RNG_KEY"})
