"""LoRA adapter rows, shapes, PEFT naming and the merge, without Megatron (fast; tests/test_bridge_lora.py
checks the same code on real Bridge-wrapped Megatron-Core modules).

* ``lora_to_peft`` / ``peft_to_lora`` are exact inverses for both wrappers, any dims and TP (hypothesis);
* LoRA's fused ``linear_qkv`` holds one A: unequal q / k / v ``lora_A`` are refused, naming the fix;
* each refused adapter (DoRA, router, shared and routed experts, MLA, Mamba) is refused by
  ``adapter_row``, the classifier and ``MergedLoRA``, the message naming the module and the fix;
* ``MergedLoRA`` at tp=1 serves ``(W.float() + (alpha / r) * (B.float() @ A.float())).to(W.dtype)``
  (Bridge's merge, float32 and bfloat16), refreshes from the live factors, and leaves the rest as is.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

from megarefit.errors import LayoutError, MissingParameterError, ShapeMismatchError, UnsupportedAdapterError
from megarefit.layout.classify import classify_model
from megarefit.layout.dims import ModelDims
from megarefit.layout.lora import adapter_local_shape
from megarefit.online.trainer.lora_merge import MergedLoRA
from megarefit.specs.lora import CANONICAL_ROWS, LORA_ROWS, REFUSED, adapter_row
from megarefit.translate_peft import lora_to_peft, peft_to_lora

ROWS = {"lora": LORA_ROWS, "canonical_lora": CANONICAL_ROWS}


def _shards(cfg: dict, wrapper: str, r: int, tp: int, seed: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    dims, g = ModelDims.from_hf_config(cfg), torch.Generator().manual_seed(seed)
    return {t: {row.megatron.format(layer=layer): torch.randn(adapter_local_shape(row, dims, r, tp), generator=g)
                for layer in range(cfg["num_hidden_layers"]) for row in ROWS[wrapper]} for t in range(tp)}


@st.composite
def cases(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    groups = tp * draw(st.sampled_from([1, 2]))
    heads = groups * draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([4, 8]))
    cfg = tiny_config("Qwen3-0.6B", num_attention_heads=heads, num_key_value_heads=groups, head_dim=head_dim,
                      hidden_size=16, intermediate_size=tp * draw(st.sampled_from([4, 6])),
                      num_hidden_layers=draw(st.sampled_from([1, 2])))
    return cfg, draw(st.sampled_from(["lora", "canonical_lora"])), tp * draw(st.sampled_from([1, 2])), tp


@settings(max_examples=40, deadline=None)
@given(cases(), st.integers(0, 2**16))
def test_peft_round_trip(case, seed):
    cfg, wrapper, r, tp = case
    shards = _shards(cfg, wrapper, r, tp, seed)
    state, config = lora_to_peft(shards, cfg, alpha=2 * r)
    assert config["r"] == r and config["lora_alpha"] == 2 * r
    assert len(state) == 2 * 7 * cfg["num_hidden_layers"]
    assert all(n.startswith("base_model.model.model.layers.") for n in state)
    back = peft_to_lora(state, config, cfg, tp=tp, wrapper=wrapper)
    assert back.keys() == shards.keys()
    for t in shards:
        assert back[t].keys() == shards[t].keys()
        assert all(torch.equal(back[t][n], shards[t][n]) for n in shards[t])
    again, _ = lora_to_peft(back, cfg, alpha=2 * r)
    assert again.keys() == state.keys() and all(torch.equal(again[n], state[n]) for n in state)


def test_peft_names_and_the_duplicated_a():
    cfg = tiny_config("Qwen3-0.6B", num_hidden_layers=1)
    shards = _shards(cfg, "lora", 4, 2)
    state, config = lora_to_peft(shards, cfg, alpha=8)
    p = "base_model.model.model.layers.0."
    a = [state[p + f"self_attn.{x}_proj.lora_A.weight"] for x in "qkv"]
    assert torch.equal(a[0], a[1]) and torch.equal(a[0], a[2]) and a[0].shape == (4, 64)
    dims = ModelDims.from_hf_config(cfg)
    assert state[p + "self_attn.q_proj.lora_B.weight"].shape == (dims.size("q"), 4)
    assert state[p + "self_attn.k_proj.lora_B.weight"].shape == (dims.size("kv"), 4)
    assert state[p + "mlp.down_proj.lora_A.weight"].shape == (4, dims.ffn_hidden_size)
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    state[p + "self_attn.k_proj.lora_A.weight"] = a[1] + 1
    with pytest.raises(ShapeMismatchError, match=r"k_proj.lora_A.weight differs .*wrapper='canonical_lora'"):
        peft_to_lora(state, config, cfg, tp=2, wrapper="lora")
    canonical = peft_to_lora(state, config, cfg, tp=2, wrapper="canonical_lora")  # one A per projection: fine
    assert "decoder.layers.0.self_attention.linear_qkv.adapter.adapter_k.linear_in.weight" in canonical[0]
    del state[p + "mlp.up_proj.lora_B.weight"]
    with pytest.raises(MissingParameterError, match=r"one factor only: .*adapter_up.linear_out.weight"):
        peft_to_lora(state, config, cfg, tp=2, wrapper="canonical_lora")


REFUSED_NAMES = {
    "DoRA": "decoder.layers.0.self_attention.linear_qkv.adapter.weight_magnitude",
    "the MoE router": "decoder.layers.1.mlp.router.adapter.linear_in.weight",
    "shared experts": "decoder.layers.1.mlp.shared_experts.linear_fc1.adapter.linear_in.weight",
    "routed experts": "decoder.layers.1.mlp.experts.linear_fc1.adapter.linear_out.weight",
    "MLA attention": "decoder.layers.0.self_attention.linear_kv_down_proj.adapter.linear_in.weight",
    "a Mamba mixer": "decoder.layers.0.mixer.in_proj.adapter.linear_in.weight",
}


@pytest.mark.parametrize("module", [r.module for r in REFUSED])
def test_refusals_name_the_module_and_the_fix(module):
    name = REFUSED_NAMES[module]
    fix = next(r.fix for r in REFUSED if r.module == module)
    with pytest.raises(UnsupportedAdapterError) as err:
        adapter_row(name)
    assert name in str(err.value) and f"on {module} is refused" in str(err.value) and fix in str(err.value)
    cfg = tiny_config("Qwen3-0.6B", num_hidden_layers=2)
    with pytest.raises(UnsupportedAdapterError, match="is refused"):
        MergedLoRA({name: torch.zeros(2, 2)}, ModelDims.from_hf_config(cfg), alpha=1, rank=2)
    with pytest.raises(UnsupportedAdapterError, match="is refused"):
        lora_to_peft({0: {name: torch.zeros(2, 2)}}, cfg, alpha=1)


def test_classifier_reports_a_refused_adapter():
    cfg = tiny_config("Qwen3-0.6B", num_hidden_layers=2)
    root = torch.nn.Module()
    node = root
    for part in REFUSED_NAMES["DoRA"].split(".")[:-1]:
        child = torch.nn.Module()
        node.add_module(part, child)
        node = child
    node.weight_magnitude = torch.nn.Parameter(torch.zeros(4))
    (c,) = classify_model(root, ModelDims.from_hf_config(cfg))
    assert "on DoRA is refused" in c.problem


def _lora_params(dims: ModelDims, r: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g, L = torch.Generator().manual_seed(1), "module.decoder.layers.0."
    shapes = {"self_attention.linear_qkv": (dims.size("qkv"), dims.hidden_size),
              "mlp.linear_fc2": (dims.hidden_size, dims.ffn_hidden_size)}
    out = {L + "input_layernorm.weight": torch.randn(dims.hidden_size, generator=g).to(dtype)}
    for mod, (o, i) in shapes.items():
        out[L + mod + ".to_wrap.weight"] = torch.randn(o, i, generator=g).to(dtype)
        out[L + mod + ".adapter.linear_in.weight"] = torch.randn(r, i, generator=g).to(dtype)
        out[L + mod + ".adapter.linear_out.weight"] = torch.randn(o, r, generator=g).to(dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_copy_is_bridges_merge(dtype):
    dims = ModelDims.from_hf_config(tiny_config("Qwen3-0.6B", num_hidden_layers=1))
    params = _lora_params(dims, 4, dtype)
    merged = MergedLoRA(params, dims, alpha=6, rank=4)
    L = "module.decoder.layers.0."
    assert set(merged.served) == {L[7:] + n for n in ("input_layernorm.weight", "self_attention.linear_qkv.weight",
                                                      "mlp.linear_fc2.weight")}
    for mod in ("self_attention.linear_qkv", "mlp.linear_fc2"):
        w, a, b = (params[L + mod + s] for s in (".to_wrap.weight", ".adapter.linear_in.weight",
                                                 ".adapter.linear_out.weight"))
        want = (w.float() + 1.5 * (b.float() @ a.float())).to(dtype)
        got = merged.served[L[7:] + mod + ".weight"]
        assert got.dtype == dtype and torch.equal(got, want)
        assert got.data_ptr() != w.data_ptr()
    assert merged.served[L[7:] + "input_layernorm.weight"] is params[L + "input_layernorm.weight"]
    with torch.no_grad():
        params[L + "mlp.linear_fc2.adapter.linear_out.weight"].zero_()
    merged.refresh()
    assert torch.equal(merged.served[L[7:] + "mlp.linear_fc2.weight"], params[L + "mlp.linear_fc2.to_wrap.weight"])
    assert merged.gathered_bytes == 0
    assert merged.served_copy_bytes == sum(params[L + m + ".to_wrap.weight"].nbytes
                                           for m in ("self_attention.linear_qkv", "mlp.linear_fc2"))


def test_merge_refuses_incomplete_or_misshapen_adapters():
    dims = ModelDims.from_hf_config(tiny_config("Qwen3-0.6B", num_hidden_layers=1))
    params = _lora_params(dims, 4, torch.float32)
    L = "module.decoder.layers.0."
    with pytest.raises(LayoutError, match=r"linear_in.weight on tp rank 0: local shape \(4, 64\), expected \(2, 64\)"):
        MergedLoRA(params, dims, alpha=4, rank=2)
    broken = {n: p for n, p in params.items() if n != L + "mlp.linear_fc2.adapter.linear_out.weight"}
    with pytest.raises(MissingParameterError, match="lacks linear_out"):
        MergedLoRA(broken, dims, alpha=4, rank=4)
    with pytest.raises(LayoutError, match="needs the tensor-parallel group"):
        MergedLoRA(params, dims, alpha=4, rank=4, tp=2)
    with pytest.raises(LayoutError, match="the adapter rank r = 3 does not split over tp=2"):
        adapter_local_shape(LORA_ROWS[0], dims, 3, 2)
