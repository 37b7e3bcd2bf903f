"""Run by test_vllm_failsafe.py in its own process (one vLLM engine per process): weight updates
through vLLM's weight-transfer API (backend ``megarefit``) that fail *inside vLLM's install*,
midway, into a real vLLM engine (CPU) of a tied-embedding Qwen3 model.

Two in-process trainer ranks (tp=2, NIXL publishers) serve versions whose shards are cut from HF
weights by the test's own reference code (not megarefit). The fault: vLLM's linear layers'
``process_weights_after_loading`` (what vLLM's layerwise reload runs on a layer once it has all its
weights, before copying it into the live tensors) raises on its ``FAULT_AT``-th call, so the
embedding (and the tied LM head) and the first layers already hold the new version when it fails.
Prints one JSON line; each entry's generation is compared by the test against HF's with the
version it names:

- ``sharded_1``: a sharded, staged update of a tied model (vLLM's ``tie_weights`` shares the
  embedding with ``lm_head``), then ``full_2`` (switched to full HF tensors with
  ``/init_weight_transfer_engine``), ``sharded_3`` (switched back);
- ``fault_sharded`` / ``fault_full``: an update to the next version fails midway (``calls``: linear
  layers processed before the fault); the engine must serve the previous version exactly; the
  same streamed through a bounded ring (``fault_streamed_sharded`` / ``fault_streamed_full``);
- ``open_refusal``, ``abandon_empty``, ``stale_start``, ``second_update`` (:func:`open_updates`):
  updates left open, ended unserved; the engine must serve version 3 after each;
- ``fault_unkept``: the same with ``keep_previous=0``: the error says the model holds a mix and
  the engine refuses; ``unkept_mix``: generating with that refusal lifted (what the engine would
  serve) matches neither version; ``refused``: after another such failure, generating raises.

Usage: ``python vllm_failsafe_scenario.py WORKDIR``."""

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

FAULT_AT = 6  # linear layers processed before the fault: layer 0 whole (qkv, o, gate_up, down), layer 1 partly
BUDGET = 1_200_000  # streamed updates: a ring of one layer (~790 kB of float32) beside the scratch


def _worker(llm):
    """The in-process vLLM worker (uniproc executor, no engine-core process)."""
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    return core.model_executor.driver_worker.worker


class Fault:
    """Makes vLLM's unquantized linear post-load step raise on its ``at``-th call while armed."""

    def __init__(self, at: int) -> None:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        self.at, self.calls, self.armed = at, 0, False
        original = UnquantizedLinearMethod.process_weights_after_loading
        fault = self

        def process(method, layer):
            if fault.armed:
                fault.calls += 1
                if fault.calls == fault.at:
                    fault.armed = False
                    raise RuntimeError(f"injected fault in vLLM's install (linear layer {fault.calls})")
            return original(method, layer)

        UnquantizedLinearMethod.process_weights_after_loading = process

    def arm(self) -> None:
        self.calls, self.armed = 0, True


def open_updates(llm, served) -> dict:
    """Updates left open (issue 57), on the engine serving version 3 with its previous weights kept
    and the trainers publishing version 4 (version 1's weights). ``open_refusal``: the model's
    forward while an update is open; ``abandon_empty``: ``update_weights {"abandon": true}`` of an
    update that installed nothing; ``stale_start``: what the engine logs when its start finds an
    update still open that vLLM's worker had ended (the engine called as the worker calls it);
    ``second_update``: a second ``update_weights`` after version 4 was installed. ``served``
    records what the engine serves after each (version 3, always)."""
    import logging

    from vllm.config import set_current_vllm_config

    worker = _worker(llm)
    engine, model, said = worker.weight_transfer_engine, worker.model_runner.get_model(), []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("megarefit.integrations.vllm").addHandler(handler)
    out = {}
    llm.start_weight_update()
    try:
        model.forward()
    except Exception as exc:  # noqa: BLE001 - recorded and checked by the test
        out["open_refusal"] = f"{type(exc).__name__}: {exc}"
    for key, info in (("abandon_empty", {"abandon": True}), ("second_update", {"version": 4})):
        if key == "second_update":
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": 4, "timeout": 30.0}})
        try:
            llm.update_weights({"update_info": info})
        except Exception as exc:  # noqa: BLE001
            out[key] = f"{type(exc).__name__}: {exc}"
        served(f"after_{key}")
        if key == "abandon_empty":
            with set_current_vllm_config(worker.vllm_config):
                engine.start_weight_update()
                engine.start_weight_update()  # the first is still open in the engine
                engine.finish_weight_update()
            out["stale_start"] = said
            served("after_stale_start")
    return out


