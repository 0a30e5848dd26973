"""0.2's public names still work in 0.3, each warning once (FutureWarning) with its new name (README,
"Deprecations": an alias lives for one minor release)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> list[str]:
    """stdout lines, then one line per warning (category: message), of ``code`` in a fresh process (warnings shown
    once per process is the behaviour under test)."""
    prelude = ("import warnings\nwarnings.simplefilter('always')\n"
               "warnings.showwarning = lambda m, c, f, l, *a: print(f'{c.__name__}: {m}')\n")
    out = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_checkpoint_is_checkpoint_contents_and_warns_once() -> None:
    out = _run("""
        import lightning_ort_ckpt, lightning_ort_ckpt.format as fmt
        print(lightning_ort_ckpt.Checkpoint is lightning_ort_ckpt.CheckpointContents)
        print(lightning_ort_ckpt.Checkpoint is fmt.CheckpointContents)
        from lightning_ort_ckpt.format import Checkpoint
        print(Checkpoint is fmt.CheckpointContents)
    """)
    assert out == [
        "FutureWarning: lightning_ort_ckpt.Checkpoint is deprecated since 0.3 and will be removed in 0.4: use "
        "lightning_ort_ckpt.CheckpointContents", "True", "True",
        "FutureWarning: lightning_ort_ckpt.format.Checkpoint is deprecated since 0.3 and will be removed in 0.4: use "
        "lightning_ort_ckpt.format.CheckpointContents", "True"]


def test_old_modules_forward_their_names_and_warn_once_at_import() -> None:
    out = _run("""
        from lightning_ort_ckpt.plugin import OrtCheckpointIO, is_ort_checkpoint, RNG_KEY
        from lightning_ort_ckpt.plugin import read_any_checkpoint
        import lightning_ort_ckpt
        # 0.2's readers take storage_options still (the ones of _reading take a store)
        print(OrtCheckpointIO is lightning_ort_ckpt.OrtCheckpointIO, is_ort_checkpoint("nothing.ckpt", {}) is False)
        from lightning_ort_ckpt.format.atomic import data_path, atomic_save
        print(data_path("a.ckpt"))
        from lightning_ort_ckpt.cli import main
        import lightning_ort_ckpt._command._cli as cli
        print(main is cli.main)
    """)
    warnings = [line for line in out if line.startswith("FutureWarning")]
    assert [w.split(" is deprecated")[0] for w in warnings] == [
        "FutureWarning: lightning_ort_ckpt.plugin", "FutureWarning: lightning_ort_ckpt.format.atomic",
        "FutureWarning: lightning_ort_ckpt.cli"]
    assert "import OrtCheckpointIO from lightning_ort_ckpt" in warnings[0]
    assert "run the ort-ckpt command" in warnings[2]
    assert [line for line in out if not line.startswith("FutureWarning")] == ["True True", "a.ckpt.data", "True"]


def test_a_name_gone_since_0_2_says_what_to_use() -> None:
    out = _run("""
        import lightning_ort_ckpt.plugin as plugin
        try:
            plugin.plugin_class_for
        except AttributeError as e:
            print(e)
    """)
    assert out[-1].startswith("lightning_ort_ckpt.plugin.plugin_class_for is gone since 0.3 (import "
                              "OrtCheckpointIO from lightning_ort_ckpt")
