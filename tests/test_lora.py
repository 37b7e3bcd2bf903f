"""LoRA adapter rows, shapes, PEFT naming and the merge, without Megatron (fast; tests/test_bridge_lora.py
checks the same code on real Bridge-wrapped Megatron-Core modules).

* ``lora_to_peft`` / ``peft_to_lora`` are exact inverses for both wrappers, any dims and TP (hypothesis);
* LoRA's fused ``linear_qkv`` holds one A: unequal q / k / v ``lora_A`` are refused, naming the fix;
* each refused adapter (DoRA, router, MLA, Mamba) is refused by ``adapter_row``, the classifier and
  ``MergedLoRA``, the message naming the module and the fix;
* shared-expert and SequentialMLP experts' adapters merge per expert, a TE grouped linear's shared adapter
  into each of its local experts (its per-expert / shared-outer 3-D adapters refused); routed experts'
  ``linear_fc2`` adapters are refused at expert-TP > 1, and MoE adapters by the adapter-only refit;
* ``MergedLoRA`` at tp=1 serves ``(W.float() + (alpha / r) * (B.float() @ A.float())).to(W.dtype)``
  (Bridge's merge, float32 and bfloat16), refreshes from the live factors, and leaves the rest as is;
* the Transformer-Engine spelling of wrapped linears (``to_wrap.layer_norm_weight``; stand-in modules
  of TE's class names, no TE here) classifies as the TE rows and merges, the fused norms served as is;
  the stand-ins are checked against the names a real TE run recorded (docs/lora_te_h200.jsonl).
"""

from __future__ import annotations

import json
from pathlib import Path

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
    with pytest.raises(LayoutError, match=r"linear_in.weight on tp rank 0: local shape \(4, 64\), expected \(2, 64\) \(r=2, split over 1\)"):
        MergedLoRA(params, dims, alpha=4, rank=2)
    broken = {n: p for n, p in params.items() if n != L + "mlp.linear_fc2.adapter.linear_out.weight"}
    with pytest.raises(MissingParameterError, match="lacks linear_out"):
        MergedLoRA(broken, dims, alpha=4, rank=4)
    with pytest.raises(LayoutError, match=r"at tp=2 needs the tensor-parallel group \(tp_group\)"):
        MergedLoRA(params, dims, alpha=4, rank=4, tp=2)
    with pytest.raises(LayoutError, match="the adapter rank r = 3 does not split over tp=2"):
        adapter_local_shape(LORA_ROWS[0], dims, 3, 2)


def _moe_params(dims: ModelDims, r: int, experts: int) -> dict[str, torch.Tensor]:
    """A MoE layer's wrapped shared expert and SequentialMLP experts (tp = etp = 1), full factors."""
    g, L = torch.Generator().manual_seed(2), "decoder.layers.1.mlp."
    h, f, s = dims.hidden_size, dims.moe_ffn_hidden_size, dims.shared_expert_ffn
    shapes = {"shared_experts.linear_fc1": (2 * s, h), "shared_experts.linear_fc2": (h, s)}
    shapes.update({f"experts.local_experts.{e}.linear_fc{k}": (2 * f, h) if k == 1 else (h, f)
                   for e in range(experts) for k in (1, 2)})
    out = {L + "router.weight": torch.randn(dims.num_experts, h, generator=g)}
    for mod, (o, i) in shapes.items():
        out[L + mod + ".to_wrap.weight"] = torch.randn(o, i, generator=g)
        out[L + mod + ".adapter.linear_in.weight"] = torch.randn(r, i, generator=g)
        out[L + mod + ".adapter.linear_out.weight"] = torch.randn(o, r, generator=g)
    return out


