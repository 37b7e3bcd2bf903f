"""Real Megatron-Core models on CPU in the DeepSeek-V3 and GLM-4.5 styles.

DeepSeek-V3: multi-latent attention (patched to build without Transformer Engine,
parameter names unchanged), a dense first layer, routed experts with a sigmoid
router and an fp32 score-correction bias, a shared expert. GLM-4.5: q/k/v biases,
partial RoPE (``partial_rotary_factor`` 0.5 = Megatron ``rotary_percent``), a
dense first layer, shared expert, sigmoid router with bias. Megatron logits must
equal HF ``DeepseekV3ForCausalLM`` / ``Glm4MoeForCausalLM`` logits after
``megatron_to_hf`` (loaded with ``from_pretrained``), at TP=2/EP=1 and TP=1/EP=2; and
DeepSeek without ``q_lora_rank`` (column-parallel ``linear_q_proj`` -> ``q_proj``) at TP=2."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

import megarefit  # noqa: E402
from conftest import hf_model_from, real_config  # noqa: E402
from megarefit.integrations.hf import hf_logits  # noqa: E402
from megarefit.demo.trainer_jobs import TrainerCase, trainer_job  # noqa: E402
from megarefit.demo.workers import run_workers  # noqa: E402
from megarefit.demo.megatron_cpu import harness_megatron, megatron_series  # noqa: E402

pytestmark = pytest.mark.megatron
MEGATRON = harness_megatron()  # the installed megatron-core, with the harness's layout flags

TOKENS = torch.randint(0, 250, (2, 10), generator=torch.Generator().manual_seed(5))


def _config(family: str) -> dict:
    common = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, vocab_size=250, intermediate_size=96,
                  moe_intermediate_size=48, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                  first_k_dense_replace=1, n_shared_experts=1, rope_scaling=None, num_nextn_predict_layers=0,
                  tie_word_embeddings=False, max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
    if family.startswith("deepseek"):
        cfg = real_config("DeepSeek-V3")
        cfg.pop("quantization_config", None)
        cfg.update(common, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16)
        if family == "deepseek-no-q-lora":  # DeepSeek-V2-Lite style: one q projection (linear_q_proj / q_proj)
            cfg.update(q_lora_rank=None)
    else:
        cfg = real_config("GLM-4.5-Air")
        cfg.update(common, num_key_value_heads=2, head_dim=16, pad_token_id=0)
        assert cfg["partial_rotary_factor"] == 0.5 and cfg["attention_bias"]
    return cfg


CASES = {f"{fam}-tp{tp}-ep{ep}": (fam, tp, ep) for fam in ("deepseek", "glm") for tp, ep in ((2, 1), (1, 2))}
if megatron_series() < (0, 19):  # 0.19 builds it only with a TE-fused Q norm HF lacks (the harness refuses)
    CASES["deepseek-no-q-lora-tp2-ep1"] = ("deepseek-no-q-lora", 2, 1)


@pytest.fixture(scope="module")
def runs():
    cases = [TrainerCase(k, _config(fam), tp, 1, TOKENS, ep=ep) for k, (fam, tp, ep) in CASES.items()]
    per_rank = run_workers(trainer_job, world_size=2, args=(cases,), timeout=900)
    return {key: {"shards": {r[key]["coord"]: r[key]["params"] for r in per_rank if r[key]},
                  "logits": next(r[key]["logits"] for r in per_rank if r[key] and r[key]["logits"] is not None),
                  "problems": [p for r in per_rank if r[key] for p in r[key]["problems"]]} for key in CASES}


@pytest.mark.parametrize("key", list(CASES))
def test_logits_equal_hf(runs, key, tmp_path):
    fam, tp, ep = CASES[key]
    cfg, run = _config(fam), runs[key]
    assert run["problems"] == []
    bias = run["shards"][(0, 0, 0)]["decoder.layers.1.mlp.router.expert_bias"]
    assert bias.dtype == torch.float32 and bias.abs().max() > 0  # a real, perturbed fp32 buffer
    hf = megarefit.megatron_to_hf(run["shards"], cfg, tp=tp, ep=ep, megatron=MEGATRON)
    assert hf["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    want = run["logits"][..., :250]
    got = hf_logits(hf_model_from(hf, cfg, tmp_path), TOKENS)
    assert (got - want).abs().max().item() < 1e-4
    assert want.abs().max().item() > 0.1


@pytest.mark.skipif(megatron_series() < (0, 19), reason="0.16-0.18 build it (a case above)")
def test_mla_without_q_lora_is_refused_by_the_harness_on_0_19():
    from megarefit.demo.megatron_cpu import gpt_arch_from_hf

    with pytest.raises(megarefit.errors.MegarefitError, match="without q_lora_rank .* cannot build"):
        gpt_arch_from_hf(_config("deepseek-no-q-lora"))
