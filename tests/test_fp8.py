"""Block-FP8 refit targets against independent implementations.

* The quantizer is bit-identical to vLLM's own ``per_block_cast_to_fp8`` (the formula
  vLLM and DeepGEMM use), over shapes that align with the 128x128 grid and ones that do
  not, bf16 / fp16 / fp32 inputs, all-zero blocks, and power-of-two (UE8M0) scales.
* ``megatron_to_hf(..., quantization="fp8")`` over TP / PP / EP / ETP layouts gives, for
  every linear weight, exactly ``per_block_cast_to_fp8`` of the HF tensor the independent
  reference sharder started from, and leaves embeddings, norms, routers and biases alone.
* Which weights are quantized is what vLLM's own FP8 models expect: a vLLM model built
  on CPU from the FP8 config megarefit writes has ``weight_scale_inv`` exactly for those
  layers (its router gates and ``lm_head`` listed in ``modules_to_not_convert``).
* HF transformers loads the FP8 checkpoint megarefit writes (dequantizing on CPU): every
  weight equals megarefit's dequantization, and logits stay within a stated tolerance
  of the bf16 model's.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megarefit
from conftest import needs_amx, tiny_config
from megarefit import ModelDims
from megarefit.quant import (Fp8Format, UnsupportedQuantizationError, dequantize_fp8, quantization_config,
                             quantize_fp8, quantized_weight_names, resolve_quantization, scale_name)
from reference import moe_hf_state, moe_reference_shards, reference_hf_state, reference_shards

vllm_deep_gemm = pytest.importorskip("vllm.utils.deep_gemm")


def vllm_quantize(w: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return vllm_deep_gemm.per_block_cast_to_fp8(w, [128, 128], use_ue8m0=ue8m0)


def same_fp8(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return (a[0].dtype == b[0].dtype == torch.float8_e4m3fn and torch.equal(a[0].view(torch.uint8),
            b[0].view(torch.uint8)) and a[1].dtype == b[1].dtype == torch.float32 and torch.equal(a[1], b[1]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 300), st.integers(1, 300), st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       st.booleans(), st.sampled_from([1e-6, 1.0, 300.0]), st.integers(0, 2**16))
def test_quantizer_is_bit_identical_to_vllm(rows, cols, dtype, ue8m0, magnitude, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * magnitude).to(dtype)
    w[: rows // 3] = 0  # all-zero blocks take the 1e-4 floor
    ours = quantize_fp8(w, Fp8Format(ue8m0=ue8m0))
    assert ours[1].shape == (-(-rows // 128), -(-cols // 128))
    assert same_fp8(ours, vllm_quantize(w, ue8m0))
    # written into caller buffers, nothing else allocated for the results
    out, scale = torch.empty(rows, cols, dtype=torch.float8_e4m3fn), torch.empty(ours[1].shape)
    got = quantize_fp8(w, Fp8Format(ue8m0=ue8m0), out=out, scale_out=scale)
    assert got[0] is out and got[1] is scale and same_fp8(got, ours)


ALIGNED = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
           "intermediate_size": 512, "vocab_size": 300}  # every per-rank piece spans whole 128-blocks at tp=2
SMALL = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "intermediate_size": 384, "vocab_size": 300}  # q/k/v rows per group, ffn / tp = 192: blocks straddle


@pytest.mark.parametrize(("family", "name", "tp", "pp", "ep", "etp", "dims", "where"), [
    ("qwen3", "Qwen3-0.6B", 2, 2, 1, 2, ALIGNED, "trainer"),
    ("qwen3", "Qwen3-0.6B", 2, 1, 1, 2, SMALL, "both"),  # k/v rows per group (64) straddle; o_proj does not
    ("llama", "Llama-3.1-8B", 2, 1, 1, 2, SMALL | {"head_dim": 128}, "both"),
    ("qwen3_moe", "Qwen3-30B-A3B", 2, 1, 2, 1, ALIGNED | {"moe_intermediate_size": 256}, "trainer"),
    ("qwen3_moe", "Qwen3-30B-A3B", 2, 1, 1, 2, ALIGNED | {"moe_intermediate_size": 160}, "both"),
    ("mixtral", "Mixtral-8x7B-v0.1", 1, 1, 2, 1, ALIGNED | {"intermediate_size": 160}, "both"),  # w2 edge blocks
    ("mixtral", "Mixtral-8x7B-v0.1", 2, 1, 2, 1, ALIGNED, "trainer"),
], ids=["qwen3-aligned", "qwen3-straddling", "llama-mixed", "qwen3moe-aligned", "qwen3moe-etp2-mixed",
        "mixtral-ep2-edge-blocks", "mixtral-tp2-ep2"])
def test_megatron_to_hf_fp8_equals_vllm_quantization_of_the_hf_tensors(family, name, tp, pp, ep, etp, dims, where):
    """Each quantized weight equals vLLM's quantization of the full HF tensor, whether the
    trainer quantized its shard (blocks inside one shard, edge blocks included) or the
    receiver quantized after assembly (blocks straddling shards); the plan says which."""
    from megarefit import SourceLayout, plan_megatron_to_hf
    from megarefit.quant.planning import fp8_weight_count, plan_fp8, where_quantized

    if family in ("qwen3_moe", "mixtral"):
        from moe_cases import moe_config

        cfg = moe_config(name, **dims)
        hf = moe_hf_state(cfg, family, seed=3, dtype=torch.bfloat16)
        shards = moe_reference_shards(hf, cfg, family, tp=tp, pp=pp, ep=ep, etp=etp)
    else:
        cfg = tiny_config(name, **dims)
        hf = reference_hf_state(cfg, family, seed=3, dtype=torch.bfloat16)
        shards = reference_shards(hf, cfg, tp=tp, pp=pp)
    got = megarefit.megatron_to_hf(shards, cfg, tp=tp, pp=pp, ep=ep, etp=etp, quantization="fp8")
    quantized = {n for n in hf if n.endswith("proj.weight") or ".experts." in n or n.endswith((".w1.weight",
                                                                                              ".w2.weight", ".w3.weight"))}
    model = ModelDims.from_hf_config(cfg)
    assert quantized and quantized == set(quantized_weight_names(model))
    assert got.keys() == set(hf) | {scale_name(n) for n in quantized}
    for n, w in hf.items():
        if n in quantized:
            assert same_fp8((got[n], got[scale_name(n)]), vllm_quantize(w)), n
        else:  # embeddings, lm_head, norms, router gates stay bf16, untouched
            assert got[n].dtype == torch.bfloat16 and torch.equal(got[n], w), n
    assert sum(t.numel() * t.element_size() for t in got.values()) < 0.56 * sum(
        t.numel() * t.element_size() for t in hf.values())
    layout = SourceLayout.build(tp=tp, pp=pp, ep=ep, etp=etp, padded_vocab_size=model.padded_vocab_size(tp),
                                num_layers=model.num_layers)
    fp8_plan = plan_fp8(plan_megatron_to_hf(model, layout, "bfloat16"), Fp8Format())
    places = where_quantized(fp8_plan)
    assert places.keys() == quantized and fp8_weight_count(fp8_plan) == len(quantized)
    kinds = {"trainer" if p == "trainer" else "receiver" for p in places.values()}
    assert kinds == ({"trainer", "receiver"} if where == "both" else {where}), places
    assert all("block grid" in p for p in places.values() if p != "trainer")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["llama", "qwen2", "qwen3"]), st.sampled_from([1, 2]), st.sampled_from([1, 2]),
       st.sampled_from([64, 128, 192]), st.sampled_from([1, 2]), st.sampled_from([128, 192, 256, 320]),
       st.sampled_from([128, 256]), st.integers(0, 99))
def test_fp8_translation_is_bit_identical_over_dims(family, tp, pp, head_dim, hq, ffn, hidden, seed):
    """Dims that align with the 128 grid and ones that do not, trainer tp / pp: every
    quantized weight equals vLLM's quantization of the HF tensor."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    cfg = {"architectures": [arch], "model_type": family, "hidden_size": hidden, "num_attention_heads": 2 * hq,
           "num_key_value_heads": 2, "head_dim": head_dim, "intermediate_size": ffn * tp, "num_hidden_layers": 2,
           "vocab_size": 130, "tie_word_embeddings": bool(seed % 2)}
    hf = reference_hf_state(cfg, family, seed, dtype=torch.bfloat16)
    got = megarefit.megatron_to_hf(reference_shards(hf, cfg, tp=tp, pp=pp), cfg, tp=tp, pp=pp, quantization="fp8")
    quantized = quantized_weight_names(ModelDims.from_hf_config(cfg))
    for n, w in hf.items():
        assert (same_fp8((got[n], got[scale_name(n)]), vllm_quantize(w)) if n in quantized
                else torch.equal(got[n], w)), n


