"""The fast tier under 2 ranks (issue 39): the work a SIGKILL of the whole job costs, under ``DDPStrategy`` and
``ModelParallelStrategy`` (FSDP2), on gloo over 127.0.0.1.

    python benchmarks/tiers_ranks.py                              # 20 kills per strategy
    python benchmarks/tiers_ranks.py --kills 100 --strategies ddp,mp
    python benchmarks/tiers_ranks.py --kills 4 --strategies mp    # quick look

The single-process trials of ``tiers.py``, with 2 ranks. The parent imports torch and Lightning once and forks each
rank (``LOCAL_RANK``, ``WORLD_SIZE`` and a fresh ``MASTER_PORT`` set as a launcher sets them: Lightning starts no
process of its own); the ranks fit ``tiers.Small`` (sharded with ``fully_shard`` under ModelParallel) on gloo for 60
steps, ``OrtCheckpoint(dirpath, every 20 steps, local=LocalTier(fast folder, every step, keep 2))``, alternately with
``async_save`` off and on, and each says on its pipe every step it finished. Once a rank reported the random step the
trial drew, after a random 0-30 ms more, the parent SIGKILLs both ranks (a scheduler ending the job: no handler runs),
then forks 2 new ranks that run ``fit(ckpt_path="last")`` and say the step each resumed from (both must agree). Lost
steps = the last step both ranks reported finished - the step resumed from (a rank may have finished one step more
than it reported, so the true loss can be one more).

``--one-rank-first STUCK_S``: a rank drawn at random is killed first (a node lost), and the other once it ended by
itself (gloo sees its partner gone) or reported no step for ``STUCK_S`` seconds (stuck in a collective), as a
scheduler kills what is left of a job; counted in "survivor ended / stuck".

Every wait is bounded (``--timeout`` seconds a phase): a fit that does not reach its kill step, or a resume that does
not end, is killed and counted as a hang; a resume that fails or whose ranks disagree is counted as failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytorch_lightning as pl
from pytorch_lightning.strategies import DDPStrategy, ModelParallelStrategy, Strategy

from tiers import KILL_STEPS, Reports, Small, Steps, _callback, _data, _in_child, _trainer

WORLD_SIZE = 2


class ShardedSmall(Small):
    """``Small``, each layer and the whole sharded with FSDP2 over the data-parallel mesh."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


STRATEGIES: dict[str, tuple[Callable[[], Strategy], type[Small]]] = {
    "ddp": (lambda: DDPStrategy(), Small),
    "mp": (lambda: ModelParallelStrategy(data_parallel_size=WORLD_SIZE, tensor_parallel_size=1), ShardedSmall),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def in_ranks(run: Callable[[int], None]) -> tuple[list[int], list[int]]:
    """Fork ``WORLD_SIZE`` ranks of one job, each running ``run(pipe)`` (a pipe to write to) with its rank's
    environment: (their pids, the read ends of their pipes)."""
    port, pids, reads = _free_port(), [], []
    for rank in range(WORLD_SIZE):
        read, write = os.pipe()

        def child(rank: int = rank, write: int = write) -> None:
            for fd in [*reads, read]:
                os.close(fd)
            for name in ("RANK", "GLOBAL_RANK", "PL_GLOBAL_SEED"):
                os.environ.pop(name, None)
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                              WORLD_SIZE=str(WORLD_SIZE))
            run(write)

        pids.append(_in_child(child))
        os.close(write)
        reads.append(read)
    return pids, reads


