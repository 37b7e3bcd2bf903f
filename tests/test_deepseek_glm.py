"""DeepSeek-V3 (MLA, dense-first layers, shared experts, fp32 router bias), GLM-4.5 and GLM-5
(DeepSeek-V3's MLA + MoE with a DSA lightning indexer per layer): HF names and shapes agree
with what real transformers ``save_pretrained`` writes, and translation round trips are
bit-exact over tp / pp / ep / etp and both layer specs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megarefit
from conftest import real_config
from megarefit import ModelDims, SourceLayout, plan_hf_to_megatron

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")


def tiny(name: str, **extra) -> dict:
    cfg = real_config(name)
    cfg.pop("quantization_config", None)
    cfg.update(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, vocab_size=300, intermediate_size=96,
               moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
               first_k_dense_replace=1, n_shared_experts=1, max_position_embeddings=256, rope_scaling=None,
               num_nextn_predict_layers=0, tie_word_embeddings=False, pad_token_id=0, bos_token_id=0,
               eos_token_id=1)
    if name in ("DeepSeek-V3", "GLM-5"):
        cfg.update(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                   num_key_value_heads=4)
    if name == "GLM-5":
        cfg.update(qk_head_dim=12, index_n_heads=2, index_head_dim=8, index_topk=4)
    else:
        cfg.update(num_key_value_heads=2, head_dim=16)
    cfg.update(extra)
    return cfg


@pytest.mark.parametrize(("name", "extra"), [("DeepSeek-V3", {}), ("DeepSeek-V3", {"q_lora_rank": None}),
                                           ("GLM-4.5-Air", {}), ("GLM-5", {})],
                         ids=["deepseek", "deepseek-no-q-lora", "glm", "glm5"])
def test_hf_names_and_shapes_match_transformers(name, extra, tmp_path):
    cfg = tiny(name, **extra)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items()}), dtype=torch.float32)
    model.save_pretrained(tmp_path)
    on_disk = {}
    for f in tmp_path.glob("*.safetensors"):
        on_disk |= {k: tuple(v.shape) for k, v in safetensors.load_file(f).items()}
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=1, pp=1, padded_vocab_size=dims.padded_vocab_size(1), num_layers=3)
    ours = {r.name: m.shape for r, m in plan_hf_to_megatron(dims, layout, "float32").sources.items()}
    assert ours == on_disk
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert bias in ours and dims.layer_kind(0) == "dense" and dims.layer_kind(1) == "moe"


def _hf_state(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=1, pp=1, padded_vocab_size=dims.padded_vocab_size(1), num_layers=dims.num_layers)
    g = torch.Generator().manual_seed(seed)
    plan = plan_hf_to_megatron(dims, layout, "bfloat16")
    return {r.name: torch.randn(m.shape, generator=g).to(getattr(torch, m.dtype)) for r, m in plan.sources.items()}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["DeepSeek-V3", "GLM-4.5-Air", "GLM-5"]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 3]),
       st.sampled_from([1, 2, 8]), st.booleans(), st.sampled_from(["local", "te"]), st.integers(0, 99), st.booleans())
def test_round_trip_is_exact(name, tp, pp, ep, etp_one, layer_spec, seed, q_lora):
    cfg = tiny(name, num_key_value_heads=4) if name == "GLM-4.5-Air" else tiny(name)
    if name == "GLM-5":
        layer_spec = "te"  # Megatron-Core's DSA spec is TE-only (fused up-projection norms)
    if name == "DeepSeek-V3" and not q_lora:
        cfg["q_lora_rank"] = None  # one column-parallel q projection
    etp = 1 if etp_one else tp
    hf = _hf_state(cfg, seed)
    assert hf["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32  # fp32 in a bf16 model
    shards = megarefit.hf_to_megatron(hf, cfg, tp=tp, pp=pp, ep=ep, etp=etp, layer_spec=layer_spec,
                                      expert_layout="te_grouped")
    back = megarefit.megatron_to_hf(shards, cfg, tp=tp, pp=pp, ep=ep, etp=etp)
    assert back.keys() == hf.keys()
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in hf.items())


@pytest.mark.parametrize(("tp", "pp", "ep"), [(1, 1, 1), (2, 3, 2), (4, 1, 8)])
def test_glm5_indexer_is_whole_on_every_rank_and_transformers_logits_survive(tp, pp, ep, tmp_path):
    """GLM-5: transformers' own GlmMoeDsaForCausalLM (random, fp32, saved as transformers saves
    it) -> Megatron shards -> HF. Every rank of a layer's stage holds each indexer tensor
    whole (Megatron's ``parallel_mode="duplicated"``): ``weights_proj`` as HF's, the others
    with every head's rows rotated from HF's [rope; nope] to Megatron-Core's [nope; rope]
    (computed here with cat/reshape; real Megatron-Core's logits check it in
    tests/test_cli.py's GLM-5 demo), and the
    round-tripped checkpoint loads into transformers with the same logits as the original,
    with an ``index_topk`` below the sequence length so the indexer's top-k decides which
    tokens each query attends to."""
    import json

    cfg = tiny("GLM-5")
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg),
                                                          dtype=torch.float32).eval()
    model.save_pretrained(tmp_path / "original")
    hf = {}
    for f in (tmp_path / "original").glob("*.safetensors"):
        hf |= safetensors.load_file(f)
    shards = megarefit.hf_to_megatron(hf, cfg, tp=tp, pp=pp, ep=ep, layer_spec="te", expert_layout="te_grouped")
    layout = SourceLayout.build(tp=tp, pp=pp, ep=ep, padded_vocab_size=ModelDims.from_hf_config(cfg)
                                .padded_vocab_size(tp), num_layers=cfg["num_hidden_layers"])
    checked, d, rope = 0, cfg["index_head_dim"], cfg["qk_rope_head_dim"]
    for (t, p, e), params in shards.items():
        for local in {int(n.split(".")[2]) for n in params if n.startswith("decoder.layers.")}:
            for meg, name in (("linear_wq_b.weight", "wq_b.weight"), ("linear_wk.weight", "wk.weight"),
                              ("k_norm.weight", "k_norm.weight"), ("k_norm.bias", "k_norm.bias"),
                              ("linear_weights_proj.weight", "weights_proj.weight")):
                got = params[f"decoder.layers.{local}.self_attention.core_attention.indexer.{meg}"]
                want = hf[f"model.layers.{layout.layer_offset(p) + local}.self_attn.indexer.{name}"]
                if meg != "linear_weights_proj.weight":  # HF heads [rope; nope] -> Megatron [nope; rope]
                    heads = want.reshape(-1, d, *want.shape[1:])
                    want = torch.cat([heads[:, rope:], heads[:, :rope]], 1).reshape(want.shape)
                assert torch.equal(got, want), (t, p, e, meg)
                checked += 1
    assert checked == 5 * cfg["num_hidden_layers"] * tp * ep
    back = megarefit.megatron_to_hf(shards, cfg, tp=tp, pp=pp, ep=ep)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], v) for k, v in hf.items())
    (tmp_path / "back").mkdir()
    safetensors.save_file(back, tmp_path / "back" / "model.safetensors")
    (tmp_path / "back" / "config.json").write_text(json.dumps(cfg))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)
