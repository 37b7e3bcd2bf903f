"""Run by test_vllm_draft.py in its own process (one vLLM engine per process): a GLM-4.5
model served with MTP speculative decoding (``speculative_config={"method": "mtp"}``) on
vLLM CPU, refitted through vLLM's weight-transfer API with the ``megarefit`` backend from
two trainer ranks (tp=2, one MTP layer) publishing over NIXL.

Version 1 is pulled as full HF tensors, version 2 as the workers' own shards (``sharded``).
Each version: the target update (``start_weight_update`` -> ``update_weights`` ->
``finish_weight_update``), then the draft update (``start_draft_weight_update`` -> the
same). Prints one JSON line: per stage, which version the drafter's MTP-only parameters
(``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``: plain modules vLLM never repacks)
hold, whether the drafter's embedding is still the target's, vLLM's greedy generation
(with speculative decoding) and HF's from that version's weights.

With ``http``: the same model served by vLLM's OpenAI server (``vllm serve``, started as a
module) with ``--speculative-config``, refitted to version 1 by
:class:`~megarefit.integrations.vllm_http.VllmHttpRefit` ``refit(1, draft=True)``; prints
greedy ``/v1/completions`` and HF's, ``/weight_info``, and what the trainers'
``wait_receivers`` saw.

Usage: ``python vllm_draft_scenario.py WORKDIR [http]``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).parent))

OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def config() -> dict:
    from moe_cases import moe_config

    return moe_config("GLM-4.5-Air", head_dim=32, num_nextn_predict_layers=1)  # vllm-cpu attention: head_dim 32


def _states(cfg: dict, work: Path) -> list[dict[str, torch.Tensor]]:
    """Versions 0, 1, 2: random tensors under transformers' names and shapes, plus MTP layer N."""
    from reference import hf_checkpoint_state, with_mtp_layer

    first = with_mtp_layer(cfg, hf_checkpoint_state(cfg, work / "hf-0", seed=0), seed=10)
    g = torch.Generator().manual_seed(1)
    return [first] + [{k: torch.randn(t.shape, generator=g) for k, t in first.items()} for _ in range(2)]


def _which(drafter: torch.nn.Module, states: list[dict[str, torch.Tensor]], n: int) -> list[int | None]:
    """Per MTP-only parameter of layer ``n``: the version whose bytes it holds (``None``: none)."""
    params = dict(drafter.named_parameters())
    out = []
    for leaf in OWN:
        live = params[f"model.layers.{n}.{leaf}"]
        out.append(next((v for v, s in enumerate(states) if torch.equal(live, s[f"model.layers.{n}.{leaf}"])), None))
    return out


