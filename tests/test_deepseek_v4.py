"""DeepSeek-V4 (``DeepseekV4ForCausalLM``): the spec table against independent facts.

No Megatron-Core release builds DeepSeek-V4 (Megatron-LM's dev branch only, at tp 1), so no Megatron
forward runs here (``megarefit demo`` refuses it, saying so). The Megatron names are checked against
Megatron-Bridge 0.6.2's registry (test_bridge.py), the vLLM shards against vLLM's own loader
(test_vllm_dsv4_target.py); here: round trips over tiny checkpoints under the published checkpoint's own
names (tests/dsv4_cases.py), the hyper-connection alphas packed in Bridge's order, per-layer rows from
``compress_ratios`` and the hash layers, the published config's plan, and what is refused.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CONFIG_DIR
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from dsv4_cases import dsv4_checkpoint, dsv4_config

from megarefit import ModelDims

PUBLISHED = CONFIG_DIR / "DeepSeek-V4-Flash.json"
CFG = dsv4_config()


@pytest.fixture(scope="module")
def hf():
    """The tiny checkpoint without its MTP layer (``mtp.0.*``), which megarefit does not plan."""
    return {k: v for k, v in dsv4_checkpoint(CFG).items() if not k.startswith("mtp.")}


def test_the_plan_names_exactly_the_checkpoint(hf):
    """Every tensor of the checkpoint (names, shapes, dtypes as vLLM's parameters hold them), no other."""
    from megarefit.layout.megatron_model import source_layout
    from megarefit.planner.megatron_to_hf import plan_megatron_to_hf

    dims = ModelDims.from_hf_config(CFG)
    plan = plan_megatron_to_hf(dims, source_layout(dims, pp=2, ep=2), dtype="float32")
    got = {t.name: (tuple(m.shape), m.dtype) for t, m in plan.targets.items()}
    assert got == {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in hf.items()}


@pytest.mark.parametrize(("pp", "ep", "expert_layout"), [(1, 1, "sequential"), (2, 2, "te_grouped")])
def test_import_packs_the_alphas_as_bridge_and_export_inverts_it(hf, pp, ep, expert_layout):
    """HF -> Megatron -> HF is bit-exact; each ``hc_*_scale`` [3] is Megatron's alpha_pre, alpha_post,
    alpha_res in that order (Megatron-Bridge 0.6.2's ``_HCAlphaMapping``); tid2eid (int32) only in hash
    layers, the learned bias only in the others; compressors where ``compress_ratios`` has one."""
    from megarefit.translate import hf_to_megatron, megatron_to_hf

    shards = hf_to_megatron(hf, CFG, pp=pp, ep=ep, expert_layout=expert_layout)
    per_stage = CFG["num_hidden_layers"] // pp
    for layer in range(CFG["num_hidden_layers"]):
        got = shards[(0, layer // per_stage, 0)]
        m = f"decoder.layers.{layer % per_stage}."
        for mod, hc in (("self_attention_hyper_connection.", "hc_attn"), ("mlp_hyper_connection.", "hc_ffn")):
            scale = hf[f"layers.{layer}.{hc}_scale"]
            for i, alpha in enumerate(("alpha_pre", "alpha_post", "alpha_res")):
                assert torch.equal(got[m + mod + alpha], scale[i:i + 1])
        hashed = layer < CFG["num_hash_layers"]
        assert (m + "mlp.router.tid2eid" in got) == hashed and (m + "mlp.router.expert_bias" in got) != hashed
        if hashed:
            assert got[m + "mlp.router.tid2eid"].dtype == torch.int32
        ratio = CFG["compress_ratios"][layer]
        c = m + "self_attention.core_attention."
        assert (c + "compressor.ape" in got) == (ratio > 0)
        assert (c + "indexer.linear_wq_b.weight" in got) == (ratio == 4)
    back = megatron_to_hf(shards, CFG, pp=pp, ep=ep, quantization="none")
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def test_an_import_with_the_mtp_layer_says_to_drop_it(hf):
    from megarefit.errors import UnexpectedParameterError
    from megarefit.translate import hf_to_megatron

    mtp = {k: v for k, v in dsv4_checkpoint(CFG).items() if k.startswith("mtp.")}
    assert mtp
    with pytest.raises(UnexpectedParameterError, match=r"mtp\.\* is the multi-token-prediction layer of .*DeepSeek-V4"):
        hf_to_megatron(hf | mtp, CFG)


def test_block_fp8_with_fp8_experts_is_quantized_on_the_trainers(tmp_path, capsys):
    """The published config with ``expert_dtype: fp8`` (vLLM's block-FP8 experts): every quantized weight whole
    on the tp-1 trainers, half the bf16 bytes on the wire."""
    from megarefit.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads(PUBLISHED.read_text()) | {"expert_dtype": "fp8"}))
    assert main(["plan", "--config", str(path), "--pp", "4", "--first-stage-layers", "10", "--ep", "16",
                 "--no-execute-meta"]) == 0
    out = capsys.readouterr().out
    assert "0 on the receiver" in out and "block FP8 128x128 (UE8M0 scales)" in out, out


def test_published_config_plans_from_tp1_trainers_into_a_vllm_worker(capsys):
    """DeepSeek-V4-Flash (the published config) at bf16: 284.4 B parameters without the MTP layer, the
    model card's "284B total parameters"; a vLLM worker (tp 4, dp 2, EP) gets a quarter of each head-split
    tensor, every replicated one whole, and 32 of the 256 experts; trainers pp 4 (10 + 3 x 11 layers), ep 16."""
    from megarefit.cli import main
    from megarefit.layout.megatron_model import source_layout
    from megarefit.planner.megatron_to_hf import plan_megatron_to_hf
    from megarefit.targets import VllmTarget, vllm_params

    cfg = json.loads(PUBLISHED.read_text())
    dims = ModelDims.from_hf_config(cfg)
    plan = plan_megatron_to_hf(dims, source_layout(dims, pp=4, ep=16, first_stage_layers=10), dtype="bfloat16")
    params = sum(m.numel for m in plan.targets.values())
    assert round(params / 1e9) == 284, params
    worker = vllm_params(dims, VllmTarget(4, 1, dp=2, expert_parallel=True))
    a = "model.layers.4.attn."
    assert worker[a + "wq_b.weight"].shape == (64 * 512 // 4, 1024)
    assert worker[a + "wo_a.weight"].shape == (8 * 1024 // 4, 64 * 512 // 8)
    assert worker[a + "wo_b.weight"].shape == (4096, 8 * 1024 // 4)
    assert worker[a + "fused_wqa_wkv.weight"].shape == (1024 + 512, 4096)
    assert worker[a + "compressor.fused_wkv_wgate.weight"].shape == (2 * 2 * 512, 4096)  # ratio 4: overlapping
    assert worker["model.layers.5.attn.compressor.ape"].shape == (128, 512)  # ratio 128
    assert worker["model.layers.4.ffn.experts.routed_experts.w13_weight"].shape == (32, 2 * 2048, 4096)
    assert "model.layers.2.ffn.gate.tid2eid" in worker and "model.layers.3.ffn.gate.tid2eid" not in worker
    base = ["plan", "--config", str(PUBLISHED), "--pp", "4", "--first-stage-layers", "10", "--ep", "16",
            "--quantization", "none", "--no-execute-meta"]
    for extra in ([], ["--vllm-tp", "4", "--vllm-dp", "2", "--vllm-rank", "1", "--vllm-ep"]):
        assert main(base + extra) == 0
        out = capsys.readouterr().out
        assert "validated exact cover" in out and ("vLLM tensors" in out) == bool(extra), out
        assert "Megatron names: Megatron-LM's dev branch as Megatron-Bridge 0.6.2 maps it" in out, out


@pytest.mark.parametrize(("args", "message"), [
    ([], "expert_dtype 'fp4' (the config's routed experts) is not produced"),
    (["--quantization", "fp8"], "block FP8 needs expert_dtype='fp8' in the config vLLM serves, got 'fp4'"),
    (["--quantization", "none", "--tp", "2"], "Megatron-LM's dev branch, which asserts tensor_model_parallel_size 1"),
])
def test_what_is_not_translated_is_refused_in_one_line(capsys, args, message):
    from megarefit.cli import main

    assert main(["plan", "--config", str(PUBLISHED), "--no-execute-meta", *args]) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert message in text and "Traceback" not in text and len(text.strip().splitlines()) == 1, text


def test_the_demo_refuses_it_naming_why(capsys):
    from megarefit.cli import main

    assert main(["demo", "--config", str(PUBLISHED)]) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert "no Megatron-Core release (0.16-0.19) builds it" in text and len(text.strip().splitlines()) == 1, text


def test_no_draft_model_is_refit():
    from megarefit.errors import LayoutError
    from megarefit.targets import VllmTarget, vllm_params

    with pytest.raises(LayoutError, match="does not plan this family's multi-token-prediction layers"):
        vllm_params(ModelDims.from_hf_config(CFG), VllmTarget(2, 0, draft=True))


@st.composite
def _tiny(draw):
    """A DeepSeek-V4 config of random small dims, layer variants and hyper-connection width, and a trainer
    layout (pp dividing the layers, ep dividing the experts, sequential or TE-grouped experts)."""
    layers = draw(st.integers(1, 4))
    heads = draw(st.sampled_from([2, 4, 8]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0]))
    cfg = dsv4_config(num_hidden_layers=layers, hidden_size=draw(st.sampled_from([16, 32])), head_dim=16,
                      num_attention_heads=heads, o_groups=groups,
                      o_lora_rank=8, q_lora_rank=8, index_n_heads=2, index_head_dim=8, qk_rope_head_dim=4,
                      hc_mult=draw(st.integers(1, 4)), n_routed_experts=4, moe_intermediate_size=8, vocab_size=96,
                      num_hash_layers=draw(st.integers(0, layers)), num_nextn_predict_layers=0,
                      compress_ratios=draw(st.lists(st.sampled_from([0, 4, 128]), min_size=layers, max_size=layers)))
    pp = draw(st.sampled_from([p for p in (1, 2) if layers % p == 0]))
    return cfg, pp, draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from(["sequential", "te_grouped"]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_tiny())
def test_round_trips_are_exact_for_any_layer_variants(case):
    """Over layer variants (compress ratios, hash layers), hyper-connection widths, output groups and
    layouts: the plans cover every tensor exactly once (validated) and HF -> Megatron -> HF is bit-exact,
    each alpha one element of its scale."""
    from megarefit.translate import hf_to_megatron, megatron_to_hf

    cfg, pp, ep, experts = case
    hf = dsv4_checkpoint(cfg)
    shards = hf_to_megatron(hf, cfg, pp=pp, ep=ep, expert_layout=experts)
    assert all(t.numel() == 1 for s in shards.values() for n, t in s.items() if ".alpha_" in n)
    back = megatron_to_hf(shards, cfg, pp=pp, ep=ep, quantization="none")
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
