"""Each vLLM engine reads one data-parallel copy of the trainers (``replica`` / ``replicas``).

Four real Megatron-Core trainer processes (gloo, TP=2 x DP=2, every copy serving: global ranks
0, 1 are copy 0, ranks 2, 3 copy 1, Megatron's tp-dp rank order) publish two weight versions of
a tied-embedding model; one real vLLM engine (vllm-cpu, in this process) refits each:

* version 1 as engine 0 of 2, through vLLM's weight-transfer API (backend ``megarefit``,
  ``init_info`` ``{"replica": 0, "replicas": 2}``): NIXL itself (``check_remote_metadata``)
  holds the metadata of copy 0's two agents and of neither of copy 1's;
* version 2 as engine 1 of 2, through the worker extension (``init_megarefit(replica=1,
  replicas=2)``), after copy 0's processes were SIGKILLed: the refit succeeds with no failover
  (it never tried a dead rank) and NIXL holds copy 1's agents alone.

After each, greedy generation equals HF transformers loaded with the read copy's trainer
snapshot, translated by the independent reference sharder (tests/reference.py). Out-of-range
values are refused on both init paths, naming the field and what to give, and a refused
``init_weight_transfer_engine`` leaves the engine's receiver in place.
"""

from __future__ import annotations

import functools
import os
import re
import time

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
vllm = pytest.importorskip("vllm")
pytest.importorskip("nixl")
pytest.importorskip("megatron.core")

from reference import hf_checkpoint_state, reference_shards, unshard
from vllm_helpers import EXT, e2e_config, hf_generate, initial_checkpoint, same_generation, vllm_generate

from megarefit.demo.trainer_jobs import TrainerCase, serving_trainer_job
from megarefit.demo.workers import start_workers
from megarefit.integrations.hf import save_checkpoint
from megarefit.layout import RankCoord
from megarefit.online.store.rendezvous import Rendezvous

pytestmark = pytest.mark.megatron

# The trainers' NIXL agents, as the Publisher names them (docs/multinode.md): copy 0, copy 1.
AGENTS = {0: ("megarefit-trainer-0-0-0", "megarefit-trainer-1-0-0"),
          1: ("megarefit-trainer-0-0-0-1", "megarefit-trainer-1-0-0-1")}
COORDS = [RankCoord(t, 0, 0, c) for c in (0, 1) for t in (0, 1)]
BAD = [({"replica": 2, "replicas": 2}, r"replica=2 with replicas=2.*0 <= replica < replicas \(0\.\.1\)"),
       ({"replica": -1, "replicas": 2}, r"replica=-1 with replicas=2"),
       ({"replica": 0, "replicas": 0}, r"replicas=0: the number of vLLM engines"),
       ({"replica": "1", "replicas": 2}, r"replica='1': an int is needed")]


def _loaded_agents(worker, path: str) -> dict[str, bool]:
    """Run in the vLLM worker: which trainer agents its receiver's NIXL agent holds metadata of."""
    receiver = worker._megarefit if path == "extension" else worker.weight_transfer_engine.receiver
    if receiver is None:  # (an init that failed after closing the old receiver)
        return {}
    agent = receiver.transport.nixl.agent
    return {name: bool(agent.check_remote_metadata(name)) for names in AGENTS.values() for name in names}


