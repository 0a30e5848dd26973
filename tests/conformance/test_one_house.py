"""Issue "one house": installing and importing the package changes nothing global; what a plugin starts ends with
its teardown; the public surface is typed; the package's layers import one way only; retention is a pure rule."""

from __future__ import annotations

import ast
import os
import re
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
from lightning_ort_ckpt._policies._retention import retain

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_ort_ckpt"


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


class _GlobalHooks(pl.Callback):
    """After each step: torch's global optimizer step pre- and post-hooks added since the fit began, and the hooks on
    the fit's own optimizers (per-optimizer: ``register_step_pre_hook``/``register_step_post_hook``)."""

    def __init__(self) -> None:
        from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

        self.registries = _global_optimizer_pre_hooks, _global_optimizer_post_hooks
        self.before = [dict(r) for r in self.registries]
        self.added: list[tuple[int, int]] = []  # per step: global pre-hooks added, global post-hooks added
        self.optimizers: list[torch.optim.Optimizer] = []
        self.own = 0  # the most hooks the fit's optimizers held at once

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.added.append(tuple(len(set(r) - set(b)) for r, b in zip(self.registries, self.before)))  # type: ignore
        self.optimizers = list(trainer.optimizers)
        self.own = max(self.own, sum(len(o._optimizer_step_pre_hooks) + len(o._optimizer_step_post_hooks)
                                     for o in self.optimizers))


def test_teardown_leaves_no_thread_hook_or_atexit_registration(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An asynchronous save waits through hooks on the fit's own optimizers, and the staging memory waits for their
    first step the same way: never a hook in torch's global registries; at teardown nothing is left: no hook
    (global or on the optimizers), thread or atexit registration."""
    from lightning_ort_ckpt._saving import _async_saver

    registered: list[Any] = []  # atexit has no way to list its callbacks: count ours as they come and go
    monkeypatch.setattr(_async_saver.atexit, "register", lambda f: registered.append(f))
    monkeypatch.setattr(_async_saver.atexit, "unregister", lambda f: registered.remove(f))
    hooks = _GlobalHooks()
    callback = OrtCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, async_save=True)
    before = _our_threads()  # (a plugin another test in this process made and never tore down keeps its own)
    _trainer(callbacks=[hooks, callback]).fit(_Tiny())
    assert len(list(tmp_path.glob("*.ckpt"))) == 4
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # every replaced file deleted already
    assert [t for t in _our_threads() if t not in before] == []
    assert [pre for pre, _ in hooks.added] == [0, 0, 0, 0]  # no global pre-hook, ever
    assert [post for _, post in hooks.added] == [0, 0, 0, 0]  # no global post-hook either
    assert hooks.own >= 1  # the steps waited through a pre-hook on the fit's optimizer
    assert [dict(r) for r in hooks.registries] == hooks.before
    assert [(len(o._optimizer_step_pre_hooks), len(o._optimizer_step_post_hooks)) for o in hooks.optimizers] == [(0, 0)]
    assert registered == []


def test_lightnings_loader_reads_ort_files_only_while_asked(tmp_path: Path) -> None:
    """load_from_checkpoint on an ORT file: after one explicit call (enable_ort_loading), never because a plugin or
    callback of ours exists (issue 40: making one installs nothing); Lightning's own loader otherwise."""
    out = run(f"""
        import gc, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pytorch_lightning.core import saving
        import lightning_ort_ckpt
        from lightning_ort_ckpt import OrtCheckpoint, open_checkpoint
        from test_one_house import _Tiny, _trainer
        original = saving.pl_load
        callback = OrtCheckpoint(dirpath={str(tmp_path)!r}, every_n_train_steps=4)
        print("untouched", saving.pl_load is original)
        _trainer(callbacks=[callback]).fit(_Tiny())
        path = callback.best_model_path
        print("after fit", saving.pl_load is original)
        restored = lightning_ort_ckpt.load_from_checkpoint(_Tiny, path)
        with open_checkpoint(path) as reader:
            print("same", torch.equal(restored.head.weight, reader.get_tensor("head.weight")))
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
    assert out[-7:-2] == ["untouched True", "after fit True", "same True", "released True", out[-3]], out
    assert out[-3].startswith("refused")
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
ARCHITECTURE = PACKAGE.parent / "ARCHITECTURE.md"
_ROW = re.compile(r"^\| (\d)\. [^|]+\| (.+) \| [^|]+ \|$")


def _module_exists(dotted: str) -> bool:
    path = PACKAGE / dotted.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _unparenthesized(text: str) -> str:
    """``text`` without what stands in parentheses (a module's description, where other modules are only named)."""
    out, depth = [], 0
    for c in text:
        depth += c == "("
        if not depth:
            out.append(c)
        depth -= c == ")" and depth > 0
    return "".join(out)


def _table() -> dict[str, int]:
    """Each module of the package and its layer, as ARCHITECTURE.md's table of layers says: the backquoted names
    of a row, outside parentheses (descriptions); ``pkg/`` names a package, the names after it are looked up
    inside it first, and a module the table does not name is in the layer of its package."""
    layers: dict[str, int] = {}
    for line in ARCHITECTURE.read_text().splitlines():
        row = _ROW.match(line)
        if row is None:
            continue
        level, prefixes = int(row.group(1)), [""]
        for token in re.findall(r"`([^`]+)`", _unparenthesized(row.group(2))):
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*/?", token):
                continue  # a class or a file name: prose
            name = token.rstrip("/")
            found = next((p + name for p in reversed(prefixes) if _module_exists(p + name)), None)
            assert found is not None, f"ARCHITECTURE.md's table names a module {token!r} that does not exist"
            assert layers.get(found, level) == level, f"ARCHITECTURE.md puts {found} in two layers"
            layers[found] = level
            if token.endswith("/"):
                prefixes.append(found + ".")
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        package = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in layers),
                       None)
        name = ".".join(parts).removesuffix(".__init__")
        if name not in layers and package is not None:
            layers[name] = layers[package]
    return layers


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


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = {m.removeprefix("lightning_ort_ckpt").removeprefix(".") for m in _imports(path)} - {name, ""}
    return graph


def test_architecture_lists_every_module_in_one_layer() -> None:
    layers, modules = _table(), set(_graph())
    assert sorted(modules - set(layers)) == [], "modules ARCHITECTURE.md's table of layers does not place"
    assert set(layers) <= modules


def test_lower_layers_never_import_higher_ones_and_nothing_imports_in_a_circle() -> None:
    """Every import goes down the table of ARCHITECTURE.md (all five layers), and the format layer imports neither
    torch nor Lightning at import."""
    layers, graph = _table(), _graph()
    for module, targets in graph.items():
        for target in targets:
            assert layers[target] <= layers[module], \
                f"{module} (layer {layers[module]}) imports {target} (layer {layers[target]})"
    for module in (m for m in graph if layers.get(m) == 0 and m != "errors"):
        path = PACKAGE / module.replace(".", "/")
        tree = ast.parse((path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py")
                         .read_text())
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
            if not node.startswith(target + "."):
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
    from lightning_ort_ckpt._restore import _reading
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
    import lightning_ort_ckpt._restore._resume as resume_module

    monkeypatch.setattr(resume_module, "read_contents", read_contents)
    monkeypatch.setattr(plugin_module, "read_contents", read_contents)
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[OrtCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1)])
    trainer.fit(_Tiny(), ckpt_path="last")
    assert trainer.ckpt_path.endswith("step=4.ckpt") and trainer.global_step == 6
    assert reads == [trainer.ckpt_path] and downloads == [trainer.ckpt_path]