def test_quantization_settings_and_refusals():
    cfg = tiny_config("Qwen3-0.6B")
    assert resolve_quantization("auto", cfg) is None and resolve_quantization("none", cfg) is None
    assert resolve_quantization("fp8", cfg) == Fp8Format((128, 128))
    fp8_cfg = cfg | {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [64, 128]}}
    assert resolve_quantization("auto", fp8_cfg) == Fp8Format((64, 128))
    for qc, words in (({"quant_method": "mxfp4"}, "'mxfp4'"), ({"quant_method": "compressed-tensors"},
                      "'compressed-tensors'"), ({"quant_method": "fp8"}, "per-tensor"),
                      ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
                       "'static'")):
        with pytest.raises(UnsupportedQuantizationError, match=words):
            resolve_quantization("auto", cfg | {"quantization_config": qc})
    with pytest.raises(UnsupportedQuantizationError, match="'int4'"):
        resolve_quantization("int4", cfg)
    with pytest.raises(UnsupportedQuantizationError, match="torch.int32"):
        quantize_fp8(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(UnsupportedQuantizationError, match="2-D"):
        quantize_fp8(torch.zeros(4))


def test_hf_transformers_loads_the_fp8_checkpoint(tmp_path):
    """The FP8 checkpoint megarefit writes loads in HF transformers (fine-grained FP8,
    dequantized on CPU) with no missing / unexpected keys: every weight equals
    megarefit's dequantization, and the logits stay close to the bf16 model's."""
    import transformers

    from megarefit.integrations.hf import build_hf_model, hf_logits, save_checkpoint

    cfg = tiny_config("Qwen3-0.6B", hidden_size=256, intermediate_size=384, head_dim=64, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = build_hf_model(cfg)
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    shards = megarefit.hf_to_megatron(hf, cfg, tp=2)
    dims = ModelDims.from_hf_config(cfg)
    fp8 = megarefit.megatron_to_hf(shards, cfg, tp=2, quantization="fp8")
    fp8_cfg = cfg | {"quantization_config": quantization_config(dims, Fp8Format())}
    save_checkpoint(tmp_path, fp8_cfg, fp8)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True,
                                                                     dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    params = dict(loaded.named_parameters())
    for name in quantized_weight_names(dims):
        want = dequantize_fp8(fp8[name], fp8[scale_name(name)], dtype=torch.float32)
        assert torch.equal(params[name].detach(), want), name
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    ref, got = hf_logits(model, tokens), hf_logits(loaded.eval(), tokens)
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
    print(f"fp8 vs bf16 logits: max |diff| / max |logit| = {rel:.4f}, cosine = {cos:.6f}")
    # FP8 e4m3 with 128x128 blocks on a random 4-layer model: measured 0.060 and 0.9982
    assert 0 < rel < 0.1 and cos > 0.995, (rel, cos)


@needs_amx
def test_vllm_fp8_models_quantize_exactly_these_weights(tmp_path):
    """vLLM's own FP8 models, built on CPU from the config megarefit writes (its
    ``quantization_config`` with ``modules_to_not_convert``), hold ``weight_scale_inv``
    exactly for the parameters that megarefit's quantized HF weights feed."""
    from megarefit.demo.workers import run_workers
    from megarefit.targets import VllmTarget, vllm_params
    from moe_cases import moe_config
    from vllm_loader_jobs import vllm_param_shapes_job

    cases = {}
    for name in ("Qwen3-30B-A3B", "DeepSeek-V3", "GLM-4.5-Air"):
        cfg = moe_config(name, hidden_size=128, moe_intermediate_size=128, intermediate_size=256)
        cfg["quantization_config"] = quantization_config(ModelDims.from_hf_config(cfg), Fp8Format())
        cases[name] = cfg
    (shapes,) = run_workers(vllm_param_shapes_job,
                            start_method="spawn", world_size=1, args=(cases, str(tmp_path)), timeout=600)
    for name, cfg in cases.items():
        dims = ModelDims.from_hf_config(cfg)
        quantized = quantized_weight_names(dims)
        params = vllm_params(dims, VllmTarget(1, 0))
        want = {p for p, v in params.items() if any(piece.hf_name in quantized for piece in v.pieces)}
        assert all(all(piece.hf_name in quantized for piece in params[p].pieces) for p in want)  # never mixed
        got = {n.removesuffix("_scale_inv") for n in shapes[name] if n.endswith("weight_scale_inv")}
        assert got == want, (name, sorted(got ^ want)[:6])
        assert all(shapes[name][p][1] == "torch.float8_e4m3fn" for p in want)


KERNEL_CHECK = """
import torch
from megarefit.quant import Fp8Format, quantize_fp8
from megarefit.quant.kernel import Fp8Quantizer
g = torch.Generator().manual_seed(0)
items, want = [], []
every_bf16 = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
every_bf16 = every_bf16[torch.isfinite(every_bf16.float())]
tensors = [every_bf16[: every_bf16.numel() // 128 * 128].reshape(-1, 128)]  # every finite bf16 value
for shape in [(128, 128), (200, 130), (1, 5)]:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for magnitude in (1e-6, 1.0, 300.0):
            w = (torch.randn(shape, generator=g) * magnitude).to(dtype)
            w[: shape[0] // 4] = 0
            tensors.append(w)
for w in tensors:
    want.append(quantize_fp8(w))
    items.append((w, torch.empty(w.shape, dtype=torch.float8_e4m3fn),
                  torch.empty(Fp8Format().scale_shape(tuple(w.shape)))))
Fp8Quantizer(items, Fp8Format(), fused=True)()
bad = [i for i, ((_, q, s), (wq, ws)) in enumerate(zip(items, want))
       if not (torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s, ws))]
print("MISMATCHES", bad)
"""


def test_fused_kernel_is_bit_identical_in_the_triton_interpreter():
    """The GPU kernel's arithmetic (block amax, correctly rounded scale, fp32 -> e4m3
    round-half-even done in integer steps, -0.0 kept) run by Triton's interpreter on the
    CPU gives the torch formula's bytes for every finite bf16 value, fp16 / fp32
    sources, edge blocks and all-zero blocks. (On a GPU: tests/test_fp8_gpu.py.)"""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert "MISMATCHES []" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def _dequantized(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Block-FP8 ``w`` [..., rows, cols] times its 128x128 block scales [..., rows/128, cols/128]."""
    if scale is None:
        return w.float()
    rows, cols = w.shape[-2:]
    full = scale.float().repeat_interleave(128, -2)[..., :rows, :].repeat_interleave(128, -1)[..., :cols]
    return w.float() * full


def test_fp8_draft_targets_carry_vllms_own_quantized_blocks(tmp_path):
    """Block FP8 (the drafter gets the target's quantization): the MTP block's linear weights
    arrive as float8 + ``weight_scale_inv``, ``eh_proj`` stays in the model dtype (vLLM's
    drafters build it as a plain ``nn.Linear``), and every FP8 parameter, dequantized, equals
    the checkpoint vLLM's own quantizer (``per_block_cast_to_fp8``) makes of the same HF
    tensors, dequantized and placed by the bf16 draft layout that the loader test proves.
    (vLLM's FP8 layers themselves need AMX on CPU: their loaders are not run here; the bf16
    draft layout is proved against vLLM's drafters in test_vllm_draft.py.)"""
    from megarefit import RankCoord, SourceLayout
    from megarefit.quant.planning import quantize_sources
    from megarefit.targets import VllmTarget, plan_megatron_to_vllm, vllm_params
    from megarefit.transport import LocalTransport
    from megarefit.transport.execute import run_refit_cycle
    from moe_cases import case_config
    from reference import hf_checkpoint_state, vllm_fp8_checkpoint, with_mtp_layer

    cfg = case_config("deepseek_v3") | {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 512,
                                        "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 64,
                                        "qk_rope_head_dim": 64, "v_head_dim": 64, "num_nextn_predict_layers": 1}
    hf = {k: v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)
          for k, v in with_mtp_layer(cfg, hf_checkpoint_state(cfg, tmp_path, 9)).items()}
    dims = ModelDims.from_hf_config(cfg)
    names = quantized_weight_names(dims)
    n = dims.num_layers
    assert f"model.layers.{n}.eh_proj.weight" not in names and f"model.layers.{n}.self_attn.o_proj.weight" in names
    mtp = {k: t for k, t in hf.items() if k.startswith(f"model.layers.{n}.")}  # what the drafter holds
    ckpt = vllm_fp8_checkpoint(mtp, names)
    want_hf = {k: _dequantized(ckpt[k], ckpt.get(k + "_scale_inv")) for k in mtp}
    fmt = Fp8Format()
    shards = megarefit.hf_to_megatron(hf, cfg, tp=2, ep=2, etp=1, layer_spec="te", expert_layout="te_grouped",
                                      mtp_layers=1)
    layout = SourceLayout.build(tp=2, pp=1, ep=2, etp=1, padded_vocab_size=dims.padded_vocab_size(2),
                                num_layers=n, layer_spec="te", expert_layout="te_grouped", mtp_layers=1)
    for rank in range(2):
        target = VllmTarget(2, rank, expert_parallel=True, draft=True)
        plan = plan_megatron_to_vllm(dims, layout, "bfloat16", target, fmt)
        served = quantize_sources(plan, {RankCoord(*r): s for r, s in shards.items()}, fmt)
        got = {k: t.clone() for k, t in run_refit_cycle(plan, LocalTransport(served))}
        fp8 = {k for k, t in got.items() if t.dtype == torch.float8_e4m3fn}
        assert f"model.layers.{n}.eh_proj.weight" in got and f"model.layers.{n}.eh_proj.weight" not in fp8
        assert f"model.layers.{n}.mtp_block.self_attn.o_proj.weight" in fp8
        assert {k + "_scale_inv" for k in fp8} <= set(got)
        for name, param in vllm_params(dims, target).items():
            want = torch.zeros(param.shape)
            for p in param.pieces:
                want[p.param_box.slices()] = want_hf[p.hf_name][p.hf_box.slices()].reshape(p.param_box.lengths)
            assert torch.equal(_dequantized(got[name], got.get(name + "_scale_inv") if name in fp8 else None),
                               want), (name, rank)


@pytest.mark.parametrize("shape", [(256, 384), (130, 200), (1, 129)])
def test_reference_block_fp8_is_vllms_quantizer(shape):
    """tests/reference.py's block_fp8 (the GPU tests' expectation, where vLLM is not installed)
    equals vLLM's own ``per_block_cast_to_fp8`` bit for bit, padded edges and tiny blocks included."""
    per_block_cast_to_fp8 = pytest.importorskip("vllm.utils.deep_gemm").per_block_cast_to_fp8
    from reference import block_fp8

    w = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(torch.bfloat16)
    w[:128, :128] = 0.0  # a whole zero tile: its scale is the 1e-4 clamp's
    w[-1, -1] = 300.0
    ours, theirs = block_fp8(w), per_block_cast_to_fp8(w, [128, 128])
    assert torch.equal(ours[0].view(torch.uint8), theirs[0].view(torch.uint8))
    assert torch.equal(ours[1], theirs[1])
