"""The callback's parts, each without a Trainer: the save decision (``_save_decision``), the retention ledger
(``_retention.Ledger``), the "last" choice and the load fallback (``_resume``) on real checkpoints."""

from __future__ import annotations

import glob
import os
import warnings
from pathlib import Path

import pytest
import torch

from lightning_ort_ckpt import OrtCheckpointIO
from lightning_ort_ckpt._dcp._dcp_storage import load_sharded, save_sharded
from lightning_ort_ckpt._restore._registry import scan
from lightning_ort_ckpt._restore._resume import LastChoice, adopt, falling_back, resolve_last, unresumable
from lightning_ort_ckpt._policies._retention import Ledger
from lightning_ort_ckpt._policies._save_decision import Origin, SaveDecision, Verdict
from lightning_ort_ckpt.errors import CheckpointError, CheckpointWarning
from lightning_ort_ckpt.format._store import store_for

LOSS = "val_loss"


def _value(x: float) -> torch.Tensor:
    return torch.tensor(x)  # Lightning replaces the tensor object whenever the value is logged again


# -- the save decision --------------------------------------------------------------------------------------------
def test_a_value_is_fresh_only_at_the_step_it_was_computed() -> None:
    decision = SaveDecision(LOSS)
    metrics = {LOSS: _value(0.5)}
    decision.note(metrics, 10)
    assert decision.current.origin is Origin.COMPUTED and decision.current.step == 10
    assert decision.fresh(metrics, 10) and not decision.fresh(metrics, 11)
    decision.note(metrics, 11)  # the same object seen again: not a new value
    assert decision.current.step == 10
    assert decision.verdict(metrics, metrics, 10, 1, batch_end=True, validation_follows=True) is Verdict.RANKED
    assert decision.verdict(metrics, metrics, 12, 1, batch_end=False, validation_follows=False) is Verdict.UNRANKED


def test_a_stale_save_waits_when_validation_follows_this_batch() -> None:
    decision = SaveDecision(LOSS)
    decision.note({LOSS: _value(0.5)}, 4)
    old = {LOSS: decision.current.value}
    assert decision.verdict(old, old, 8, 1, batch_end=True, validation_follows=True) is Verdict.WAIT
    assert decision.waiting == 8
    new = {LOSS: _value(0.4)}
    decision.note(new, 8)  # validation computed it at step 8
    assert decision.waiting is None and decision.ranks_now(new, 8)


def test_no_monitor_or_top_k_zero_is_lightnings_rule_and_builtin_monitors_are_always_fresh() -> None:
    assert SaveDecision(None).verdict({}, {}, 3, 1, batch_end=True, validation_follows=True) is Verdict.PLAIN
    decision = SaveDecision(LOSS)
    decision.note({LOSS: _value(1.0)}, 1)
    assert decision.verdict({LOSS: 1}, {}, 1, 0, batch_end=False, validation_follows=False) is Verdict.PLAIN
    step = SaveDecision("step")
    candidates = {"step": torch.tensor(7)}  # Lightning's own candidate, no logged metric of that name
    assert step.builtin({}) and step.fresh({}, 7)
    assert step.verdict(candidates, {}, 7, 2, batch_end=True, validation_follows=False) is Verdict.RANKED
    assert not step.ranks_now({}, 7)  # a step count is no value that improves: the triggers save it


def test_a_restored_value_is_stale_until_this_run_computes_one() -> None:
    first = SaveDecision(LOSS)
    first.note({LOSS: _value(0.3)}, 6)
    resumed = SaveDecision(LOSS)
    resumed.load_state_dict(first.state_dict())
    assert resumed.current.origin is Origin.RESTORED and not resumed.fresh({}, 6)
    assert resumed.candidates({"step": 6})[LOSS] is first.current.value  # scheduled saves see it, unranked
    assert resumed.verdict({LOSS: 1}, {}, 6, 1, batch_end=False, validation_follows=False) is Verdict.UNRANKED


