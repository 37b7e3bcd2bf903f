"""Real Megatron-Core MoE on CPU (SequentialMLP experts, allgather dispatcher, 2 gloo
processes) against real HF transformers: Qwen3-MoE (with a dense layer mixed in), Mixtral and
MiniMax-M2 (q / k norms over all heads, split by heads; sigmoid routing with a score-correction
bias; RoPE on part of each head) tiny configs shrunk from the real ones, at TP=2/EP=1 and TP=1/EP=2.

Megatron logits must equal HF logits after ``megatron_to_hf``, loaded through
``from_pretrained`` of a saved directory (per-expert on-disk keys, which
transformers 5 fuses itself), and the classifier must agree with the tables.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

import megarefit  # noqa: E402
from conftest import hf_model_from, real_config  # noqa: E402
from megarefit.integrations.hf import hf_logits, save_checkpoint  # noqa: E402
from megarefit.demo.trainer_jobs import TrainerCase, trainer_job  # noqa: E402
from megarefit.demo.workers import run_workers  # noqa: E402
from megarefit.demo.megatron_cpu import harness_megatron  # noqa: E402

pytestmark = pytest.mark.megatron
MEGATRON = harness_megatron()  # the installed megatron-core, with the harness's layout flags

TOKENS = torch.randint(0, 250, (2, 10), generator=torch.Generator().manual_seed(11))
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "vocab_size": 250, "num_experts_per_tok": 2, "max_position_embeddings": 256, "rope_scaling": None}


def _config(family: str) -> dict:
    if family == "qwen3_moe":
        return real_config("Qwen3-30B-A3B") | SMALL | {"head_dim": 32, "num_experts": 4, "moe_intermediate_size": 48,
                                                      "intermediate_size": 96, "mlp_only_layers": [0]}
    if family == "minimax_m2":  # q / k norms over all heads (the harness's full_dim_norms), partial RoPE
        cfg = real_config("MiniMax-M2.5") | SMALL | {"num_local_experts": 4, "intermediate_size": 48, "head_dim": 16,
                                                     "rotary_dim": 8, "use_mtp": False, "num_mtp_modules": 0}
        cfg.pop("quantization_config")
        return cfg
    return real_config("Mixtral-8x7B-v0.1") | SMALL | {"num_local_experts": 4, "intermediate_size": 48}


CASES = {f"{f}-tp{tp}-ep{ep}": (f, tp, ep) for f in ("qwen3_moe", "mixtral", "minimax_m2")
         for tp, ep in ((2, 1), (1, 2))}


@pytest.fixture(scope="module")
def runs():
    cases = [TrainerCase(k, _config(f), tp, 1, TOKENS, ep=ep) for k, (f, tp, ep) in CASES.items()]
    per_rank = run_workers(trainer_job, world_size=2, args=(cases,), timeout=900)
    out = {}
    for key in CASES:
        entries = [r[key] for r in per_rank if r[key]]
        out[key] = {"shards": {e["coord"]: e["params"] for e in entries},
                    "logits": next(e["logits"] for e in entries if e["logits"] is not None),
                    "problems": [p for e in entries for p in e["problems"]]}
    return out


@pytest.mark.parametrize("key", list(CASES))
def test_moe_logits_equal_hf(runs, key, tmp_path):
    family, tp, ep = CASES[key]
    cfg, run = _config(family), runs[key]
    assert run["problems"] == []
    assert set(run["shards"]) == {(t, 0, e) for t in range(tp) for e in range(ep)}
    hf = megarefit.megatron_to_hf(run["shards"], cfg, tp=tp, ep=ep, megatron=MEGATRON)
    want = run["logits"][..., :250]
    got = hf_logits(hf_model_from(hf, cfg, tmp_path), TOKENS)
    assert (got - want).abs().max().item() < 1e-4
    assert want.abs().max().item() > 0.1


def test_expert_numbering_matters(runs, tmp_path):
    """Negative control: dropping the expert-parallel offset (naming ep rank 1's local
    experts 0..E/ep-1 again) must break the logits comparison."""
    cfg, run = _config("mixtral"), runs["mixtral-tp1-ep2"]
    hf = megarefit.megatron_to_hf(run["shards"], cfg, ep=2, megatron=MEGATRON)
    per_ep = 2
    for layer in range(2):
        for local in range(per_ep):
            for w in ("w1", "w2", "w3"):
                a = f"model.layers.{layer}.block_sparse_moe.experts.{local}.{w}.weight"
                b = f"model.layers.{layer}.block_sparse_moe.experts.{per_ep + local}.{w}.weight"
                hf[a], hf[b] = hf[b], hf[a]
    save_checkpoint(tmp_path, cfg, hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert (hf_logits(model, TOKENS) - run["logits"][..., :250]).abs().max().item() > 1e-2
