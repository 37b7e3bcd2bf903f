"""Logprob parity in bf16, as most RL runs train and serve: two Megatron-Core trainer
processes (TP=2) hold and run the model in bfloat16 and publish it over NIXL; a vLLM engine
on CPU (vllm-cpu, bfloat16, a real BPE tokenizer) refits it through the worker extension.
vLLM's prompt logprobs of a text prompt, over the whole vocabulary, are compared with the
trainer's own bf16 forward logprobs on the same tokens (the fp32 case: tests/test_vllm_refit.py).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
vllm = pytest.importorskip("vllm")
pytest.importorskip("nixl")
pytest.importorskip("megatron.core")

from conftest import tiny_config  # noqa: E402
from megarefit.demo.trainer_jobs import TrainerCase, serving_trainer_job  # noqa: E402
from megarefit.demo.workers import start_workers  # noqa: E402
from megarefit.integrations.hf import build_hf_model, save_checkpoint  # noqa: E402
from megarefit.online.rendezvous import Rendezvous  # noqa: E402
from vllm_helpers import EXT, PROMPT_TEXT, bpe_tokenizer, vllm_prompt_logprobs  # noqa: E402

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cfg = tiny_config("Qwen3-0.6B", vocab_size=500, hidden_size=128, intermediate_size=256, head_dim=64)
    job = "vllm-bf16"
    rdzv = Rendezvous.serve(job=job)
    ckpt = tmp_path_factory.mktemp("initial")
    tokenizer = bpe_tokenizer(ckpt, cfg["vocab_size"])
    tokens = torch.tensor([tokenizer(PROMPT_TEXT).input_ids])
    snapdir = tmp_path_factory.mktemp("snapshots")
    group = start_workers(serving_trainer_job, world_size=2,
                          args=(TrainerCase(job, cfg, 2, 1, tokens, dtype="bfloat16"), ("127.0.0.1", rdzv.port, job),
                                1, 0.01, str(snapdir)))
    torch.manual_seed(0)
    initial = build_hf_model(cfg)
    save_checkpoint(ckpt, cfg, {k: v for k, v in initial.state_dict().items() if k != "lm_head.weight"})
    llm = vllm.LLM(model=str(ckpt), dtype="bfloat16", enforce_eager=True, max_model_len=128, max_logprobs=-1,
                   worker_extension_cls=EXT)
    out = {"before": vllm_prompt_logprobs(llm, PROMPT_TEXT, cfg["vocab_size"]), "tokens": tokens[0].tolist()}
    llm.collective_rpc("init_megarefit", args=("127.0.0.1", rdzv.port, job, 120.0))
    out["report"] = llm.collective_rpc("update_weights_from_megatron", args=(1,))[0]
    out["after"] = vllm_prompt_logprobs(llm, PROMPT_TEXT, cfg["vocab_size"])
    rdzv.mark_consumed(1)
    group.join(timeout=120)
    out["trainer"] = torch.load(snapdir / "logits-v1-tp0.pt")
    return cfg, out


def test_bf16_served_logprobs_equal_the_trainers_own(run, record_property):
    """bf16 on both sides: max |delta logprob| <= sqrt(eps_bf16) (0.088), token KL <= eps_bf16 / 2
    (0.0039, KL of logprob errors of that size) plus the fp32 normalization term V * eps_fp32;
    the served model before the refit is far outside it (the check can fail)."""
    cfg, out = run
    ids, served = out["after"]
    assert ids == out["tokens"] and out["report"]["version"] == 1
    trainer = torch.log_softmax(out["trainer"][0, :-1, :cfg["vocab_size"]].double(), -1)
    delta = (trainer - served).abs()
    kl = (trainer.exp() * (trainer - served)).sum(-1)
    eps = torch.finfo(torch.bfloat16).eps
    report = {"max_abs_delta": float(delta.max()), "mean_abs_delta": float(delta.mean()),
              "max_token_kl": float(kl.max()), "mean_token_kl": float(kl.mean())}
    for key, value in report.items():
        record_property(key, value)
    print(f"bf16: {report}")
    kl_tol = eps / 2 + cfg["vocab_size"] * torch.finfo(torch.float32).eps
    assert report["max_abs_delta"] <= eps ** 0.5 and report["max_token_kl"] <= kl_tol, report
    assert (trainer - out["before"][1]).abs().max() > 10 * eps ** 0.5