def main(work: Path) -> dict:
    import vllm
    from reference import reference_shards
    from vllm.config import WeightTransferConfig
    from vllm_helpers import e2e_config, generate_or_refusal, vllm_generate

    from megarefit.integrations.hf import build_hf_model, save_checkpoint
    from megarefit.integrations.vllm import register
    from megarefit.layout.megatron_model import source_layout
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.publisher import Publisher

    cfg = e2e_config()  # tied embeddings
    assert cfg["tie_word_embeddings"]
    hf = {}
    for v in range(4):  # version 0 is the checkpoint vLLM starts from
        torch.manual_seed(v)
        hf[v] = {k: t for k, t in build_hf_model(cfg).state_dict().items() if k != "lm_head.weight"}
    save_checkpoint(work / "ckpt", cfg, hf[0])
    shards = {v: reference_shards(hf[v], cfg, tp=2, pp=1) for v in (1, 2, 3)}
    for v in (1, 2, 3):
        torch.save(hf[v], work / f"hf{v}.pt")

    job = "vllm-failsafe"
    rdzv = Rendezvous.serve(job=job)
    live = {r: {n: t.clone() for n, t in s.items()} for r, s in shards[1].items()}
    pubs = [Publisher(live[r], cfg, rank=r, layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv,
                      agent_name=f"{job}-t{r[0]}") for r in live]

    def publish(version: int, content: int) -> None:
        for pub in pubs:
            with pub.updating(version):
                for n, t in live[pub.rank].items():
                    t.copy_(shards[content][pub.rank][n])

    register()
    llm = vllm.LLM(model=str(work / "ckpt"), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                   max_model_len=128, weight_transfer_config=WeightTransferConfig(backend="megarefit"))
    fault = Fault(FAULT_AT)
    out: dict = {}

    def init(**options) -> None:
        llm.init_weight_transfer_engine({"init_info": {"host": "127.0.0.1", "port": rdzv.port, "job": job,
                                                       **options}})

    def update(version: int, faulty: bool = False) -> str | None:
        if faulty:
            fault.arm()
        llm.start_weight_update()
        try:
            llm.update_weights({"update_info": {"version": version, "timeout": 30.0}})
        except Exception as exc:  # noqa: BLE001 - recorded and checked by the test
            return f"{type(exc).__name__}: {exc}"
        finally:
            fault.armed = False
        llm.finish_weight_update(weight_version=str(version))
        return None

    def served(key: str) -> None:
        out[key] = vllm_generate(llm)

    publish(1, 1)
    out["initial"] = vllm_generate(llm)
    init(sharded=True, keep_previous="auto")  # tied and sharded, staged: the reload is open while the shards are checked
    out["error_1"] = update(1)
    served("sharded_1")
    publish(2, 2)
    out["fault_sharded"] = {"error": update(2, faulty=True), "calls": fault.calls}
    served("after_fault_sharded")  # version 1
    init(keep_previous="auto")  # switch to full HF tensors
    out["error_2"] = update(2)
    served("full_2")
    publish(3, 3)
    out["fault_full"] = {"error": update(3, faulty=True), "calls": fault.calls}
    served("after_fault_full")  # version 2
    init(sharded=True, keep_previous="auto")  # and back
    out["error_3"] = update(3)
    served("sharded_3")
    out["report"] = _worker(llm).weight_transfer_engine.last_report

    publish(4, 1)  # version 4 holds version 1's weights
    out.update(open_updates(llm, served))
    for key, options in (("streamed_sharded", {"sharded": True}), ("streamed_full", {})):
        init(memory_budget=BUDGET, keep_previous="auto", **options)  # streamed: vLLM's reload opened per pull attempt
        out[f"fault_{key}"] = {"error": update(4, faulty=True), "calls": fault.calls}
        served(f"after_fault_{key}")  # version 3
    init(sharded=True)  # nothing kept (the default, keep_previous=0): a failure midway leaves a mix
    out["fault_unkept"] = {"error": update(4, faulty=True), "calls": fault.calls}
    model = _worker(llm).model_runner.get_model()
    out["refusing"] = "forward" in model.__dict__
    refusal = {k: model.__dict__.pop(k) for k in ("forward", "compute_logits") if k in model.__dict__}
    served("unkept_mix")  # what the engine would serve without its refusal
    model.__dict__.update(refusal)
    out.update(generate_or_refusal(llm, "served_while_refusing"))
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1])), default=str))