def _end(pids: list[int]) -> list[int]:
    """SIGKILL every rank still running and reap them all: their exit statuses."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return [os.waitpid(pid, 0)[1] for pid in pids]


def _fit(root: str, strategy: str, async_save: bool, steps: int, fd: int, ckpt_path: str | None = None) -> None:
    make_strategy, model = STRATEGIES[strategy]
    logging.getLogger("lightning_fabric").setLevel(logging.ERROR)  # each rank's "Initializing distributed"
    pl.seed_everything(0, verbose=False)
    trainer = _trainer([Reports(fd), _callback(root, async_save)], steps, devices=WORLD_SIZE,
                       strategy=make_strategy())
    trainer.fit(model(), _data(64, 4096), ckpt_path=ckpt_path)
    if ckpt_path is not None:
        os.write(fd, f"{trainer.global_step}\n".encode())  # the step it resumed from (it trains none)


@dataclass
class Trial:
    outcome: str  # "resumed", "hang" (killed at the timeout), "failed" (a rank failed, or the ranks disagree)
    finished: int = -1  # the last step both ranks reported finished
    resumed: int = -1  # the step both ranks resumed from
    what: str = ""
    survivor: str = ""  # a rank killed first: its partner "ended" by itself or was killed "stuck"


def one_kill(root: str, strategy: str, async_save: bool, rng: random.Random, timeout: float,
             stuck: float | None = None) -> Trial:
    """A trial; with ``stuck``, one rank (drawn at random) is killed first, the other once it ended by itself or
    reported no step for ``stuck`` seconds (``Trial.survivor``)."""
    kill_at, first = rng.randint(3, KILL_STEPS - 5), rng.randrange(WORLD_SIZE)
    pids, reads = in_ranks(lambda fd: _fit(root, strategy, async_save, KILL_STEPS, fd))
    steps = Steps(reads)
    reached = steps.until(kill_at, time.monotonic() + timeout)
    time.sleep(rng.uniform(0, 0.03))
    survivor = ""
    if stuck is not None and reached:
        os.kill(pids[first], signal.SIGKILL)
        survivor = "ended" if steps.quiet(stuck, time.monotonic() + timeout) else "stuck"
    for pid in pids:  # the whole job, as a scheduler kills it
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    steps.close(time.monotonic() + timeout)
    statuses = _end(pids)
    if not reached:
        outcome = "hang" if all(os.WIFSIGNALED(s) for s in statuses) else "failed"
        return Trial(outcome, what=f"training reached {steps.newest} of {kill_at}, exits {statuses}")
    finished = min(steps.newest)  # (a survivor reports no step past the one its killed partner stopped at)
    pids, reads = in_ranks(lambda fd: _fit(root, strategy, False, 0, fd, ckpt_path="last"))
    resumed = Steps(reads)
    ended = resumed.close(time.monotonic() + timeout)
    statuses = _end(pids)
    if not ended:
        return Trial("hang", finished, what=f"resume: {resumed.newest}", survivor=survivor)
    if any(statuses) or len(set(resumed.newest)) != 1:
        return Trial("failed", finished, what=f"resume: steps {resumed.newest}, exits {statuses}", survivor=survivor)
    return Trial("resumed", finished, resumed.newest[0], survivor=survivor)


def lost_work(kills: int, strategies: list[str], seed: int, timeout: float, stuck: float | None) -> None:
    results: dict[tuple[str, bool], list[Trial]] = {}
    for strategy in strategies:
        rng = random.Random(seed)
        for trial in range(kills):
            async_save = bool(trial % 2)
            root = tempfile.mkdtemp(prefix="tiers-ranks-kill-")
            started = time.monotonic()
            try:
                got = one_kill(root, strategy, async_save, rng, timeout, stuck)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            results.setdefault((strategy, async_save), []).append(got)
            print(f"{strategy} {'async' if async_save else 'sync'} #{trial}: {got.outcome} {got.finished}->"
                  f"{got.resumed} {got.survivor} {got.what} ({time.monotonic() - started:.1f} s, load "
                  f"{os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    how = "the whole job" if stuck is None else f"one rank, then the other once ended or stuck ({stuck:g} s)"
    print(f"\n## Lost work per SIGKILL of a 2-rank job ({kills} kills per strategy: {how}; fast tier every step, "
          f"keep 2; persistent every 20 steps)\n")
    print("| strategy | saves | kills | steps lost: mean | max | from scratch | hangs | failed | survivor ended / "
          "stuck | last step reported -> step resumed from |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (strategy, async_save), trials in results.items():
        done = [t for t in trials if t.outcome == "resumed"]
        lost = [max(0, t.finished - t.resumed) for t in done]
        scratch = sum(1 for t in done if t.resumed == 0 and t.finished >= 1)
        hangs = sum(1 for t in trials if t.outcome == "hang")
        mean, most = (f"{statistics.mean(lost):.2f}", str(max(lost))) if lost else ("-", "-")
        survivors = "-" if stuck is None else \
            f"{sum(t.survivor == 'ended' for t in trials)} / {sum(t.survivor == 'stuck' for t in trials)}"
        print(f"| {strategy} | {'async' if async_save else 'sync'} | {len(trials)} | {mean} | {most} | {scratch} | "
              f"{hangs} | {len(trials) - len(done) - hangs} | {survivors} | "
              f"{', '.join(f'{t.finished}->{t.resumed}' for t in done)} |")
    for trials in results.values():
        for t in trials:
            if t.outcome != "resumed":
                print(f"\n{t.outcome}: {t.what}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20, help="per strategy, half sync and half async")
    parser.add_argument("--strategies", default="ddp,mp", help="comma-separated: ddp, mp (ModelParallel)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a phase may take before a hang")
    parser.add_argument("--one-rank-first", type=float, default=None, metavar="STUCK_S",
                        help="kill one rank first, the other once it ended or reported no step for STUCK_S seconds")
    args = parser.parse_args()
    print(f"python {' '.join(sys.argv)}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    lost_work(args.kills, args.strategies.split(","), args.seed, args.timeout, args.one_rank_first)


if __name__ == "__main__":
    main()
