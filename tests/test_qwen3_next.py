"""Qwen3-Next (issue 42): gated DeltaNet whose input projections HF packs per key head.

Qwen3-Next's checkpoints store the GDN ``in_proj`` as two tensors packed per key head g,
``in_proj_qkvz`` [q_g; k_g; v_g; z_g] and ``in_proj_ba`` [b_g; a_g]; Megatron-Core's ``in_proj``
holds per TP rank [Q_r; K_r; V_r; Z_r; b_r; a_r] as for Qwen3.5. The oracle is Megatron-Bridge
0.6's ``merge_gdn_linear_weights`` restated in tests/reference.py (``qwen3_next_in_proj``); the rest
of a layer is Qwen3.5's (its own tests). Checked here: HF -> Megatron equal to that oracle and
Megatron -> HF exact, on tensors named and shaped by transformers' own ``Qwen3NextForCausalLM``;
the published config's plans. vLLM-sharded targets equal what vLLM's own ``Qwen3NextForCausalLM``
holds after its ``load_weights`` (vLLM keeps the packing: each rank holds whole key heads' rows):
in test_qwen35.py, whose vLLM processes build Qwen3.5's models too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reference import hf_checkpoint_state, qwen35_layer_types, qwen3_next_in_proj

transformers = pytest.importorskip("transformers")
CONFIGS = Path(__file__).parent / "data" / "configs"

NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 96, "vocab_size": 300, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
        "linear_key_head_dim": 8, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2, "num_experts": 4, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64, "num_experts_per_tok": 2, "tie_word_embeddings": False}


def next_state(cfg: dict, directory, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random tensors under the names and shapes transformers' ``save_pretrained`` writes for ``cfg``;
    norm weights in [0.5, 2) (where the gated norm's +-1 is exact)."""
    return {k: (v.abs() % 1.5 + 0.5 if "norm" in k else v).to(dtype)
            for k, v in hf_checkpoint_state(cfg, directory).items()}


@pytest.mark.parametrize("tp", [1, 2, 4])  # tp 4: one key head per rank
def test_import_packs_in_proj_as_bridge_does_and_export_inverts_it(tp, tmp_path):
    from megarefit.translate import hf_to_megatron, megatron_to_hf

    hf = next_state(NEXT, tmp_path)
    shards = hf_to_megatron(hf, NEXT, tp=tp)
    for i, kind in enumerate(qwen35_layer_types(NEXT)):
        if kind != "linear_attention":
            continue
        g = f"model.layers.{i}.linear_attn."
        want = qwen3_next_in_proj(hf[g + "in_proj_qkvz.weight"], hf[g + "in_proj_ba.weight"], NEXT, tp)
        for t in range(tp):
            assert torch.equal(shards[(t, 0, 0)][f"decoder.layers.{i}.self_attention.in_proj.weight"], want[t]), (i, t)
    back = megatron_to_hf(shards, NEXT, tp=tp)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_the_packing_is_not_qwen3_5s(tmp_path):
    """The oracle can tell: read as Qwen3.5's separate layout (q_g, k_g of one key head next to each
    other), the same rows give another ``in_proj`` at tp 2."""
    from megarefit.translate import hf_to_megatron

    hf = next_state(NEXT, tmp_path)
    g = "model.layers.0.linear_attn."
    qk, v = 4 * 8, 8 * 16
    q, k, vv, z = hf[g + "in_proj_qkvz.weight"].split([qk, qk, v, v])
    b, a = hf[g + "in_proj_ba.weight"].chunk(2)
    flat = torch.cat([torch.cat([p.chunk(2)[t] for p in (q, k, vv, z, b, a)]) for t in range(2)])
    got = torch.cat([hf_to_megatron(hf, NEXT, tp=2)[(t, 0, 0)]["decoder.layers.0.self_attention.in_proj.weight"]
                     for t in range(2)])
    assert not torch.equal(got, flat)