def test_moe_adapters_merge_per_expert():
    """Shared-expert and every routed expert's adapters merge into their own base (tp = etp = 1: Bridge's
    product, computed here from the full factors); the router, unadapted, is served as is."""
    cfg = tiny_config("GLM-4.5-Air", n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1,
                      first_k_dense_replace=1, num_hidden_layers=2)
    dims = ModelDims.from_hf_config(cfg)
    params = _moe_params(dims, 4, 4)
    merged = MergedLoRA(params, dims, alpha=6, rank=4)
    wrapped = sorted({n.split(".to_wrap.")[0] for n in params if ".to_wrap." in n})
    assert len(wrapped) == 2 + 2 * 4
    for mod in wrapped:
        w, a, b = (params[mod + s] for s in (".to_wrap.weight", ".adapter.linear_in.weight", ".adapter.linear_out.weight"))
        assert torch.equal(merged.served[mod + ".weight"], w + 1.5 * (b @ a)), mod
    assert merged.served["decoder.layers.1.mlp.router.weight"] is params["decoder.layers.1.mlp.router.weight"]


def _grouped_params(dims: ModelDims, r: int, experts: int, factor_dims: int = 2) -> dict[str, torch.Tensor]:
    """A TEGroupedMLP layer as Bridge's LoRA wraps it (tp = etp = 1): ``weight{e}`` per local expert under
    ``to_wrap``, one adapter per grouped linear (``share_expert_adapters``), or 3-D factors (one per expert)."""
    g, L = torch.Generator().manual_seed(3), "decoder.layers.1.mlp.experts."
    h, f = dims.hidden_size, dims.moe_ffn_hidden_size
    out = {}
    for mod, (o, i) in {"linear_fc1": (2 * f, h), "linear_fc2": (h, f)}.items():
        out.update({f"{L}{mod}.to_wrap.weight{e}": torch.randn(o, i, generator=g) for e in range(experts)})
        lead = (experts,) * (factor_dims - 2)
        out[L + mod + ".adapter.linear_in.weight"] = torch.randn(*lead, r, i, generator=g)
        out[L + mod + ".adapter.linear_out.weight"] = torch.randn(*lead, o, r, generator=g)
    return out


def test_grouped_expert_adapters_merge_into_every_local_expert():
    """TE grouped experts under Bridge's share_expert_adapters: the one adapter of a grouped linear merges into
    each local expert's ``weight{e}`` (the product computed here from the factors), served unwrapped."""
    cfg = tiny_config("GLM-4.5-Air", n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1,
                      first_k_dense_replace=1, num_hidden_layers=2)
    dims = ModelDims.from_hf_config(cfg)
    params = _grouped_params(dims, 4, 4)
    merged = MergedLoRA(params, dims, alpha=6, rank=4)
    L = "decoder.layers.1.mlp.experts."
    assert sorted(merged.served) == sorted(f"{L}linear_fc{k}.weight{e}" for k in (1, 2) for e in range(4))
    for k in (1, 2):
        a, b = (params[f"{L}linear_fc{k}.adapter.{f}.weight"] for f in ("linear_in", "linear_out"))
        for e in range(4):
            want = params[f"{L}linear_fc{k}.to_wrap.weight{e}"] + 1.5 * (b @ a)
            assert torch.equal(merged.served[f"{L}linear_fc{k}.weight{e}"], want), (k, e)


def test_the_grouped_stand_in_is_what_real_te_gave():
    """The grouped experts' adapter names and factor ranks of the stand-in above are those Bridge built over real
    TE grouped experts (docs/lora_te_h200.jsonl, both wrappers: CanonicalLoRA keeps a grouped linear_fc1 unfused)."""
    cfg = tiny_config("GLM-4.5-Air", n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1,
                      first_k_dense_replace=1, num_hidden_layers=2)
    stand_in = {n: p.ndim for n, p in _grouped_params(ModelDims.from_hf_config(cfg), 4, 4).items() if ".adapter." in n}
    for line in TE_RUN.read_text().splitlines():
        for key in ("moe-lora-tp1", "moe-canonical_lora-tp1"):
            real = json.loads(line)["cases"][key]["grouped_adapters"]
            assert stand_in == {n: len(shape) for n, shape in real.items()}, key


