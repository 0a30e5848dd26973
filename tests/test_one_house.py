"""Issue "one house": installing and importing the package changes nothing global; what a plugin starts ends with
its teardown; the public surface is typed; the package's layers import one way only; retention is a pure rule."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_ort_ckpt import BindCheckpointIO, OrtCheckpoint, OrtCheckpointIO, open_checkpoint
from lightning_ort_ckpt._retention import retain

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_ort_ckpt"


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("imported", ["nothing", "the package"])
def test_a_plain_trainer_has_exactly_lightnings_callbacks_and_loader(imported: str) -> None:
    """The package is installed (editable, in this venv): a Trainer that does not use it is Lightning's own."""
    out = run(f"""
        import atexit, logging, sys, threading  # (logging registers its own atexit hook on import)
        hooks, exits = list(sys.meta_path), atexit._ncallbacks()
        {"import lightning_ort_ckpt" if imported != "nothing" else ""}
        print(atexit._ncallbacks() - exits, [t.name for t in threading.enumerate() if t.name.startswith("ort")])
        import pytorch_lightning as pl
        from pytorch_lightning.core import saving
        from lightning_fabric.plugins.io import torch_io
        from lightning_fabric.utilities.cloud_io import _load
        t = pl.Trainer(logger=False, enable_progress_bar=False)
        print(sorted(type(c).__module__ + "." + type(c).__name__ for c in t.callbacks))
        print(saving.pl_load is _load, torch_io.pl_load is _load)
        print([h for h in sys.meta_path if h not in hooks and type(h).__module__.startswith("lightning_ort_ckpt")])
        print(sorted(m for m in sys.modules if m.startswith("lightning_ort_ckpt")
                     and m not in ("lightning_ort_ckpt",) and not m.startswith(("lightning_ort_ckpt.format",
                     "lightning_ort_ckpt.errors"))))
    """).splitlines()
    assert out[0] == "0 []", out[0]  # no atexit registration, no thread
    assert all(name.startswith("pytorch_lightning.") for name in eval(out[1])), out[1]
    assert out[2:] == ["True True", "[]", "[]"]


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(8, 2)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        return self.head(self.frozen(batch[0])).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.head.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g)),
                                           batch_size=4)


def _trainer(**kwargs: Any) -> pl.Trainer:
    return pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)


def _our_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ort-ckpt") and t.is_alive()]  # save, unlink


def test_teardown_leaves_no_thread_hook_or_atexit_registration(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.optim.optimizer import _global_optimizer_pre_hooks  # torch's registry of global step hooks

    from lightning_ort_ckpt import _async_saver

    registered: list[Any] = []  # atexit has no way to list its callbacks: count ours as they come and go
    monkeypatch.setattr(_async_saver.atexit, "register", lambda f: registered.append(f))
    monkeypatch.setattr(_async_saver.atexit, "unregister", lambda f: registered.remove(f))
    hooks = dict(_global_optimizer_pre_hooks)
    callback = OrtCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, async_save=True)
    _trainer(callbacks=[callback]).fit(_Tiny())
    assert len(list(tmp_path.glob("*.ckpt"))) == 4
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # every replaced file deleted already
    assert _our_threads() == []
    assert dict(_global_optimizer_pre_hooks) == hooks
    assert registered == []


