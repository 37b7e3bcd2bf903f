"""Nemotron-H / Nemotron-3-Nano (issue 24): Mamba2 mixers (``in_proj`` [z; x; B; C; dt] and
``conv1d`` [x; B; C] split part by part over TP, heads-split ``A_log`` / ``D`` / ``dt_bias``,
grouped gated ``norm``), attention (also tp > query groups: a part of a group per rank, as
Megatron-Core splits it), relu2 MLP and MoE layers with shared experts, one kind per layer.

Oracles: transformers' own ``NemotronHForCausalLM`` (the names and shapes its
``save_pretrained`` writes, its logits), and an independent reference of the Megatron layout in
Megatron-Bridge's scheme (``tests/reference.py``, cat / reshape / chunk).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import hf_checkpoint_state, nemotron_h_reference_shards

from megarefit import ModelDims, SourceLayout
from megarefit.errors import LayoutError, UnsupportedModelError
from megarefit.planner import plan_megatron_to_hf
from megarefit.targets import VllmTarget, vllm_params
from megarefit.translate import hf_to_megatron, megatron_to_hf

transformers = pytest.importorskip("transformers")


def tiny(pattern: str = "M*E-", **extra) -> dict:
    """A CPU-sized Nemotron-H of ``pattern`` (time_step_min tiny: HF's dt clamp never bites)."""
    cfg = dict(architectures=["NemotronHForCausalLM"], model_type="nemotron_h", hidden_size=64,
               num_hidden_layers=len(pattern), hybrid_override_pattern=pattern, mamba_num_heads=8, mamba_head_dim=16,
               n_groups=2, ssm_state_size=8, conv_kernel=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               intermediate_size=96, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               moe_shared_expert_intermediate_size=48, n_shared_experts=1, vocab_size=256, tie_word_embeddings=False,
               use_bias=False, mamba_proj_bias=False, use_conv_bias=True, layer_norm_epsilon=1e-5, time_step_min=1e-9,
               n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, mlp_hidden_act="relu2",
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return cfg | extra


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """What ``save_pretrained`` writes for the tiny config (``backbone.*``, one tensor per expert)."""
    cfg = tiny()
    return cfg, hf_checkpoint_state(cfg, tmp_path_factory.mktemp("nemotron_h"))


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 2), (2, 4)])
def test_targets_are_what_transformers_saves(checkpoint, tp, ep):
    cfg, hf = checkpoint
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=tp, pp=1, ep=ep, etp=1, num_layers=dims.num_layers,
                                padded_vocab_size=dims.padded_vocab_size(tp))
    plan = plan_megatron_to_hf(dims, layout)
    assert {r.name: m.shape for r, m in plan.targets.items()} == {k: tuple(v.shape) for k, v in hf.items()}


@settings(max_examples=20, deadline=None)
@given(tp_groups=st.sampled_from([(1, 2, 2), (2, 2, 2), (2, 2, 1), (4, 4, 2), (4, 4, 1)]),
       ep=st.sampled_from([1, 2, 4]),
       pattern=st.sampled_from(["M*E-", "ME*M", "*EM", "MEME*"]), layout=st.sampled_from(["sequential", "te_grouped"]),
       seed=st.integers(0, 2**16))
def test_layout_matches_the_reference_and_round_trips(tp_groups, ep, pattern, layout, seed):
    """HF -> Megatron equals the Bridge-scheme reference tensor for tensor (Mamba parts split one by
    one, query groups whole or, at tp > groups, split inside a group), and back gives every HF
    tensor bit for bit."""
    tp, mamba_groups, kv = tp_groups
    cfg = tiny(pattern, n_groups=mamba_groups, num_key_value_heads=kv)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**cfg))
    g = torch.Generator().manual_seed(seed)
    hf = {k: torch.randn(v.shape, generator=g) for k, v in _saved_names(model).items()}
    shards = hf_to_megatron(hf, cfg, tp=tp, ep=ep, etp=1, expert_layout=layout)
    ref = nemotron_h_reference_shards(hf, cfg, list(shards), tp=tp, ep=ep, layout=layout)
    assert {r: set(p) for r, p in shards.items()} == {r: set(p) for r, p in ref.items()}
    for rank, params in ref.items():
        for name, tensor in params.items():
            assert torch.equal(shards[rank][name], tensor), (rank, name)
    back = megatron_to_hf(shards, cfg, tp=tp, ep=ep, etp=1)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def _saved_names(model) -> dict[str, torch.Tensor]:
    """The model's tensors under the names ``save_pretrained`` writes (``backbone.``, per expert)."""
    out = {}
    for name, t in model.state_dict().items():
        name = name.replace("model.", "backbone.", 1)
        if name.endswith(("experts.up_proj", "experts.down_proj")):
            for e in range(t.shape[0]):
                out[f"{name.rsplit('.', 1)[0]}.{e}.{name.rsplit('.', 1)[1]}.weight"] = t[e]
        else:
            out[name] = t
    return out


def test_transformers_logits_survive_the_round_trip(checkpoint, tmp_path):
    """transformers' NemotronHForCausalLM (Mamba2 in torch) from the checkpoint -> Megatron shards
    (tp 2, ep 2) -> HF tensors -> from_pretrained: the same logits, exactly."""
    from conftest import hf_model_from

    cfg, hf = checkpoint
    tokens = torch.randint(0, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    original = hf_model_from(hf, cfg, tmp_path / "a")
    shards = hf_to_megatron(hf, cfg, tp=2, ep=2)
    again = hf_model_from(megatron_to_hf(shards, cfg, tp=2, ep=2), cfg, tmp_path / "b")
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, original(tokens).logits)


def test_what_megatron_cannot_build_or_is_not_built_yet_is_refused():
    dims = ModelDims.from_hf_config(tiny())
    with pytest.raises(LayoutError, match=r"n_groups\)=2 must divide over tp=4"):
        dims.check_layout(4, 1, 1, 1)
    with pytest.raises(UnsupportedModelError, match="Mamba projections with biases"):
        ModelDims.from_hf_config(tiny(mamba_proj_bias=True))
    with pytest.raises(UnsupportedModelError, match=r"A = -exp\(A_log\)"):
        vllm_params(dims, VllmTarget(1, 0))