def test_grouped_expert_adapters_of_one_per_expert_refused():
    """Bridge's GroupedExpertLinearAdapter / SharedOuterGroupedExpertAdapter keep the grouped adapter's names with
    3-D factors: refused, naming Bridge's switch."""
    cfg = tiny_config("GLM-4.5-Air", n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1,
                      first_k_dense_replace=1, num_hidden_layers=2)
    dims = ModelDims.from_hf_config(cfg)
    with pytest.raises(UnsupportedAdapterError, match=r"linear_fc1.adapter.linear_in.weight: a 3-D factor "
                       r"\(4, 4, 64\), Bridge's GroupedExpertLinearAdapter.*share_expert_adapters=True"):
        MergedLoRA(_grouped_params(dims, 4, 4, factor_dims=3), dims, alpha=6, rank=4)


def test_expert_fc2_adapters_refused_at_expert_tp():
    """At expert_tensor_parallel_size > 1 Bridge's routed-expert linear_fc2 adapter does not compute the merged
    product (Megatron-Bridge #5634, measured in tests/test_bridge_lora.py): refused before any collective; the
    shared expert's split over TP is not affected."""
    cfg = tiny_config("GLM-4.5-Air", n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1,
                      first_k_dense_replace=1, num_hidden_layers=2)
    dims = ModelDims.from_hf_config(cfg)
    params = {n: p for n, p in _moe_params(dims, 4, 1).items() if "local_experts" in n and "fc2" in n}
    params = {n: p[:, :16] if n.endswith("to_wrap.weight") or "linear_in" in n else p[:32] for n, p in params.items()}
    with pytest.raises(UnsupportedAdapterError, match=r"local_experts.0.linear_fc2.adapter.linear_in.weight at "
                       r"expert_tensor_parallel_size=2: .*issue #5634.*expert_tensor_parallel_size=1"):
        MergedLoRA(params, dims, alpha=6, rank=4, etp=2, etp_rank=0, etp_group=object())


def test_moe_adapters_refused_for_the_adapter_only_refit():
    cfg = tiny_config("Qwen3-0.6B", num_hidden_layers=2)
    for name in ("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.adapter.linear_in.weight",
                 "decoder.layers.1.mlp.experts.linear_fc2.adapter.linear_in.weight",
                 "decoder.layers.1.mlp.shared_experts.linear_fc2.adapter.linear_out.weight"):
        assert adapter_row(name)[1] == 1
        with pytest.raises(UnsupportedAdapterError, match="adapter-only refit plans dense adapters only.*MergedLoRA"):
            lora_to_peft({0: {name: torch.zeros(2, 2)}}, cfg, alpha=1)


def test_shared_expert_adapters_refused_under_overlap_at_tp2():
    cfg = tiny_config("GLM-4.5-Air", n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1,
                      first_k_dense_replace=1, num_hidden_layers=2)
    dims = ModelDims.from_hf_config(cfg)
    params = {n: p for n, p in _moe_params(dims, 4, 1).items() if "shared_experts.linear_fc2" in n}
    params = {n: p[:, :16] if n.endswith("to_wrap.weight") or "linear_in" in n else p[:32] for n, p in params.items()}
    with pytest.raises(UnsupportedAdapterError, match=r"shared_experts.linear_fc2.adapter.* with "
                       r"moe_shared_expert_overlap=True at tp=2: .*#5634"):
        MergedLoRA(params, dims, alpha=6, rank=4, tp=2, tp_group=object(), shared_expert_overlap=True)
    whole = {n: p for n, p in _moe_params(dims, 4, 1).items() if "shared_experts" in n}
    assert len(MergedLoRA(whole, dims, alpha=6, rank=4, shared_expert_overlap=True).served) == 2  # tp 1: exact


def _named_class(name: str) -> type[torch.nn.Module]:
    return type(name, (torch.nn.Module,), {})  # classified by class name, as Megatron's / TE's own are


