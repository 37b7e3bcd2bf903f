"""vLLM's trainer-side engine chosen by name: ``backend="megarefit"`` on both ends, through vLLM's
own factories (``WeightTransferTrainerFactory`` in the trainers, ``WeightTransferEngineFactory``
from ``WeightTransferConfig(backend="megarefit")`` in vLLM), registered by vLLM's plugin loader.

Two real Megatron-Core trainer processes (gloo, tp 2) each call vLLM's
``WeightTransferTrainerFactory.trainer_init(MegarefitTrainerInitInfo(...))`` and ``send_weights()``
for two versions (a step between them): each rank publishes, rank 0 drives vLLM's update, the
workers pull, every rank returns once they acknowledged. Once into an in-process ``LLM`` (vllm-cpu;
rank 0 reaches it over a pipe, as vLLM's Ray client reaches an ``LLM`` actor, and the test process
runs the calls with megarefit's ``LLMWeightSyncClient``), once into a real ``vllm serve`` through
vLLM's own ``HTTPVLLMWeightSyncClient`` (sharded refits). After each version, greedy tokens and
logprobs equal HF transformers' loaded with the trainers' weights of that version (unsharded by
tests/reference.py, not megarefit). Then the refusals: bad init info, a foreign source / client /
init info, vLLM internals missing.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Listener

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
vllm = pytest.importorskip("vllm")
pytest.importorskip("nixl")
pytest.importorskip("megatron.core")

from reference import hf_checkpoint_state, reference_shards, unshard
from vllm_helpers import (
    completions,
    e2e_config,
    hf_generate,
    initial_checkpoint,
    same_generation,
    stop_server,
    vllm_generate,
    wait_healthy,
)
from vllm_trainer_jobs import engine_trainer_job

from megarefit.demo.workers import free_port, start_workers
from megarefit.integrations.hf import save_checkpoint
from megarefit.online.store.rendezvous import Rendezvous

pytestmark = pytest.mark.megatron
VERSIONS = 2


def _serve_pipe(listener: Listener, llm, out: dict) -> None:
    """Run trainer rank 0's weight-sync calls on ``llm`` (megarefit's ``LLMWeightSyncClient``); after
    each finish, record the engine's greedy generation and weight label under the version."""
    from megarefit.integrations.vllm_trainer import LLMWeightSyncClient

    client = LLMWeightSyncClient(llm)
    accepted: list = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
    thread.start()
    thread.join(timeout=300)
    assert accepted, "trainer rank 0 never connected"
    conn = accepted[0]
    while True:
        assert conn.poll(300), f"no call from trainer rank 0 for 300 s after {out['calls'][-1:]}"
        method, args, kwargs = conn.recv()
        out["calls"].append(method)
        if method == "close":
            return
        try:
            getattr(client, method)(*args, **kwargs)
            if method == "finish_weight_update":
                version = int(kwargs["weight_version"])
                out[version], out["labels"][version] = vllm_generate(llm), llm.get_weight_version()
            conn.send(("ok", None))
        except Exception as exc:  # noqa: BLE001 - sent to the trainer, which raises it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    from vllm.config import WeightTransferConfig

    from megarefit.integrations.vllm import register

    register()  # the entry point does this in vLLM's own processes; explicit here for in-process use
    cfg, job = e2e_config(), "vllm-trainer-engine"
    rdzv = Rendezvous.serve(job=job)
    ckpt, snapdir = tmp_path_factory.mktemp("initial"), tmp_path_factory.mktemp("snapshots")
    initial_checkpoint(ckpt, cfg)
    authkey = os.urandom(16)
    with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
        trainers = start_workers(engine_trainer_job, world_size=2, start_method="spawn",
                                 args=(cfg, ("127.0.0.1", rdzv.port, job), ("pipe", listener.address, authkey),
                                       VERSIONS, str(snapdir), {}))
        llm = vllm.LLM(model=str(ckpt), dtype="float32", enforce_eager=True, max_model_len=128,
                       weight_transfer_config=WeightTransferConfig(backend="megarefit"))
        out: dict = {"initial": vllm_generate(llm), "calls": [], "labels": {}}
        _serve_pipe(listener, llm, out)
        out["trainers"] = trainers.join(timeout=300)
    return cfg, out, _snapshots(snapdir)