def _moe_bytes(cfg: dict) -> int:
    """bf16 bytes of a Qwen3-Next checkpoint's tensors (MTP layer aside), from the config's numbers."""
    h, nk, dk, nv, dv = (cfg[k] for k in ("hidden_size", "linear_num_key_heads", "linear_key_head_dim",
                                          "linear_num_value_heads", "linear_value_head_dim"))
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    gdn = (2 * nk * dk + 2 * nv * dv) * h + 2 * nv * h + (2 * nk * dk + nv * dv) * cfg["linear_conv_kernel_dim"] \
        + 2 * nv + dv + h * nv * dv
    attention = 2 * q * h + 2 * kv * h + q * h + 2 * cfg["head_dim"]
    e, f, s = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    mlp = e * h + e * 3 * f * h + 3 * s * h + h
    kinds = qwen35_layer_types(cfg)
    per_layer = sum(gdn if k == "linear_attention" else attention for k in kinds) + len(kinds) * (mlp + 2 * h)
    return 2 * (per_layer + 2 * cfg["vocab_size"] * h + h)


def test_plans_of_the_published_config():
    """Qwen3-Next-80B-A3B: Megatron tp 4 pp 4 ep 16 (TE-grouped experts) -> HF covers the checkpoint's
    bytes counted from the config alone; into one vLLM worker (tp 4, dp 2, expert parallel) each
    ``in_proj_qkvz`` / ``in_proj_ba`` is its whole key heads' rows, 64 of the 512 experts."""
    from megarefit import ModelDims, SourceLayout
    from megarefit.planner.megatron_to_hf import plan_megatron_to_hf
    from megarefit.targets import VllmTarget, plan_megatron_to_vllm

    cfg = json.loads((CONFIGS / "Qwen3-Next-80B-A3B-Thinking.json").read_text())
    dims = ModelDims.from_hf_config(cfg)
    src = SourceLayout.build(tp=4, pp=4, ep=16, expert_layout="te_grouped", layer_spec="te",
                             padded_vocab_size=dims.padded_vocab_size(4), num_layers=dims.num_layers)
    assert plan_megatron_to_hf(dims, src, "bfloat16").nbytes == _moe_bytes(cfg)
    plan = plan_megatron_to_vllm(dims, src, "bfloat16", VllmTarget(4, 1, 2, 0, expert_parallel=True))
    shapes = {r.name: m.shape for r, m in plan.targets.items() if r not in plan.staging}
    nk, dk, nv, dv, h = 16, 128, 32, 128, cfg["hidden_size"]
    assert shapes["model.layers.0.linear_attn.in_proj_qkvz.weight"] == ((2 * nk * dk + 2 * nv * dv) // 4, h)
    assert shapes["model.layers.0.linear_attn.in_proj_ba.weight"] == (2 * nv // 4, h)
    assert shapes["model.layers.0.mlp.experts.routed_experts.w13_weight"] == (64, 2 * cfg["moe_intermediate_size"], h)


def test_what_is_not_translated_yet_is_refused():
    """Block FP8 keeps ``in_proj_ba`` unquantized; dense layers in its config (``mlp_only_layers``) are refused
    in one line."""
    from megarefit import ModelDims, SourceLayout
    from megarefit.errors import UnsupportedModelError
    from megarefit.planner.megatron_to_hf import plan_megatron_to_hf
    from megarefit.quant.fp8 import Fp8Format
    from megarefit.quant.planning import plan_fp8, where_quantized

    dims = ModelDims.from_hf_config(NEXT)
    src = SourceLayout.build(tp=2, pp=1, padded_vocab_size=dims.padded_vocab_size(2), num_layers=dims.num_layers)
    fp8 = where_quantized(plan_fp8(plan_megatron_to_hf(dims, src, "bfloat16"), Fp8Format((128, 128))))
    assert fp8 and not any(n.endswith("in_proj_ba.weight") for n in fp8)  # kept bf16, as vLLM (test_vllm_gdn_fp8)
    with pytest.raises(UnsupportedModelError, match="mlp_only_layers / decoder_sparse_step name dense layers"):
        ModelDims.from_hf_config(NEXT | {"mlp_only_layers": [1]})