def test_lightnings_loader_reads_ort_files_only_while_asked(tmp_path: Path) -> None:
    """load_from_checkpoint on an ORT file: while a plugin or callback of ours exists, or after one explicit call;
    Lightning's own loader otherwise."""
    out = run(f"""
        import gc, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pytorch_lightning.core import saving
        import lightning_ort_ckpt
        from lightning_ort_ckpt import OrtCheckpoint, open_checkpoint
        from test_one_house import _Tiny, _trainer
        original = saving.pl_load
        callback = OrtCheckpoint(dirpath={str(tmp_path)!r}, every_n_train_steps=4)
        print("held", saving.pl_load is not original)
        _trainer(callbacks=[callback]).fit(_Tiny())
        path = callback.best_model_path
        restored = _Tiny.load_from_checkpoint(path)
        with open_checkpoint(path) as reader:
            print("same", torch.equal(restored.head.weight, reader.get_tensor("head.weight")))
        del callback
        gc.collect()
        print("released", saving.pl_load is original)
        try:
            _Tiny.load_from_checkpoint(path)
            print("torch read it")
        except Exception as e:
            print("refused", type(e).__name__)
        lightning_ort_ckpt.enable_ort_loading()
        print("enabled", torch.equal(_Tiny.load_from_checkpoint(path).head.weight, restored.head.weight))
        lightning_ort_ckpt.disable_ort_loading()
        print("disabled", saving.pl_load is original)
    """).splitlines()
    assert out[-6:-2] == ["held True", "same True", "released True", out[-3]] and out[-3].startswith("refused")
    assert out[-2:] == ["enabled True", "disabled True"]