# -- retention ----------------------------------------------------------------------------------------------------
def test_the_ledger_keeps_the_newest_and_the_protected() -> None:
    ledger = Ledger(keep_newest=2)
    for name in ("a", "b", "c"):
        ledger.saving(name)
    assert ledger.release(protected={"a"}) == []  # "a" is protected: it waits
    assert ledger.waiting == {"a"}
    ledger.saving("d")
    assert ledger.release(protected=set()) == ["a", "b"] and ledger.saved == ["c", "d"]
    ledger.saving("c")  # saved again: the newest now
    assert ledger.saved == ["d", "c"]


def test_without_keep_newest_one_unranked_file_at_a_time() -> None:
    ledger = Ledger(keep_newest=None)
    ledger.saving_unranked("u1")
    ledger.saving_unranked("u2")
    assert ledger.last_unranked == "u2" and ledger.release(protected=set()) == ["u1"]


# -- "last" and the fallback, on real checkpoints -----------------------------------------------------------------
class _Held:
    def __init__(self) -> None:
        self.held: list[str] = []
        self.sources: list[str | None] = []

    def hold(self, path: str, found: object, source: str | None = None) -> None:
        self.held.append(path)
        self.sources.append(source)


def _file(path: Path, step: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plugin outside a Trainer says what it cannot save
        OrtCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": step, "epoch": 0,
                                           "optimizer_states": [], "loops": {}}, str(path))


def test_rank_zero_reads_candidates_until_one_resumes_and_lists_the_others(tmp_path: Path) -> None:
    _file(tmp_path / "step=2.ckpt", 2)
    _file(tmp_path / "step=4.ckpt", 4)
    data = bytearray((tmp_path / "step=4.ckpt").read_bytes())
    data[data.find(torch.ones(2).numpy().tobytes()) + 1] ^= 0xFF  # a byte of the tensor "w": its checksum fails
    (tmp_path / "step=4.ckpt").write_bytes(data)
    entries = scan(str(tmp_path), store_for(str(tmp_path)))
    io = _Held()
    with pytest.warns(CheckpointWarning, match=r"step=4\.ckpt cannot be resumed from"):
        choice = resolve_last(entries, rank_zero=True, io=io, store_of=store_for)
    assert choice.path == str(tmp_path / "step=2.ckpt") and io.held == [choice.path]
    assert [p for p, _ in choice.problems] == [str(tmp_path / "step=4.ckpt")]
    other = resolve_last(entries, rank_zero=False, io=_Held(), store_of=store_for)  # no read: the listing's
    assert other.path == str(tmp_path / "step=4.ckpt")
    adopted = _Held()
    assert adopt(other, choice, adopted, store_for) and adopted.held == [other.path]  # handed rank 0's file
    assert adopted.sources == [choice.path]  # named as where it was read from
    message = str(unresumable(str(tmp_path), LastChoice(problems=(("x.ckpt", "empty"),))))
    assert "none of its 1 checkpoint(s) can be resumed from:\n  x.ckpt: empty\n" in message


def test_a_sharded_load_that_fails_falls_back_to_the_next_committed_folder(tmp_path: Path) -> None:
    for step in (2, 4):
        save_sharded({"w": torch.full((4,), float(step)), "global_step": step}, str(tmp_path / f"step={step}.ckpt"))
    shard = glob.glob(str(tmp_path / "step=4.ckpt" / "shard-*"))[0]
    os.remove(shard)
    choice = LastChoice(str(tmp_path / "step=4.ckpt"), True, (str(tmp_path / "step=2.ckpt"),))
    target = {"w": torch.zeros(4)}
    went: list[str] = []
    votes: list[bool] = []

    def agree(ok: bool) -> bool:
        votes.append(ok)
        return ok

    load = falling_back(lambda path: load_sharded(target, path), choice, agree, went.append, str(tmp_path))
    with pytest.warns(CheckpointWarning, match=rf"{shard}: shard file .* is missing\); every rank falls back to "
                                               rf".*step=2\.ckpt"):
        loaded = load(choice.path)
    assert loaded["global_step"] == 2 and torch.equal(target["w"], torch.full((4,), 2.0))
    assert went == [str(tmp_path / "step=2.ckpt")] and votes == [False, True]  # one collective per candidate
    os.remove(glob.glob(str(tmp_path / "step=2.ckpt" / "shard-*"))[0])
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError, match="none of its 2 checkpoint"):
        load(choice.path)