@pytest.fixture(scope="module")
def over_http(tmp_path_factory):
    cfg, job = e2e_config(), "vllm-trainer-engine-http"
    rdzv = Rendezvous.serve(job=job)
    ckpt, snapdir = tmp_path_factory.mktemp("initial-http"), tmp_path_factory.mktemp("snapshots-http")
    initial_checkpoint(ckpt, cfg)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")  # noqa: SIM115 - closed below
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
                               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
                               "--max-model-len", "128", "--weight-transfer-config",
                               json.dumps({"backend": "megarefit"})], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(base, server, log)  # vLLM's HTTP client does not retry a refused connection
        initial = completions(base, str(ckpt))
        trainers = start_workers(engine_trainer_job, world_size=2, start_method="spawn",
                                 args=(cfg, ("127.0.0.1", rdzv.port, job), ("http", base), VERSIONS, str(snapdir),
                                       {"sharded": True}, True))
        out: dict = {"initial": initial, "labels": {}}
        for v in range(1, VERSIONS + 1):
            deadline = time.monotonic() + 300
            while _weight_info(base) != str(v):  # labelled at finish_weight_update: served from then on
                trainers.check()  # a trainer's error, now
                assert time.monotonic() < deadline, f"version {v} never served"
                time.sleep(0.05)
            out[v], out["labels"][v] = completions(base, str(ckpt)), _weight_info(base)
            rdzv.mark_consumed(v)  # the trainers step to the next version
        out["trainers"] = trainers.join(timeout=300)
    finally:
        stop_server(server)
        log.close()
    return cfg, out, _snapshots(snapdir)


