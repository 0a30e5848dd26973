"""Docs that run as written (issue 42, point 7): every Python block of README.md and docs/*.md runs, in the order
of its page, in one namespace per page, in a temporary folder. A false snippet fails here.

A page's snippets stand for your code with a few names: ``MyModel`` (your LightningModule class), ``model`` (an
instance), ``datamodule``, ``train`` and ``val`` (loaders), ``optimizer``, ``x`` (an input batch) and ``batches``
(numpy batches for ORT). :data:`PLACEHOLDERS` makes them tiny (``examples/demo_model.py``, 64 samples), so each
page runs in seconds. Blocks fenced ```` ```python remote ```` (an S3 bucket and its credentials) or
```` ```python gpu ```` need what CI does not have: they are compiled, not run. The LightningCLI example's YAML
(docs/guide.md, "LightningCLI") runs through ``LightningCLI`` itself.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKS = {"remote": "needs a remote store and its credentials", "gpu": "needs a GPU"}
_FENCE = re.compile(r"^```(\w+)?((?: \w[\w-]*)*)\s*$")

PLACEHOLDERS = textwrap.dedent("""
    import lightning as L
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader
    from demo_model import DemoModel as MyModel, make_data

    torch.manual_seed(0)
    model = MyModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train = DataLoader(make_data(n=64, seed=0), batch_size=16, shuffle=True)
    val = DataLoader(make_data(n=32, seed=1), batch_size=32)
    datamodule = pl.LightningDataModule.from_datasets(train_dataset=train.dataset, val_dataset=val.dataset,
                                                      batch_size=16)
    x = torch.randn(4, 16)
    batches = [(xb.numpy(), yb.numpy()) for xb, yb in train]
""")


def blocks(page: Path, language: str = "python") -> list[tuple[int, set[str], str]]:
    """Each ``language`` block of ``page``: its first line's number, its marks, its code."""
    out, current, lines = [], None, page.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        fence = _FENCE.match(line)
        if fence is None:
            if current is not None:
                current[2].append(line)
            continue
        if current is not None:
            if current[0] == language:
                out.append((current[1], current[3], "\n".join(current[2]) + "\n"))
            current = None
        elif fence.group(1) is not None or line.strip() == "```":
            current = (fence.group(1), number + 1, [], set(fence.group(2).split()))
    return out


PAGES = [p for p in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))) if blocks(p)]  # with Python


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_python_block_runs_in_order(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    found = blocks(page)
    for _, marks, _ in found:
        assert marks <= set(MARKS), f"{page.name}: unknown marks {marks - set(MARKS)} (known: {sorted(MARKS)})"
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    for name in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))  # a W&B example (offline) writes here only
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the page must say it
    namespace: dict[str, object] = {"__name__": "__docs__"}
    exec(compile(PLACEHOLDERS, "<placeholders>", "exec"), namespace)
    for line, marks, code in found:
        where = f"{page.relative_to(ROOT)}:{line}"
        compiled = compile(code, where, "exec")
        if marks:
            continue  # what CI lacks (MARKS): compiled only
        try:
            exec(compiled, namespace)
        except Exception as e:  # noqa: BLE001 - the block and its line, in the failure
            raise AssertionError(f"the block at {where} fails: {type(e).__name__}: {e}") from e
    _after_the_page(page, namespace)


def _after_the_page(page: Path, namespace: dict[str, object]) -> None:
    """What a page promises beyond running: the guide's on-device round trip trains on in Lightning."""
    if page.name == "guide.md":
        import lightning_ort_ckpt

        saved_step = lightning_ort_ckpt.load("ort_trained.ckpt")["global_step"]
        assert namespace["resumed"].global_step > saved_step  # type: ignore[attr-defined]


def test_the_lightning_cli_example_trains_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/guide.md's YAML, as written, through LightningCLI: it trains with OrtCheckpoint, and a second run of the
    same command resumes from the newest checkpoint."""
    from pytorch_lightning.cli import LightningCLI  # needs jsonargparse[signatures]: the dev extra

    (yaml,) = [code for _, _, code in blocks(ROOT / "docs" / "guide.md", "yaml")]
    (tmp_path / "config.yaml").write_text(yaml)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    first = LightningCLI(args=["fit", "--config", "config.yaml"], save_config_callback=None)
    callback = first.trainer.checkpoint_callback
    assert type(callback).__name__ == "OrtCheckpoint" and callback.best_model_path
    steps = first.trainer.global_step
    second = LightningCLI(args=["fit", "--config", "config.yaml", "--trainer.max_epochs", "3", "--ckpt_path", "last"],
                          save_config_callback=None)
    assert second.trainer.global_step > steps > 0
    from lightning_ort_ckpt import open_checkpoint

    with open_checkpoint(second.trainer.checkpoint_callback.last_model_path):
        pass  # an ORT file


def test_the_test_sees_marks_and_blocks(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("text\n```python\na = 1\n```\n```python remote\nb = 2\n```\n```bash\nls\n```\n")
    assert blocks(page) == [(3, set(), "a = 1\n"), (6, {"remote"}, "b = 2\n")]
