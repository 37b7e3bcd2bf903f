"""gpt-oss (issue 24): fused experts (one ``gate_up_proj`` [E, h, 2f] per layer with gate / up
interleaved, ``down_proj`` [E, f, h], biases), attention sinks, router bias.

Oracles, none of them megarefit's planner: transformers' own GptOssForCausalLM (names, shapes,
logits), an independent cat / strided-slice reference of the Megatron layout
(``tests/reference.py``), and real Megatron-Core on CPU (``test_cli.py``'s gpt-oss demo).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_cases import moe_config
from reference import gpt_oss_reference_shards

from megarefit import ModelDims, SourceLayout
from megarefit.errors import LayoutError
from megarefit.planner import plan_megatron_to_hf
from megarefit.quant import Fp8Format
from megarefit.quant.fp8 import UnsupportedQuantizationError
from megarefit.quant.planning import plan_fp8
from megarefit.translate import hf_to_megatron, megatron_to_hf

transformers = pytest.importorskip("transformers")


def tiny(**extra) -> dict:
    """gpt-oss-120b's config, shrunk (YaRN, sliding windows and swiglu_limit kept)."""
    cfg = moe_config("gpt-oss-120b", **extra)
    cfg["layer_types"] = (cfg["layer_types"] * cfg["num_hidden_layers"])[:cfg["num_hidden_layers"]]
    return cfg


def hf_model(cfg: dict, seed: int = 0):
    """transformers' GptOssForCausalLM with random weights (biases, sinks and norms too)."""
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**cfg)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 and p.shape[0] == cfg["hidden_size"] else 0.0))
    return model


@pytest.mark.parametrize("tp, pp, ep", [(1, 1, 1), (2, 1, 2), (2, 2, 4)])
def test_targets_are_what_transformers_holds(tp, pp, ep):
    """The export's HF targets are exactly GptOssForCausalLM's state dict: names, stored shapes
    (the fused tensors are planned through views: gate_up_proj [E, h, 2f] as [E, h, f, 2])."""
    cfg = tiny(num_hidden_layers=2 * pp)
    state = hf_model(cfg).state_dict()
    dims = ModelDims.from_hf_config(cfg)
    plan = plan_megatron_to_hf(dims, SourceLayout.build(tp=tp, pp=pp, ep=ep, etp=1, num_layers=dims.num_layers,
                                                        padded_vocab_size=dims.padded_vocab_size(tp)))
    stored = {ref.name: meta.storage_shape or meta.shape for ref, meta in plan.targets.items()}
    assert stored == {k: tuple(v.shape) for k, v in state.items()}
    views = {ref.name.rsplit(".", 1)[-1]: meta.shape for ref, meta in plan.targets.items() if meta.storage_shape}
    e, h, f = 4, cfg["hidden_size"], cfg["intermediate_size"]
    assert views == {"gate_up_proj": (e, h, f, 2), "gate_up_proj_bias": (e, f, 2)}
    fused = [op for op in plan.ops if op.dst.name.endswith(("gate_up_proj", "down_proj"))]
    assert len(fused) == 3 * e * dims.num_layers and all(op.transpose for op in fused)  # gate, up, down per expert


@settings(max_examples=25, deadline=None)
@given(tp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]), ep=st.sampled_from([1, 2, 4]),
       experts_per_ep=st.integers(1, 2), ffn=st.sampled_from([8, 24, 32]), layout=st.sampled_from(
           ["sequential", "te_grouped"]), seed=st.integers(0, 2**16))
def test_layout_matches_the_reference_and_round_trips(tp, pp, ep, experts_per_ep, ffn, layout, seed):
    """HF -> Megatron equals the independent reference tensor for tensor (gate = gate_up[..., ::2]^T,
    up = gate_up[..., 1::2]^T, whole experts per ep rank, sinks split by heads), and Megatron -> HF
    gives back every HF tensor bit for bit."""
    cfg = tiny(num_hidden_layers=2 * pp, num_local_experts=ep * experts_per_ep, intermediate_size=ffn)
    g = torch.Generator().manual_seed(seed)
    hf = {k: torch.randn(v.shape, generator=g) for k, v in hf_model(cfg).state_dict().items()}
    shards = hf_to_megatron(hf, cfg, tp=tp, pp=pp, ep=ep, expert_layout=layout)
    ref = gpt_oss_reference_shards(hf, cfg, list(shards), tp=tp, pp=pp, ep=ep, layout=layout)
    assert {r: set(p) for r, p in shards.items()} == {r: set(p) for r, p in ref.items()}
    for rank, params in ref.items():
        for name, tensor in params.items():
            assert torch.equal(shards[rank][name], tensor), (rank, name)
    back = megatron_to_hf(shards, cfg, tp=tp, pp=pp, ep=ep)
    assert back.keys() == hf.keys()
    for name in hf:
        assert torch.equal(back[name], hf[name]), name


def test_transformers_logits_survive_the_round_trip():
    """A random GptOssForCausalLM (sliding windows of 4 on 12 tokens, YaRN, sinks) -> Megatron shards
    (tp 2, pp 2, ep 2) -> HF tensors -> a fresh GptOssForCausalLM: the same logits, exactly."""
    cfg = tiny(num_hidden_layers=4)
    model = hf_model(cfg, seed=3)
    shards = hf_to_megatron(model.state_dict(), cfg, tp=2, pp=2, ep=2)
    again = transformers.GptOssForCausalLM(transformers.GptOssConfig(**cfg)).eval()
    missing, unexpected = again.load_state_dict(megatron_to_hf(shards, cfg, tp=2, pp=2, ep=2), strict=True)
    assert not missing and not unexpected
    tokens = torch.randint(0, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, model(tokens).logits)


def test_what_megatron_cannot_build_or_vllm_does_not_serve_is_refused():
    cfg = tiny()
    dims = ModelDims.from_hf_config(cfg)
    with pytest.raises(LayoutError, match=r"Megatron-Core supports only at expert_tensor_parallel_size 1.*etp=2"):
        dims.check_layout(2, 1, 2, 2)
    assert dims.default_etp(4) == 1  # what every default resolves to
    with pytest.raises(LayoutError, match=r"no legacy_grouped layout in Megatron-Core; use one of \['sequential', "):
        plan_megatron_to_hf(dims, SourceLayout.build(tp=1, pp=1, num_layers=dims.num_layers, etp=1,
                                                     padded_vocab_size=dims.padded_vocab_size(1),
                                                     expert_layout="legacy_grouped"))
    plan = plan_megatron_to_hf(dims, SourceLayout.build(tp=1, pp=1, num_layers=dims.num_layers, etp=1,
                                                        padded_vocab_size=dims.padded_vocab_size(1)))
    with pytest.raises(UnsupportedQuantizationError, match=r"quantization='none'"):
        plan_fp8(plan, Fp8Format())
    with pytest.raises(UnsupportedQuantizationError, match=r"'mxfp4'.*quantization='none'"):
        Fp8Format.from_hf_config({"quantization_config": {"quant_method": "mxfp4"}})