def test_the_plugin_without_the_callback_binds_itself(tmp_path: Path) -> None:
    """plugins=[OrtCheckpointIO()] with Lightning's ModelCheckpoint: the plugin learns its module from the strategy
    Lightning hands it to, so ORT sees the trainable parameters as trainable, with or without BindCheckpointIO(),
    and nothing warns (issue 33: it used to save everything as frozen, with a warning)."""
    import warnings

    from pytorch_lightning.callbacks import ModelCheckpoint

    from lightning_ort_ckpt.errors import CheckpointWarning

    def trainable(bind: bool, where: Path) -> set[str]:
        callbacks = [ModelCheckpoint(dirpath=where, every_n_train_steps=4)] + ([BindCheckpointIO()] if bind else [])
        _trainer(callbacks=callbacks, plugins=[OrtCheckpointIO()]).fit(_Tiny())
        (path,) = where.glob("*.ckpt")
        with open_checkpoint(path) as reader:
            return set(reader.trainable)

    assert trainable(True, tmp_path / "bound") == {"head.weight", "head.bias"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        assert trainable(False, tmp_path / "bare") == {"head.weight", "head.bias"}


def test_mypy_sees_the_readme_classes(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    (tmp_path / "use.py").write_text(textwrap.dedent("""
        from lightning_ort_ckpt import OrtCheckpoint, OrtCheckpointIO
        reveal_type(OrtCheckpoint)
        reveal_type(OrtCheckpointIO)
        callback: OrtCheckpoint = OrtCheckpoint(dirpath="ckpts", keep_newest=3)
    """))
    (tmp_path / "mypy.ini").write_text(textwrap.dedent("""
        [mypy]
        ignore_missing_imports = True
        [mypy-lightning_ort_ckpt.*]
        follow_imports = silent
        [mypy-torch.*,pytorch_lightning.*,lightning.*,lightning_fabric.*,lightning_utilities.*,numpy.*,fsspec.*]
        follow_imports = skip
    """))
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--no-incremental", "use.py"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "MYPYPATH": str(PACKAGE.parent)})
    assert "-> lightning_ort_ckpt._callback.OrtCheckpoint" in out.stdout, out.stdout
    assert "-> lightning_ort_ckpt._plugin.OrtCheckpointIO" in out.stdout, out.stdout
    assert "error" not in out.stdout, out.stdout


# -- layers ----------------------------------------------------------------------------------------------------------
LAYER = {"format": 0, "_translation": 1, "errors": 0}
"""A module's layer by its package or name; the rest of the top level is above translation."""


def _imports(path: Path) -> set[str]:
    """The package modules ``path`` imports, at any depth (lazily too), as dotted names under the package."""
    here = path.relative_to(PACKAGE.parent).with_suffix("").parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(here[:-1]) if here[-1] != "__init__" else list(here[:-1])
            if node.level:
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("lightning_ort_ckpt"):
                found.add(mod)
                found.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lightning_ort_ckpt"))
    return {m for m in found if (PACKAGE.parent / (m.replace(".", "/") + ".py")).exists()
            or (PACKAGE.parent / m.replace(".", "/") / "__init__.py").exists()}


def _layer(module: str) -> int:
    parts = module.split(".")[1:]
    return LAYER.get(parts[0], 2) if parts else 2


def test_lower_layers_never_import_higher_ones_and_nothing_imports_in_a_circle() -> None:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = _imports(path) - {name}
    for module, targets in graph.items():
        for target in targets:
            assert _layer(target) <= _layer(module), f"{module} (layer {_layer(module)}) imports {target}"
    format_modules = [m for m in graph if _layer(m) == 0 and m != "lightning_ort_ckpt.errors"]
    for module in format_modules:  # no torch or Lightning at import in the format layer
        tree = ast.parse((PACKAGE.parent / (module.replace(".", "/") + ".py")).read_text()
                         if (PACKAGE.parent / (module.replace(".", "/") + ".py")).exists()
                         else (PACKAGE.parent / module.replace(".", "/") / "__init__.py").read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in top if isinstance(n, ast.ImportFrom)}
        assert not {n for n in names if n.split(".")[0] in ("torch", "pytorch_lightning", "lightning")}, module
    seen: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        if seen.get(node) == 1:
            raise AssertionError(f"import cycle: {' -> '.join(stack + [node])}")
        if seen.get(node) == 2:
            return
        seen[node] = 1
        for target in sorted(graph.get(node, ())):
            if target != "lightning_ort_ckpt" and not node.startswith(target + "."):
                visit(target, stack + [node])
        seen[node] = 2

    for module in sorted(graph):
        visit(module, [])


# -- retention, a pure rule -------------------------------------------------------------------------------------------
def test_retention_keeps_the_newest_and_the_protected() -> None:
    saved = ["a", "b", "c", "d"]
    assert retain(saved, set(), set(), 2) == (["a", "b"], set())
    assert retain(saved, set(), {"a"}, 2) == (["b"], {"a"})  # protected: waits until it is not
    assert retain(saved, {"x"}, set(), None) == (["x"], set())
    assert retain(saved, {"x"}, {"x"}, None) == ([], {"x"})
    assert retain([], {"b", "a"}, set(), 1) == (["a", "b"], set())  # oldest name first
    with pytest.raises(ValueError):
        retain(saved, set(), set(), 0)


# -- one reader path: "last" reads the chosen file once ---------------------------------------------------------------
def test_resuming_from_last_reads_the_chosen_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ckpt_path="last" on a store: the file "last" resolution validated (a full, verified read) is the one the
    resume uses; one download, not two. The same holds for a local directory (one full read)."""
    from lightning_ort_ckpt import _reading
    from lightning_ort_ckpt.format._fsspec_store import FsspecStore

    dirpath = f"memory://one-read-{tmp_path.name}"
    _trainer(callbacks=[OrtCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1)]).fit(_Tiny())
    downloads: list[str] = []
    reads: list[str] = []
    real_fetched, real_read = FsspecStore.fetched, _reading.read_contents

    def fetched(self: Any, path: str) -> Any:
        downloads.append(path)
        return real_fetched(self, path)

    def read_contents(path: Any, storage_options: Any = None) -> Any:
        reads.append(str(path))
        return real_read(path, storage_options)

    monkeypatch.setattr(FsspecStore, "fetched", fetched)
    monkeypatch.setattr(_reading, "read_contents", read_contents)
    import lightning_ort_ckpt._plugin as plugin_module
    import lightning_ort_ckpt._resume as resume_module

    monkeypatch.setattr(resume_module, "read_contents", read_contents)
    monkeypatch.setattr(plugin_module, "read_contents", read_contents)
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[OrtCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1)])
    trainer.fit(_Tiny(), ckpt_path="last")
    assert trainer.ckpt_path.endswith("step=4.ckpt") and trainer.global_step == 6
    assert reads == [trainer.ckpt_path] and downloads == [trainer.ckpt_path]
