"""Live refit over real NIXL (UCX on loopback): trainer ranks in their own processes.

Two real Megatron-Core trainer processes (TP=2) publish their live shards; the
receiver (this process) pulls three versions while the trainers change their
weights between versions. Each version's bytes must equal the HF tensors the
independent reference sharder (tests/reference.py) gives back from the shards the
trainers snapshotted for that version; warm cycles register and
prepare nothing new. A second pair of trainers is used to kill a peer.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("nixl")
pytest.importorskip("megatron.core")

from conftest import tiny_config  # noqa: E402
from reference import reference_hf_state, reference_shards, unshard  # noqa: E402

from megarefit.demo.trainer_jobs import TrainerCase, serving_trainer_job  # noqa: E402
from megarefit.demo.workers import start_workers  # noqa: E402
from megarefit.online import RefitReceiver  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous  # noqa: E402
from megarefit.transport.nixl_agent import TransferError  # noqa: E402

pytestmark = pytest.mark.megatron

VERSIONS = 3
TOKENS = torch.randint(0, 250, (1, 8), generator=torch.Generator().manual_seed(3))


def _start(job: str, versions: int):
    rdzv = Rendezvous.serve(job=job)
    case = TrainerCase(job, tiny_config("Qwen3-0.6B"), 2, 1, TOKENS)
    group = start_workers(serving_trainer_job, world_size=2, args=(case, ("127.0.0.1", rdzv.port, job), versions))
    return rdzv, group, case.hf_config


@pytest.fixture(scope="module")
def live():
    rdzv, group, cfg = _start("live", VERSIONS)
    receiver = RefitReceiver(rdzv, name="receiver-live", timeout=120)
    received, stats, counters = {}, {}, {}
    for v in range(1, VERSIONS + 1):
        received[v] = {name: t.clone() for name, t in receiver.run_refit_cycle(v)}
        stats[v], counters[v] = receiver.stats, dict(receiver.counters)
        rdzv.mark_consumed(v)
    trainers = group.join(timeout=120)
    snapshots = {v: {tuple(t["coord"]): t["snapshots"][v] for t in trainers} for v in range(1, VERSIONS + 1)}
    return cfg, received, stats, counters, snapshots, trainers


def test_each_version_is_bit_identical_to_the_reference(live):
    cfg, received, _, _, snapshots, _ = live
    shard = functools.partial(reference_shards, cfg=cfg, tp=2, pp=1)
    for v in range(1, VERSIONS + 1):
        dtype = next(iter(snapshots[v][(0, 0, 0)].values())).dtype
        want = unshard(snapshots[v], reference_hf_state(cfg, "qwen3", dtype=dtype), shard)
        assert received[v].keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(received[v][name], tensor), (v, name)
    # the trainers really changed their weights between versions
    assert not torch.equal(received[1]["model.layers.0.self_attn.q_proj.weight"],
                           received[2]["model.layers.0.self_attn.q_proj.weight"])


def test_warm_cycles_register_and_prepare_nothing(live):
    _, _, stats, counters, _, trainers = live
    assert stats[1].cold and not stats[2].cold and not stats[3].cold
    frozen = ("registrations", "registered_bytes", "remote_agents", "dlists", "xfers", "plans_built")
    for v in (2, 3):
        assert {k: counters[v][k] for k in frozen} == {k: counters[1][k] for k in frozen}
        assert counters[v]["posts"] == counters[v - 1]["posts"] + 2  # one READ per trainer rank
    assert counters[1]["xfers"] == 2 and counters[1]["plans_built"] == 1
    # each trainer registered once and never again
    for t in trainers:
        assert [c["registrations"] for c in t["counters"]] == [1] * VERSIONS
    assert stats[3].bytes_moved == stats[3].model_bytes
    assert set(stats[3].seconds) == {"discover", "version", "plan", "prepare", "pull", "pull.read", "pull.scratch", "fence"}


def test_dead_peer_fails_naming_it():
    rdzv, group, _ = _start("dead", 2)
    receiver = RefitReceiver(rdzv, name="receiver-dead", timeout=60)
    list(receiver.run_refit_cycle(1))
    group.kill(1)
    receiver.timeout = 10
    with pytest.raises(TransferError, match=r"peer 'megarefit-trainer-1-0-0' \(trainer rank 1\.0\.0 as tp\.pp\.ep\).*bytes \["):
        list(receiver.run_refit_cycle(1))
    rdzv.mark_consumed(1)
    with pytest.raises(RuntimeError, match="worker 1"):
        group.join(timeout=60)
