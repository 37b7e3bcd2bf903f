"""Run by test_vllm_refit.py in its own process (one vLLM engine per process): trainer ranks
that step *during* a streamed refit into a real vLLM engine (CPU).

Two in-process trainer ranks (tp=2, NIXL publishers) serve a tiny Qwen3 model whose shards
are cut from HF weights by the test's own reference code (not megarefit). The vLLM worker
extension streams sharded refits through a small ring. A hook on the receiver's transport
makes both ranks step to the next version right after the first group landed, so the cycle
tears mid-install. Version 1 comes through vLLM's weight-transfer API (backend
``megarefit``, streamed and sharded, ``engine``); then, through the extension, a second
refit of the same version (``first``), and the torn ones. Prints one JSON line:

- ``retried``: the torn cycle was pulled and installed again (``retries``); vLLM's greedy
  tokens + logprobs then equal HF's with the new version's weights;
- ``gave_up``: with ``retries=0`` the update raises PartialUpdateError (the model holds a
  mix); ``mended``: the next refit completes and the engine serves the newest version;
- ``refused``: after another torn update, generating raises instead of serving the mix (in
  vLLM an exception in ``execute_model`` stops the engine: nothing is served).

Usage: ``python vllm_torn_scenario.py WORKDIR``."""

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

BUDGET = 1_200_000  # bytes: a ring of one layer (~790 kB of float32) beside the scratch; the share is 3.7 MB


def _worker(llm):
    """The in-process vLLM worker (uniproc executor, no engine-core process)."""
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    return core.model_executor.driver_worker.worker


def main(work: Path) -> dict:
    import vllm
    from conftest import tiny_config
    from reference import reference_shards
    from vllm.config import WeightTransferConfig
    from vllm_helpers import EXT, generate_or_refusal, hf_generate, same_generation, vllm_generate

    from megarefit.integrations.hf import build_hf_model, save_checkpoint
    from megarefit.integrations.vllm import register
    from megarefit.layout.megatron_model import source_layout
    from megarefit.online.delta.log import DeltaOptions
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.publisher import Publisher

    cfg = tiny_config("Qwen3-0.6B", vocab_size=500, hidden_size=128, intermediate_size=256, head_dim=64,
                      tie_word_embeddings=False)
    models = {}
    for v in range(4):  # version 0 is the checkpoint vLLM starts from
        torch.manual_seed(v)
        models[v] = build_hf_model(cfg).eval()
    models[4] = build_hf_model(cfg).eval()  # version 4: version 3 with 1% of each tensor's elements moved
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for (n, t), (_, w) in zip(models[4].state_dict().items(), models[3].state_dict().items()):
            t.copy_(w)
            t.view(-1)[torch.rand(t.numel(), generator=g) < 0.01] *= 1.5
    shards = {v: reference_shards(dict(models[v].state_dict()), cfg, tp=2, pp=1) for v in (1, 2, 3, 4)}
    save_checkpoint(work / "ckpt", cfg, dict(models[0].state_dict()))

    job = "vllm-torn"
    rdzv = Rendezvous.serve(job=job)
    live = {r: {n: t.clone() for n, t in s.items()} for r, s in shards[1].items()}
    pubs = [Publisher(live[r], cfg, rank=r, layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv,
                      agent_name=f"{job}-t{r[0]}", checksums=True, delta=DeltaOptions(capacity=1.0)) for r in live]

    def step(version: int, content: int | None = None) -> None:
        """Publish ``version`` holding the weights of ``content`` (default: its own)."""
        for pub in pubs:
            with pub.updating(version):
                for n, t in live[pub.rank].items():
                    t.copy_(shards[content or version][pub.rank][n])

    def tear_at_first_group(version: int, content: int | None = None) -> None:
        receiver = _worker(llm)._megarefit
        wait, calls = receiver.transport.wait, []

        def wait_then_step(*args, **kwargs):  # the first group landed (streamed: pulls are start + wait)
            wait(*args, **kwargs)
            calls.append(1)
            if len(calls) == 1:
                step(version, content)

        receiver.transport.wait = wait_then_step

    def update(retries: int) -> str | dict:
        receiver = _worker(llm)._megarefit
        receiver.retries = retries
        try:
            return llm.collective_rpc("update_weights_from_megatron")[0]
        except Exception as exc:  # noqa: BLE001 - recorded and checked by the test
            return f"{type(exc).__name__}: {exc}"

    for p in pubs:
        p.publish(1)
    register()
    llm = vllm.LLM(model=str(work / "ckpt"), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                   max_model_len=128, worker_extension_cls=EXT,
                   weight_transfer_config=WeightTransferConfig(backend="megarefit"))
    out: dict = {}
    # version 1 through vLLM's weight-transfer API, streamed and sharded, in one update
    llm.init_weight_transfer_engine({"init_info": {"host": "127.0.0.1", "port": rdzv.port, "job": job,
                                                   "sharded": True, "memory_budget": BUDGET,
                                                   "verify_checksums": True}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 1}})
    llm.finish_weight_update(weight_version="1")
    out["engine"] = _worker(llm).weight_transfer_engine.last_report
    out["ok1"] = same_generation(vllm_generate(llm), hf_generate(models[1]))
    # the rest through the worker extension, streamed and sharded
    llm.collective_rpc("init_megarefit", args=("127.0.0.1", rdzv.port, job, 60.0, True, BUDGET, True, True))
    out["first"] = update(2)

    tear_at_first_group(2)  # torn, pulled again whole
    out["retried"] = update(2)
    out["ok2"] = same_generation(vllm_generate(llm), hf_generate(models[2]))

    tear_at_first_group(3)  # torn, no retry: the model holds versions 2 and 3
    out["gave_up"] = update(0)
    out["mended"] = update(2)  # refit again before serving: version 3 whole
    out["ok3"] = same_generation(vllm_generate(llm), hf_generate(models[3]))

    # version 3 whole: what vLLM keeps in place holds it; a sparse step patches only its changed elements
    step(4)
    _worker(llm)._megarefit.delta_model.rates.update(tensor=0.0, wire=1e9, delta_wire=1e9, scatter=1e9, full=0.0)
    _worker(llm)._megarefit.delta_model.learn = False  # (the choice must not depend on this machine's speed)
    out["delta"] = update(2)
    out["ok4"] = same_generation(vllm_generate(llm), hf_generate(models[4]))

    step(5, content=2)  # a torn cycle again (versions only move forward: 5 and 6 hold 2's and 3's weights),
    tear_at_first_group(6, content=3)  # and this time a request comes before any refit
    out["gave_up_again"] = update(0)
    out.update(generate_or_refusal(llm, "served_mix"))
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1])), default=str))