# -- private names of Lightning, torch and fsspec: in their adapters only ---------------------------------------------
ADAPTERS = {"_lightning/_lightning_adapter.py", "_translation/_torch_compat.py", "format/_fsspec_compat.py"}
"""Where the private names of Lightning (and of ModelCheckpoint, for the callback), torch and fsspec/s3fs live."""


def _own_private_names(trees: dict[str, ast.Module]) -> set[str]:
    """The private names this package defines: functions, classes, module and class attributes, ``self.x``."""
    own = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                own.add(node.attr)
    return {n for n in own if n.startswith("_")}


def test_private_names_of_lightning_torch_and_fsspec_live_in_their_adapters() -> None:
    """An attribute ``x._name`` (or ``getattr(x, "_name")``) that this package does not define, or an import from a
    private module of another package, is someone else's private name: only the adapters may use one. The callback,
    a ``ModelCheckpoint``, may use those of ``ModelCheckpoint`` that the adapter lists (``MODEL_CHECKPOINT_PRIVATE``,
    checked against each supported Lightning by test_integration), and must list every one it overrides."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    from lightning_ort_ckpt._lightning._lightning_adapter import MODEL_CHECKPOINT_ATTRIBUTES, MODEL_CHECKPOINT_PRIVATE

    assert set(MODEL_CHECKPOINT_ATTRIBUTES) <= set(vars(ModelCheckpoint()))
    trees = {path.relative_to(PACKAGE).as_posix(): ast.parse(path.read_text()) for path in PACKAGE.rglob("*.py")}
    own = _own_private_names(trees)
    listed = set(MODEL_CHECKPOINT_PRIVATE + MODEL_CHECKPOINT_ATTRIBUTES)  # the callback's; not ours however named
    callback = (own - set(dir(ModelCheckpoint)) - set(vars(ModelCheckpoint()))) | listed
    found = []
    for name, tree in trees.items():
        if name in ADAPTERS:
            continue
        allowed = callback if name == "_callback.py" else own
        for node in ast.walk(tree):
            attr = node.attr if isinstance(node, ast.Attribute) else None
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in
                    ("getattr", "setattr", "hasattr") and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                attr = str(node.args[1].value)
            if attr and attr.startswith("_") and not attr.startswith("__") and attr not in allowed:
                found.append(f"{name}:{node.lineno} {attr}")
            if isinstance(node, ast.ImportFrom) and not node.level and node.module and node.module != "__future__":
                private = [p for p in node.module.split(".") if p.startswith("_") and not p.startswith("__")]
                if private and not node.module.startswith("lightning_ort_ckpt"):
                    found.append(f"{name}:{node.lineno} from {node.module}")
            if isinstance(node, ast.ClassDef) and name == "_callback.py":
                overridden = {f.name for f in node.body if isinstance(f, ast.FunctionDef)
                              and f.name.startswith("_") and not f.name.startswith("__") and hasattr(ModelCheckpoint, f.name)}
                found += [f"{name}: {node.name}.{n} overrides ModelCheckpoint's private method unlisted"
                          for n in sorted(overridden - listed)]
    assert found == []
