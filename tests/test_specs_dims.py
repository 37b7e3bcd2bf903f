"""Family selection, ModelDims from real configs (dict and PretrainedConfig), spec-table lookups."""

from __future__ import annotations

import pytest
import torch

import megarefit
from conftest import real_config
from megarefit import ModelDims
from megarefit.specs import Condition, Role, family_for_config
from reference import reference_hf_state

transformers = pytest.importorskip("transformers")

# Values read off the real checkpoints' configs (and, for head_dim, the published weight shapes).
KNOWN = {
    "Qwen3-0.6B": ("qwen3", 28, 1024, 16, 8, 128, 3072, 151936, True),
    "Qwen3-8B": ("qwen3", 36, 4096, 32, 8, 128, 12288, 151936, False),
    "Llama-3.1-8B": ("llama", 32, 4096, 32, 8, 128, 14336, 128256, False),
    "Llama-3.1-405B": ("llama", 126, 16384, 128, 8, 128, 53248, 128256, False),
    "Mistral-7B-v0.3": ("llama", 32, 4096, 32, 8, 128, 14336, 32768, False),
    "Qwen2.5-0.5B": ("qwen2", 24, 896, 14, 2, 64, 4864, 151936, True),
}


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_dims_from_dict_and_pretrained_config(name):
    cfg = real_config(name)
    d = ModelDims.from_hf_config(cfg)
    got = (d.family, d.num_layers, d.hidden_size, d.num_attention_heads, d.num_query_groups, d.head_dim,
           d.ffn_hidden_size, d.vocab_size, d.tie_word_embeddings)
    assert got == KNOWN[name]
    obj = transformers.AutoConfig.for_model(**cfg)
    assert ModelDims.from_hf_config(obj) == d
    assert d.qkv_bias == (d.family == "qwen2") and not d.proj_bias and not d.mlp_bias


def test_padded_vocab_follows_megatron():
    llama = ModelDims.from_hf_config(real_config("Llama-3.1-8B"))
    assert llama.padded_vocab_size(1) == 128256  # 128256 = 1002 * 128
    assert llama.padded_vocab_size(8) == 129024  # next multiple of 1024
    qwen = ModelDims.from_hf_config(real_config("Qwen3-0.6B"))
    assert qwen.padded_vocab_size(8) == 152576 and qwen.padded_vocab_size(2, divisible_by=64) == 151936


def test_family_selection():
    assert family_for_config({"architectures": ["MistralForCausalLM"]}).name == "llama"
    assert family_for_config({"model_type": "qwen2"}).name == "qwen2"  # no architectures: model_type decides
    assert family_for_config({"architectures": ["Qwen3ForCausalLM"], "model_type": "llama"}).name == "qwen3"


def test_table_roles_for_both_norm_spellings():
    fam = family_for_config(real_config("Qwen3-8B"))
    conds = frozenset({Condition.UNTIED, Condition.QK_NORM})
    for name in ("decoder.layers.3.input_layernorm.weight", "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight",
                 "decoder.layers.3.mlp.linear_fc1.layer_norm_weight", "decoder.layers.3.self_attention.q_layernorm.weight"):
        m = fam.match(name, conds)
        assert m.spec.role is Role.REPLICATED and m.layer == 3
    assert fam.match("decoder.layers.12.mlp.linear_fc1.weight", conds).spec.hf_names(40) == (
        "model.layers.40.mlp.gate_proj.weight", "model.layers.40.mlp.up_proj.weight")
    assert fam.match("output_layer.weight", conds).spec.hf == ("lm_head.weight",)
    tied = fam.match("output_layer.weight", frozenset({Condition.TIED_COPY})).spec
    assert tied.duplicate and tied.hf == ("model.embed_tokens.weight",)


def test_uneven_pipeline_split_is_inferred(config):
    cfg = config("Llama-3.1-8B", num_hidden_layers=5)
    hf = reference_hf_state(cfg, "llama")
    shards = megarefit.hf_to_megatron(hf, cfg, tp=2, pp=3, first_stage_layers=1, last_stage_layers=2)
    assert {n for n in shards[(0, 0, 0)] if n.startswith("decoder.layers.")} == {
        n for n in shards[(0, 0, 0)] if n.startswith("decoder.layers.0.")}
    assert "decoder.layers.1.mlp.linear_fc2.weight" in shards[(1, 2, 0)]
    back = megarefit.megatron_to_hf(shards, cfg, tp=2, pp=3)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], v) for k, v in hf.items())


def test_legacy_grouped_stored_shape_and_view_are_inverses():
    """The one home of GroupedMLP's storage fact (layout.geometry): the checksum frame reads a
    stored tensor back into the [E_local, a, b] view local_shape stored it from."""
    from megarefit.layout.geometry import grouped_stored_shape, grouped_view_of
    from megarefit.specs import Role

    for role in (Role.GROUPED_EXPERT_FC1, Role.GROUPED_EXPERT_FC2):
        for view in [(1, 8, 6), (4, 16, 12), (3, 5, 7)]:
            assert grouped_view_of(role, grouped_stored_shape(role, view), view[0]) == view
    assert grouped_stored_shape(Role.GROUPED_EXPERT_FC1, (4, 16, 12)) == (16, 48)
    assert grouped_stored_shape(Role.GROUPED_EXPERT_FC2, (4, 6, 16)) == (24, 16)
    assert grouped_view_of(Role.GROUPED_EXPERT_FC1, (16, 50), 4) is None  # not E blocks
    assert grouped_view_of(Role.COLUMN, (16, 48), 4) is None
