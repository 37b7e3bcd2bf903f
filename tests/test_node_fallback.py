"""Two failures in one streamed node-group cycle (issue 60): a node-mate and a trainer copy.

Four real Megatron-Core trainer processes (gloo, TP=2 x DP=2: every shard on two copies) serve two
versions. Three streamed receivers of one node (``node=3``, ``memory_budget``) refit version 1
together. One closes. In version 2 the other two find its node arena unserved and pull its share from
the trainers, and just as that pull starts, the first copy of tp rank 0 is SIGKILLed. Its READs
fail. The receivers fail over to the other copy, land the group again from there and finish:
every tensor equals the HF tensors the independent reference sharder (tests/reference.py) gives
back from the trainers' version-2 shards. ``stats.node_fallbacks`` names the mate and
``stats.failovers`` the dead copy.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch

pytest.importorskip("nixl")
pytest.importorskip("megatron.core")

from conftest import tiny_config  # noqa: E402
from reference import reference_hf_state, reference_shards, unshard  # noqa: E402
from test_node_share import cycles_on_threads  # noqa: E402

from megarefit.demo.trainer_jobs import TrainerCase, serving_trainer_job  # noqa: E402
from megarefit.demo.workers import start_workers  # noqa: E402
from megarefit.online import RefitReceiver  # noqa: E402
from megarefit.online.receiver import streamed  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous  # noqa: E402

pytestmark = pytest.mark.megatron

TOKENS = torch.randint(0, 250, (1, 8), generator=torch.Generator().manual_seed(5))
BUDGET = 1 << 26  # bytes: one ring group holds the tiny model


def _want(case: TrainerCase, snapdir, version: int) -> dict[str, torch.Tensor]:
    """HF tensors of ``version``, unsharded by the reference sharder from copy 1's saved shards (the copy
    that lives)."""
    shards = {(t, 0, 0): torch.load(snapdir / f"v{version}-tp{t}-pp0-ep0-copy1.pt") for t in range(case.tp)}
    dtype = next(iter(shards[(0, 0, 0)].values())).dtype
    return unshard(shards, reference_hf_state(case.hf_config, "qwen3", dtype=dtype),
                   functools.partial(reference_shards, cfg=case.hf_config, tp=case.tp, pp=1))


def test_a_trainer_copy_killed_while_a_dead_mates_share_is_pulled_is_failed_over(monkeypatch, tmp_path):
    job = "node-fallback"
    monkeypatch.setenv("MEGAREFIT_NODE", job)
    rdzv = Rendezvous.serve(job=job)
    case = TrainerCase(job, tiny_config("Qwen3-0.6B"), 2, 1, TOKENS)
    group = start_workers(serving_trainer_job, world_size=4,
                          args=(case, ("127.0.0.1", rdzv.port, job), 2, 0.01, str(tmp_path)))
    killed = threading.Event()
    original = streamed.GroupStream._pull_missing

    def kill_then_pull(self, k, missing):
        if not killed.is_set():  # the first mate-share pull of the cycle: tp rank 0's first copy dies now
            killed.set()
            group.kill(0)
        return original(self, k, missing)

    try:
        rx = [RefitReceiver(rdzv, name=f"{job}-{i}", timeout=30, heartbeat_s=0.2, node=3, memory_budget=BUDGET)
              for i in range(3)]
        assert all(not isinstance(g, Exception) for g in cycles_on_threads(rx, 1))
        gone = rx.pop(1)
        gone.close()
        rdzv.mark_consumed(1)
        monkeypatch.setattr(streamed.GroupStream, "_pull_missing", kill_then_pull)
        got = cycles_on_threads(rx, 2)
        assert killed.is_set()
        assert all(not isinstance(g, Exception) for g in got), got
        want = _want(case, tmp_path, 2)
        for g in got:
            assert sorted(g) == sorted(want) and [n for n in want if not torch.equal(g[n], want[n])] == []
        assert all(r.stats.node_fallbacks and all(m == gone.name for m, _ in r.stats.node_fallbacks) for r in rx)
        failed_over = [[rank for rank, _ in r.stats.failovers] for r in rx]
        assert [(0, 0, 0)] in failed_over, failed_over  # at least the receiver whose pull met the dead copy
        rdzv.mark_consumed(2)
        for r in rx:
            r.close()
    finally:
        with pytest.raises(RuntimeError, match="worker"):
            group.join(timeout=60)