def main(work: Path) -> dict:
    import vllm
    from conftest import hf_model_from
    from vllm.config import WeightTransferConfig
    from vllm_helpers import hf_generate, vllm_generate

    import megarefit
    from megarefit.integrations.hf import save_checkpoint
    from megarefit.integrations.vllm import register
    from megarefit.layout.megatron_model import source_layout
    from megarefit.online import Publisher
    from megarefit.online.store.rendezvous import Rendezvous

    register()
    cfg = config()
    n = cfg["num_hidden_layers"]
    states = _states(cfg, work)
    save_checkpoint(work / "ckpt", cfg, states[0])
    job = "vllm-draft"
    rdzv = Rendezvous.serve(job=job)
    params = {r: {k: t.clone() for k, t in s.items()}
              for r, s in megarefit.hf_to_megatron(states[1], cfg, tp=2, mtp_layers=1).items()}
    pubs = [Publisher(params[r], cfg, rank=r, layout=source_layout(cfg, tp=2, pp=1, mtp_layers=1), rendezvous=rdzv,
                      agent_name=f"{job}-trainer-{r[0]}") for r in sorted(params)]
    llm = vllm.LLM(model=str(work / "ckpt"), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                   max_model_len=128, speculative_config={"method": "mtp", "num_speculative_tokens": 1},
                   disable_log_stats=False,
                   weight_transfer_config=WeightTransferConfig(backend="megarefit"))
    core = llm.llm_engine.engine_core
    worker = getattr(core, "engine_core", core).model_executor.driver_worker.worker
    target, drafter = worker.model_runner.get_model(), worker.model_runner.drafter.model
    out: dict = {"drafter": type(drafter).__name__, "stages": {}}

    hf_out: dict[int, list] = {}  # HF transformers' greedy generation per version

    def stage(name: str, version: int) -> None:
        if version not in hf_out:
            hf = {k: v for k, v in states[version].items() if not k.startswith(f"model.layers.{n}.")}
            hf_out[version] = hf_generate(hf_model_from(hf, cfg, work / f"hf-model-{version}"))
        out["stages"][name] = {
            "draft_holds": _which(drafter, states, n),
            "embedding_shared": drafter.model.embed_tokens.weight is target.model.embed_tokens.weight,
            "vllm": vllm_generate(llm),
            "hf": hf_out[version],
        }

    stage("initial", 0)
    for version, sharded in ((1, False), (2, True)):
        if version == 2:
            for p in pubs:  # the trainers' next step: version 2's weights in place, then published
                for k, t in megarefit.hf_to_megatron(states[2], cfg, tp=2, mtp_layers=1)[p.rank].items():
                    params[p.rank][k].copy_(t)
        for p in pubs:
            p.publish(version)
        llm.init_weight_transfer_engine({"init_info": {"host": "127.0.0.1", "port": rdzv.port, "job": job,
                                                       "sharded": sharded}})
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": version}})
        llm.finish_weight_update(weight_version=str(version))
        stage(f"v{version}-target", version)
        llm.start_draft_weight_update()
        llm.update_weights({"update_info": {"version": version}})
        llm.finish_weight_update(weight_version=str(version))
        engine = worker.weight_transfer_engine
        out[f"v{version}-draft-report"] = {k: engine.last_report[k] for k in ("tensors", "bytes_moved", "target")}
        stage(f"v{version}-draft", version)
    # the trainers may write again once every receiver (target and draft) acknowledged; v1's are closed
    out["acks"] = sorted(pubs[0].wait_receivers(2, timeout=60, lease=2).values())
    out["draft_tokens"] = sum(getattr(m, "value", 0) for m in llm.get_metrics()
                              if m.name == "vllm:spec_decode_num_draft_tokens")
    return out


def main_http(work: Path) -> dict:
    import subprocess

    from conftest import hf_model_from
    from vllm_helpers import bpe_tokenizer, completions, hf_generate, stop_server, wait_healthy

    import megarefit
    from megarefit.demo.workers import free_port
    from megarefit.integrations.hf import save_checkpoint
    from megarefit.integrations.vllm_http import VllmHttpRefit
    from megarefit.layout.megatron_model import source_layout
    from megarefit.online import Publisher
    from megarefit.online.store.rendezvous import Rendezvous

    cfg = config()
    n = cfg["num_hidden_layers"]
    states = _states(cfg, work)[:2]
    save_checkpoint(work / "ckpt", cfg, states[0])
    bpe_tokenizer(work / "ckpt", cfg["vocab_size"])  # the OpenAI server's completions need one
    job = "vllm-draft-http"
    rdzv = Rendezvous.serve(job=job)
    params = megarefit.hf_to_megatron(states[1], cfg, tp=2, mtp_layers=1)
    pubs = [Publisher({k: t.clone() for k, t in params[r].items()}, cfg, rank=r,
                      layout=source_layout(cfg, tp=2, pp=1, mtp_layers=1), rendezvous=rdzv,
                      agent_name=f"{job}-trainer-{r[0]}") for r in sorted(params)]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    out: dict = {}
    with open(work / "server.log", "w+") as log:
        server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                   str(work / "ckpt"), "--host", "127.0.0.1", "--port", str(port), "--dtype",
                                   "float32", "--enforce-eager", "--max-model-len", "128",
                                   "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 1}),
                                   "--weight-transfer-config", json.dumps({"backend": "megarefit"})],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(base, server, log)
            for p in pubs:
                p.publish(1)
            refit = VllmHttpRefit(base)
            refit.init("127.0.0.1", rdzv.port, job, timeout=120.0, sharded=True)
            out["seconds"] = refit.refit(1, draft=True)
            out["version"] = refit.weight_version()
            out["acks"] = sorted(pubs[0].wait_receivers(1, timeout=60).values())
            out["vllm"] = completions(base, str(work / "ckpt"))
        finally:
            stop_server(server)
    hf = {k: v for k, v in states[1].items() if not k.startswith(f"model.layers.{n}.")}
    out["hf"] = hf_generate(hf_model_from(hf, cfg, work / "hf-model"))
    return out


if __name__ == "__main__":
    run = main_http if "http" in sys.argv[2:] else main
    print(json.dumps(run(Path(sys.argv[1]))))
