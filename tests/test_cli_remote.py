"""``ort-ckpt`` over a run directory in S3 (moto's server on 127.0.0.1, the fixtures of test_remote_storage): the
run's checkpoints are listed and checked, never reported as one half-written save (issue 42, point 5)."""

from __future__ import annotations

import pytorch_lightning as pl

from lightning_ort_ckpt import OrtCheckpoint
from test_cli_runs import Net
from test_remote_storage import Store, _s3_env, run_cli, s3, s3_endpoint  # noqa: F401 - the fixtures


def test_verify_and_inspect_take_an_s3_run_directory(s3: Store, s3_endpoint: str) -> None:  # noqa: F811
    callback = OrtCheckpoint(dirpath=s3.root, monitor="val_loss", save_top_k=2, storage_options=s3.options)
    pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, callbacks=[callback],
               enable_progress_bar=False, enable_model_summary=False).fit(Net())
    names = sorted(n for n in s3.names() if n.endswith(".ckpt"))
    assert len(names) == 2, s3.names()
    env = _s3_env(s3_endpoint)
    out = run_cli("verify", s3.root, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "half-written" not in out.stdout + out.stderr and "checkpoint.ort-meta" not in out.stderr
    for name in names:
        assert f"OK {s3.url(name)}: " in out.stdout, out.stdout
    assert out.stdout.splitlines()[-1] == "verified 2 checkpoint(s): 2 OK, 0 INVALID"
    out = run_cli("inspect", s3.root, env=env)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "inspected 2 checkpoint(s): 2 readable, 0 failed"
    out = run_cli("ls", s3.root, env=env)
    assert out.returncode == 1 and "ort-ckpt ls lists a local directory" in out.stderr, out.stderr
