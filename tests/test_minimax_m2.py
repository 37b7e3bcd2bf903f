"""MiniMax-M2 (issue 42): q / k RMSNorms over all heads, split over TP by heads.

MiniMax-M2's ``q_norm`` [heads x head_dim] and ``k_norm`` [kv_heads x head_dim] normalize a
token's whole query and key; Megatron-Core holds them (Megatron-Bridge 0.6's ``FullDimQNorm`` /
``FullDimKNorm``) as ``q_layernorm`` / ``k_layernorm`` of rank r's heads, and vLLM's
``MiniMaxText01RMSNormTP`` the same (a K-norm shard replicated when vLLM's tp exceeds the kv heads).
Checked here, on tensors named and shaped by transformers' own ``MiniMaxM2ForCausalLM``
(``save_pretrained``): HF -> Megatron gives each rank its heads' part (Bridge's
``_FullDimQKNormMapping`` slices ``[r * n/tp, (r+1) * n/tp)``), Mixtral's expert names and the
block-level ``e_score_correction_bias``; Megatron -> HF exact; the published MiniMax-M2.5 config's
plans; what is refused. vLLM's own loader: tests/test_vllm_moe_target.py (the ``minimax_m2`` case);
Megatron-Core's forward with Bridge's norms and Bridge's load / export: tests/test_bridge.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_cases import case_config
from reference import hf_checkpoint_state

pytest.importorskip("transformers")
CONFIGS = Path(__file__).parent / "data" / "configs"
CFG = case_config("minimax_m2")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return hf_checkpoint_state(CFG, tmp_path_factory.mktemp("minimax"))


def test_transformers_names_are_the_tables(hf):
    """The names transformers 5.19's ``save_pretrained`` writes (Mixtral's ``block_sparse_moe`` /
    ``w1`` / ``w3`` / ``w2``, the bias beside the gate) are exactly what megarefit plans."""
    from megarefit import ModelDims
    from megarefit.layout.megatron_model import source_layout
    from megarefit.planner.megatron_to_hf import plan_megatron_to_hf

    dims = ModelDims.from_hf_config(CFG)
    plan = plan_megatron_to_hf(dims, source_layout(dims, tp=2, ep=2))
    assert {t.name: tuple(m.shape) for t, m in plan.targets.items()} == {k: tuple(v.shape) for k, v in hf.items()}
    assert "model.layers.1.block_sparse_moe.e_score_correction_bias" in hf


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 2)])
def test_import_splits_the_norms_by_heads_and_export_inverts_it(hf, tp, ep):
    from megarefit.translate import hf_to_megatron, megatron_to_hf

    shards = hf_to_megatron(hf, CFG, tp=tp, ep=ep)
    for layer in range(CFG["num_hidden_layers"]):
        a, m = f"model.layers.{layer}.self_attn.", f"decoder.layers.{layer}.self_attention."
        for r in range(tp):
            got = shards[(r, 0, 0)]
            assert torch.equal(got[m + "q_layernorm.weight"], hf[a + "q_norm.weight"].chunk(tp)[r])
            assert torch.equal(got[m + "k_layernorm.weight"], hf[a + "k_norm.weight"].chunk(tp)[r])
            assert torch.equal(got[f"decoder.layers.{layer}.mlp.router.expert_bias"],
                               hf[f"model.layers.{layer}.block_sparse_moe.e_score_correction_bias"])
    back = megatron_to_hf(shards, CFG, tp=tp, ep=ep)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def test_an_import_with_the_mtp_modules_says_to_drop_them(hf):
    """Published MiniMax-M2 checkpoints carry MTP modules as layers ``num_hidden_layers + i`` (vLLM drops
    them at load); an import that includes them is refused, naming them, and not with the hint for
    families whose MTP layers megarefit builds."""
    from megarefit.errors import UnexpectedParameterError
    from megarefit.translate import hf_to_megatron

    n = CFG["num_hidden_layers"]
    with pytest.raises(UnexpectedParameterError, match=rf"layers from {n} on are the checkpoint's multi-token-pre"):
        hf_to_megatron(hf | {f"model.layers.{n}.self_attn.q_proj.weight": torch.zeros(64, 64)}, CFG, tp=2)


def test_published_config_plans_into_hf_and_into_a_vllm_worker(capsys):
    """MiniMax-M2.5 (the published block-FP8 config) from Megatron tp 4, pp 2, ep 16: the plan's bf16
    bytes equal the checkpoint's counted from the config's numbers alone; one vLLM worker (tp 16 > 8 kv
    heads, EP) gets a sixteenth of each q norm, the K norm of kv head ``rank // 2`` and its 16 experts;
    block FP8 quantizes what the published checkpoint does (its ``modules_to_not_convert``: the router
    gates, their bias and ``lm_head`` stay in the model dtype)."""
    from megarefit import ModelDims
    from megarefit.cli import main
    from megarefit.layout.megatron_model import source_layout
    from megarefit.planner.megatron_to_hf import plan_megatron_to_hf
    from megarefit.quant import quantized_weight_names
    from megarefit.quant.scheme import unquantized_linear_modules
    from megarefit.targets import VllmTarget, vllm_params

    cfg = json.loads((CONFIGS / "MiniMax-M2.5.json").read_text())
    dims = ModelDims.from_hf_config(cfg)
    h, heads, kv, d, E, f, V, L = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                    "head_dim", "num_local_experts", "intermediate_size",
                                                    "vocab_size", "num_hidden_layers"))
    layer = h * (heads + 2 * kv) * d + heads * d * h + (heads + kv) * d + 2 * h + E * h + E + E * 3 * f * h
    plan = plan_megatron_to_hf(dims, source_layout(dims, tp=4, pp=2, ep=16), dtype="bfloat16")
    assert plan.nbytes == 2 * (L * layer + 2 * V * h + h) + 2 * L * E  # the expert bias is fp32
    params = vllm_params(dims, VllmTarget(16, 5, expert_parallel=True))
    a = "model.layers.7.self_attn."
    q_norm, k_norm = params[a + "q_norm.weight"], params[a + "k_norm.weight"]
    assert q_norm.shape == (heads * d // 16,) and q_norm.pieces[0].hf_box.offsets == (5 * heads * d // 16,)
    assert k_norm.shape == (d,) and k_norm.pieces[0].hf_box.offsets == (2 * d,)
    assert params["model.layers.7.block_sparse_moe.experts.routed_experts.w13_weight"].shape == (16, 2 * f, h)
    assert params["model.layers.7.block_sparse_moe.gate.weight"].value_fn == "as_float32"  # vLLM's GateLinear
    quantized = quantized_weight_names(dims)  # as the published checkpoint: not gate, bias, lm_head, norms
    assert len(quantized) == L * (4 + 3 * E) and all(n.endswith(("_proj.weight", ".w1.weight", ".w2.weight",
                                                                  ".w3.weight")) for n in quantized)
    kept = unquantized_linear_modules(dims)
    assert {k.rsplit(".", 1)[-1] for k in kept} == set(cfg["quantization_config"]["modules_to_not_convert"]) - {
        "e_score_correction_bias"} and len(kept) == L + 1  # (the bias is a 1-D tensor, never quantized)
    base = ["plan", "--config", str(CONFIGS / "MiniMax-M2.5.json"), "--tp", "4", "--pp", "2", "--ep", "16",
            "--no-execute-meta"]
    for extra in ([], ["--vllm-tp", "4", "--vllm-dp", "2", "--vllm-dp-rank", "1", "--vllm-rank", "3", "--vllm-ep"]):
        assert main(base + extra) == 0
        out = capsys.readouterr().out
        assert "validated exact cover" in out and "block FP8" in out and ("vLLM tensors" in out) == bool(extra), out


@pytest.mark.parametrize(("change", "tp", "message"), [
    ({}, 4, "tp=4 exceeds num_query_groups=2: each K-norm shard"),
    ({"qk_norm_type": "per_head"}, 2, "qk_norm_type='per_head' has no spec table"),
])
def test_what_is_not_translated_is_refused_in_one_line(tmp_path, capsys, change, tp, message):
    """Megatron tp above the kv heads (each K-norm shard replicated over tp / kv ranks: not planned)
    and another q/k-norm type."""
    from megarefit.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(CFG | change))
    assert main(["plan", "--config", str(path), "--tp", str(tp), "--no-execute-meta"]) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert message in text and "Traceback" not in text and len(text.strip().splitlines()) == 1, text


def test_no_draft_model_is_refit():
    """MiniMax-M2's MTP modules are not planned (Bridge maps none; vLLM's target model drops them)."""
    from megarefit import ModelDims
    from megarefit.errors import LayoutError
    from megarefit.targets import VllmTarget, vllm_params

    with pytest.raises(LayoutError, match="does not plan this family's multi-token-prediction layers"):
        vllm_params(ModelDims.from_hf_config(CFG), VllmTarget(2, 0, draft=True))