def _te_wrapped_layer(dims: ModelDims, r: int) -> torch.nn.Module:
    """One decoder layer as Bridge's ``LoRA`` wraps Megatron's Transformer-Engine spec: the fused-norm
    ``TELayerNormColumnParallelLinear`` under ``to_wrap`` keeps its ``layer_norm_weight`` there
    (Bridge 0.6.2 ``TEFusedLoRALinear`` reads ``self.to_wrap.layer_norm_weight``), no separate norms; the
    adapter is Megatron's local Column/RowParallelLinear whatever the base's spelling."""
    g = torch.Generator().manual_seed(2)
    shapes = {"self_attention.linear_qkv": ("TELayerNormColumnParallelLinear", dims.size("qkv"), dims.hidden_size),
              "self_attention.linear_proj": ("TERowParallelLinear", dims.hidden_size, dims.size("q")),
              "mlp.linear_fc1": ("TELayerNormColumnParallelLinear", dims.size("2ffn"), dims.hidden_size),
              "mlp.linear_fc2": ("TERowParallelLinear", dims.hidden_size, dims.ffn_hidden_size)}
    root = torch.nn.Module()
    for mod, (cls, o, i) in shapes.items():
        node = root
        for part in ("decoder", "layers", "0", *mod.split(".")):
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        base, adapter = _named_class(cls)(), torch.nn.Module()
        base.weight = torch.nn.Parameter(torch.randn(o, i, generator=g))
        if cls.startswith("TELayerNorm"):
            base.layer_norm_weight = torch.nn.Parameter(torch.randn(i, generator=g))
        a_cls, b_cls = ("ColumnParallelLinear",) * 2 if "Column" in cls else ("RowParallelLinear", "ColumnParallelLinear")
        adapter.linear_in, adapter.linear_out = _named_class(a_cls)(), _named_class(b_cls)()
        adapter.linear_in.weight = torch.nn.Parameter(torch.randn(r, i, generator=g))
        adapter.linear_out.weight = torch.nn.Parameter(torch.randn(o, r, generator=g))
        node.to_wrap, node.adapter = base, adapter
    return root


TE_RUN = Path(__file__).resolve().parents[1] / "docs" / "lora_te_h200.jsonl"


def test_the_te_stand_in_is_what_real_te_gave():
    """The stand-in's wrapped parameters and the module classes megarefit reads for them are those of the
    real TE run (tests/bridge_lora_te_gpu.py on an H200: Megatron-Core's TE spec wrapped by Bridge's LoRA,
    recorded in docs/lora_te_h200.jsonl), so the test below runs on what Bridge builds over real TE."""
    dims = ModelDims.from_hf_config(tiny_config("Qwen3-0.6B", num_hidden_layers=1))
    stand_in = {c.name: c.module_class for c in classify_model(_te_wrapped_layer(dims, r=4), dims)}
    for line in TE_RUN.read_text().splitlines():
        run = json.loads(line)
        assert stand_in == run["cases"]["lora-tp1"]["wrapped"], (run["transformer_engine"], run["tf32"])


def test_te_spelled_wrapped_bases_classify_and_serve_as_the_te_spec():
    """The Transformer-Engine spelling of a wrapped layer (stand-in modules of TE's class names, as the real
    TE run gave them: the test above): every parameter agrees with the TE rows, the fused norms are served
    unchanged under the unwrapped TE names, the linears merged."""
    dims = ModelDims.from_hf_config(tiny_config("Qwen3-0.6B", num_hidden_layers=1))
    layer = _te_wrapped_layer(dims, r=4)
    result = classify_model(layer, dims)
    assert result and all(c.ok for c in result), [c.problem for c in result if not c.ok]
    norms = {c.name: c.role.value for c in result if c.name.endswith("layer_norm_weight")}
    assert len(norms) == 2 and set(norms.values()) == {"replicated"}, norms
    params = dict(layer.named_parameters())
    merged = MergedLoRA(params, dims, alpha=8, rank=4)
    L = "decoder.layers.0."
    for mod in ("self_attention.linear_qkv", "mlp.linear_fc1"):
        assert merged.served[L + mod + ".layer_norm_weight"] is params[L + mod + ".to_wrap.layer_norm_weight"]
    w, a, b = (params[L + "mlp.linear_fc1" + s] for s in (".to_wrap.weight", ".adapter.linear_in.weight",
                                                          ".adapter.linear_out.weight"))
    assert torch.equal(merged.served[L + "mlp.linear_fc1.weight"], w + 2 * (b @ a))
    assert not any(".to_wrap." in n or ".adapter." in n for n in merged.served)