def _weight_info(base: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{base}/weight_info", timeout=30) as response:
        return json.loads(response.read())["weight_version"]


def _snapshots(snapdir) -> dict:
    return {v: {(t, 0, 0): torch.load(snapdir / f"v{v}-tp{t}-pp0-ep0.pt") for t in range(2)}
            for v in range(1, VERSIONS + 1)}


def _hf(cfg, shards, tmp_path):
    import transformers

    like = hf_checkpoint_state(cfg, tmp_path / "like")  # HF's own names and shapes (save_pretrained)
    hf = unshard(shards, like, functools.partial(reference_shards, cfg=cfg, tp=2, pp=1))  # no megarefit layout code
    save_checkpoint(tmp_path / "hf", cfg, hf)
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()


@pytest.mark.parametrize("version", range(1, VERSIONS + 1))
def test_in_process_llm_serves_each_version_sent_by_name(in_process, version, tmp_path):
    cfg, out, snapshots = in_process
    want = hf_generate(_hf(cfg, snapshots[version], tmp_path))
    assert same_generation(out[version], want), (out[version], want)
    assert out[version] != out["initial"]
    assert out["labels"][version] == str(version)  # finish_weight_update labelled it


def test_vllms_factory_picked_megarefit_and_it_stayed_a_pull(in_process):
    """Each rank got megarefit's engine from vLLM's factory; rank 0 alone drove the four calls, in
    order, once per version; every rank returned only after the workers acknowledged its version;
    the init info sent to vLLM names the rendezvous, never the secret."""
    _, out, _ = in_process
    assert out["calls"] == (["init_weight_transfer_engine"]
                            + ["start_weight_update", "update_weights", "finish_weight_update"] * VERSIONS + ["close"])
    for result in out["trainers"]:
        assert result["engine"] == "MegarefitTrainerWeightTransferEngine"
        assert [r["version"] for r in result["reports"]] == list(range(1, VERSIONS + 1))
        assert all(list(r["receivers"].values()) == ["acked"] for r in result["reports"]), result["reports"]
        assert "secret" not in json.dumps(result["worker_init"]) and result["worker_init"]["port"] > 0


def test_source_metadata_lists_hfs_own_tensors(in_process, tmp_path):
    """``MegatronSource.metadata()`` (vLLM's WeightSource channel) names every HF tensor with HF's
    own shape (save_pretrained's names; the tied lm_head is not one)."""
    cfg, out, _ = in_process
    like = hf_checkpoint_state(cfg, tmp_path / "like")
    for result in out["trainers"]:
        got = {name: tuple(shape) for name, _, shape in result["metadata"]}
        assert got == {n: tuple(t.shape) for n, t in like.items()}


@pytest.mark.parametrize("version", range(1, VERSIONS + 1))
def test_vllms_http_client_carries_it(over_http, version, tmp_path):
    """Through vLLM's own HTTPVLLMWeightSyncClient (sharded refits): the server serves each version,
    labelled, and every rank saw it acknowledged."""
    cfg, out, snapshots = over_http
    want = hf_generate(_hf(cfg, snapshots[version], tmp_path))
    assert same_generation(out[version], want), (out[version], want)
    assert out[version] != out["initial"] and out["labels"][version] == str(version)
    for result in out["trainers"]:
        report = result["reports"][version - 1]
        assert report["version"] == version and list(report["receivers"].values()) == ["acked"], report
        assert result["worker_init"]["sharded"] is True


def _info(**fields):
    from megarefit.integrations.vllm_trainer import MegarefitTrainerInitInfo

    return MegarefitTrainerInitInfo(**{"rank": 0, "host": "127.0.0.1", "port": 29600, **fields})


@pytest.mark.parametrize(("fields", "says"), [
    ({"rank": -1}, "rank=-1"), ({"port": "29600"}, "port='29600'"), ({"port": 0}, "port=0"), ({"host": ""}, "host=''"),
    ({"ack_timeout": 0}, "ack_timeout=0"), ({"worker": {"secret": "s" * 32}}, "MEGAREFIT_JOB_SECRET"),
    ({"worker": {"sharded": True, "bogus": 1}}, "unknown worker options ['bogus']")])
def test_bad_init_info_is_refused_naming_the_field(fields, says):
    from megarefit.integrations.vllm_trainer import TrainerInitError

    with pytest.raises(TrainerInitError, match=f"^MegarefitTrainerInitInfo .*{__import__('re').escape(says)}"):
        _info(**fields)
    with pytest.raises(TypeError, match="secret"):  # no field carries the job secret
        _info(secret="s" * 32)
    assert "secret" not in _info(worker={"sharded": True}).worker_init_info()


def test_a_foreign_init_info_source_or_client_is_refused_before_any_connection():
    """vLLM's factory dispatches on ``backend``: a foreign init info of that name, a source that
    is not a MegatronSource, a client without vLLM's four calls are refused, naming the fix."""
    from dataclasses import dataclass
    from typing import ClassVar

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource, TrainerInitInfo

    from megarefit.integrations.vllm import register
    from megarefit.integrations.vllm_trainer import TrainerInitError, megatron_source_class

    register()

    @dataclass(kw_only=True)
    class Foreign(TrainerInitInfo):
        backend: ClassVar[str] = "megarefit"

    source = megatron_source_class()(torch.nn.Linear(2, 2), e2e_config())
    with pytest.raises(TrainerInitError, match="takes a megarefit.integrations.vllm_trainer.MegarefitTrainerInitInfo"):
        WeightTransferTrainerFactory.trainer_init(Foreign(rank=0), client=None, source=source)
    with pytest.raises(TrainerInitError, match=r"source is a ModuleSource.*MegatronSource\(model, hf_config\)"):
        WeightTransferTrainerFactory.trainer_init(_info(), client=None, source=ModuleSource(torch.nn.Linear(2, 2)))
    with pytest.raises(TrainerInitError, match=r"client object lacks \['init_weight_transfer_engine'"):
        WeightTransferTrainerFactory.trainer_init(_info(), client=object(), source=source)
    with pytest.raises(Exception, match="never gathers full HF tensors"):
        next(iter(source))


def test_missing_vllm_internals_are_refused_naming_the_version(monkeypatch):
    """A vLLM without the trainer factory (before 0.32): asking for the trainer engine raises
    VllmVersionError naming the installed version; the worker engine still registers."""
    from vllm.distributed.weight_transfer import factory

    from megarefit.integrations import vllm_trainer
    from megarefit.integrations.vllm import register
    from megarefit.integrations.vllm_install import VllmVersionError

    vllm_trainer.trainer_api.cache_clear()
    monkeypatch.delattr(factory, "WeightTransferTrainerFactory")
    monkeypatch.setattr(factory.WeightTransferEngineFactory, "_registry",
                        {k: v for k, v in factory.WeightTransferEngineFactory._registry.items() if k != "megarefit"})
    try:
        with pytest.raises(VllmVersionError, match=rf"^vLLM {vllm.__version__}: .*'WeightTransferTrainerFactory'"):
            vllm_trainer.register_trainer()
        register()  # the entry point in a vLLM process: the worker side, no trainer side to register
        assert "megarefit" in factory.WeightTransferEngineFactory._registry
    finally:
        vllm_trainer.trainer_api.cache_clear()
