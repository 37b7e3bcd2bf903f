"""Adapter-only refits over HTTP, run by hand (a second server costs a minute or more on 2 cores, past
the suite's budget; tests/test_vllm_lora.py proves the same worker path in process)::

    python tests/vllm_lora_http_scenario.py
    VLLM_CPU_OMP_THREADS_BIND="0|1" python tests/vllm_lora_http_scenario.py --tp 2   # 2 TP worker processes

A real ``vllm serve`` (the OpenAI server as a module, ``--enable-lora``, the megarefit backend,
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, and ``VLLM_SERVER_DEV_MODE=1`` for vLLM's weight-transfer
routes, as every megarefit HTTP refit) is inited with ``lora=True``
(``VllmHttpRefit.init``). Two tp-2 ``LoraPublisher`` s in this process serve two random PEFT adapters
as CanonicalLoRA shards, one version after the other (the second written inside the seqlock);
``VllmHttpRefit.refit_lora`` installs each through ``/v1/load_lora_adapter``. Prints whether
``/v1/completions`` with ``"model": "policy"`` equals transformers + peft with each adapter, that the
base model is unchanged, and the server's answer to a version never published.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _publishers(cfg, adapters, rdzv, job):
    import test_vllm_lora as t

    from megarefit.layout.dims import ModelDims
    from megarefit.layout.parallel import SourceLayout
    from megarefit.online.trainer.lora_publisher import LoraPublisher
    from megarefit.translate_peft import peft_to_lora

    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=2, pp=1, padded_vocab_size=dims.padded_vocab_size(2), num_layers=dims.num_layers)
    shards = [peft_to_lora(tensors, t.CONFIG, cfg, tp=2, wrapper="canonical_lora") for _, tensors in adapters]
    pubs = [LoraPublisher({n: x.clone() for n, x in shards[0][r].items()}, cfg, rank=(r, 0, 0), layout=layout,
                          rendezvous=rdzv.channel(f"lora/{t.NAME}"), alpha=t.CONFIG["lora_alpha"],
                          agent_name=f"{job}-t{r}", checksums=True) for r in range(2)]
    return pubs, shards


def main() -> None:
    import test_vllm_lora as t
    from vllm_helpers import PROMPTS, completions, hf_generate, same_generation, stop_server, wait_healthy

    from megarefit.demo.workers import free_port
    from megarefit.integrations.vllm_http import RefitHTTPError, VllmHttpRefit
    from megarefit.online.store.rendezvous import SECRET_ENV, Rendezvous

    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1, help="vLLM --tensor-parallel-size (worker processes)")
    tp = parser.parse_args().tp
    ckpt = tempfile.mkdtemp()
    cfg, base, adapters = t.base_and_adapters(ckpt)
    job = "lora-http"
    rdzv = Rendezvous.serve(job=job)
    os.environ[SECRET_ENV] = rdzv.secret  # the server's workers inherit the job secret
    pubs, shards = _publishers(cfg, adapters, rdzv, job)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", VLLM_SERVER_DEV_MODE="1")  # the latter: /init_weight_transfer_engine
    log = open(os.path.join(ckpt, "server.log"), "w+")  # noqa: SIM115 - the server's log, kept
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt,
                               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
                               "--max-model-len", "128", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "1",
                               "--tensor-parallel-size", str(tp),
                               "--weight-transfer-config", json.dumps({"backend": "megarefit"})],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, server, log)
        print("base model as transformers:", same_generation(completions(url, ckpt), hf_generate(base, PROMPTS)))
        refit = VllmHttpRefit(url)
        refit.init("127.0.0.1", rdzv.port, job=job, lora=True, verify_checksums=True, timeout=5.0)
        for version, (model, _) in enumerate(adapters, start=1):
            for p in pubs:
                with p.updating(version):
                    for n, x in shards[version - 1][p.rank.tp].items():
                        p.params[n].copy_(x)
            name = refit.refit_lora(t.NAME, version)
            acked = pubs[0].wait_receivers(version, timeout=30)
            print(f"version {version} over HTTP generates as peft:",
                  same_generation(completions(url, name), hf_generate(model, PROMPTS)), "acknowledged:", acked)
        print("base model unchanged:", same_generation(completions(url, ckpt), hf_generate(base, PROMPTS)))
        try:
            refit.refit_lora(t.NAME, 99)
            print("version 99: accepted (wrong)")
        except RefitHTTPError as exc:
            print("version 99 refused:", str(exc)[:300])
        print("version 2 still serves:", same_generation(completions(url, t.NAME), hf_generate(adapters[1][0],
                                                                                                 PROMPTS)))
    finally:
        stop_server(server)


if __name__ == "__main__":
    main()