def _refused(call) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the message is what the tests check
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def _wait_published(rdzv: Rendezvous, version: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while any(v != version for v in rdzv.versions(COORDS).values()):
        assert time.monotonic() < deadline, f"version {version} not published by every rank: {rdzv.versions(COORDS)}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from vllm.config import WeightTransferConfig

    from megarefit.integrations.vllm import register

    register()  # the entry point does this in vLLM's own processes; explicit here for in-process use
    cfg, job = e2e_config(), "vllm-replicas"
    rdzv = Rendezvous.serve(job=job)
    ckpt, snapdir = tmp_path_factory.mktemp("initial"), tmp_path_factory.mktemp("snapshots")
    initial_checkpoint(ckpt, cfg)
    tokens = torch.randint(0, cfg["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(3))
    group = start_workers(serving_trainer_job, world_size=4,
                          args=(TrainerCase(job, cfg, 2, 1, tokens), ("127.0.0.1", rdzv.port, job), 2, 0.01,
                                str(snapdir)))
    llm = vllm.LLM(model=str(ckpt), dtype="float32", enforce_eager=True, max_model_len=128,
                   worker_extension_cls=EXT, weight_transfer_config=WeightTransferConfig(backend="megarefit"))
    where = {"host": "127.0.0.1", "port": rdzv.port, "job": job, "timeout": 60.0}
    out = {"initial": vllm_generate(llm), "refused": {}}
    for i, (bad, _) in enumerate(BAD):  # the real init paths, before any receiver exists
        out["refused"][("extension", i)] = _refused(lambda b=bad: llm.collective_rpc(
            "init_megarefit", args=("127.0.0.1", rdzv.port, job, 60.0), kwargs=b))
        out["refused"][("engine", i)] = _refused(
            lambda b=bad: llm.init_weight_transfer_engine({"init_info": {**where, **b}}))

    llm.init_weight_transfer_engine({"init_info": {**where, "replica": 0, "replicas": 2}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 1}})
    llm.finish_weight_update(weight_version="1")
    out["report", 1] = llm.collective_rpc("megarefit_report", kwargs={"path": "engine"})[0]
    out["agents", 1] = llm.collective_rpc(_loaded_agents, args=("engine",))[0]
    out[1] = vllm_generate(llm)
    out["refused_later"] = _refused(lambda: llm.init_weight_transfer_engine(
        {"init_info": {**where, "replica": 2, "replicas": 2}}))
    out["receiver_kept"] = llm.collective_rpc(_loaded_agents, args=("engine",))[0] == out["agents", 1]
    rdzv.mark_consumed(1)

    _wait_published(rdzv, 2)  # copy 0's manifests of version 2 are in the store; then it dies
    group.kill(0)
    group.kill(1)
    llm.collective_rpc("init_megarefit", args=("127.0.0.1", rdzv.port, job, 60.0),
                       kwargs={"replica": 1, "replicas": 2})
    out["report", 2] = llm.collective_rpc("update_weights_from_megatron", args=(2,))[0]
    out["agents", 2] = llm.collective_rpc(_loaded_agents, args=("extension",))[0]
    out[2] = vllm_generate(llm)
    rdzv.mark_consumed(2)
    with pytest.raises(RuntimeError, match="worker [01]"):
        group.join(timeout=120)
    read = {1: "", 2: "-copy1"}  # the copy each version was read from
    snapshots = {v: {(t, 0, 0): torch.load(snapdir / f"v{v}-tp{t}-pp0-ep0{read[v]}.pt") for t in range(2)}
                 for v in (1, 2)}
    return cfg, out, snapshots


def _hf_model(cfg, shards, tmp_path):
    """HF transformers loaded (from_pretrained) with a version's trainer snapshot, translated
    offline by the reference sharder: no megarefit layout code."""
    import transformers

    like = hf_checkpoint_state(cfg, tmp_path / "like")
    hf = unshard(shards, like, functools.partial(reference_shards, cfg=cfg, tp=2, pp=1))
    save_checkpoint(tmp_path / "hf", cfg, hf)
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()


@pytest.mark.parametrize("version", [1, 2])
def test_the_engine_serves_the_copy_it_read(run, version, tmp_path):
    cfg, out, snapshots = run
    want = hf_generate(_hf_model(cfg, snapshots[version], tmp_path))
    assert same_generation(out[version], want), (out[version], want)
    assert out[version] != out["initial"]  # the refit changed the engine's weights
    assert out["report", version]["version"] == version


def test_engine_0_of_2_reads_copy_0_alone(run):
    """vLLM's weight-transfer API with ``replica=0, replicas=2``: NIXL loaded copy 0's agents only
    (``replicas=1`` would spread this one engine's reads over both copies)."""
    _, out, _ = run
    want = {name: name in AGENTS[0] for names in AGENTS.values() for name in names}
    assert out["agents", 1] == want, out["agents", 1]
    assert out["report", 1]["failovers"] == ()


def test_engine_1_of_2_reads_copy_1_alone_with_copy_0_dead(run):
    """The worker extension with ``replica=1, replicas=2``, copy 0 SIGKILLed first: no READ met a
    dead rank (a failover would name it) and NIXL loaded copy 1's agents only."""
    _, out, _ = run
    assert out["report", 2]["failovers"] == (), out["report", 2]["failovers"]
    assert out["report", 2]["bytes_moved"] > 0
    want = {name: name in AGENTS[1] for names in AGENTS.values() for name in names}
    assert out["agents", 2] == want, out["agents", 2]


@pytest.mark.parametrize("path", ["extension", "engine"])
@pytest.mark.parametrize("case", range(len(BAD)), ids=lambda i: "{replica}-of-{replicas}".format(**BAD[i][0]))
def test_an_out_of_range_replica_is_refused_naming_the_field(run, path, case):
    """``init_megarefit`` and ``init_weight_transfer_engine`` (vLLM's ``parse_init_info``) refuse it
    before any receiver is built, saying what to give."""
    _, out, _ = run
    error = out["refused"][path, case]
    assert error.startswith("MegarefitError: "), error
    assert re.search(BAD[case][1], error), error
    assert "give engine i of N engines replica=i, replicas=N" in error, error


def test_a_refused_init_leaves_the_engines_receiver(run):
    _, out, _ = run
    assert "replica=2 with replicas=2" in out["refused_later"], out["refused_later"]
    assert out["receiver_kept"]
