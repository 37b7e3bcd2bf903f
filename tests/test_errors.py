"""Bad input raises a clear error naming the tensor, the rank and expected vs actual."""

from __future__ import annotations

import pytest
import torch

import megarefit
from megarefit.errors import (
    AmbiguousParameterError, LayoutError, MissingParameterError, ShapeMismatchError, SpecTableError,
    UnexpectedParameterError, UnknownParameterError, UnsupportedModelError,
)
from megarefit.specs import FamilySpec, ParamSpec, Role, family_for_config
from reference import reference_hf_state, reference_shards


@pytest.fixture
def qwen3(config):
    cfg = config("Qwen3-0.6B")
    hf = reference_hf_state(cfg, "qwen3")
    return cfg, hf, reference_shards(hf, cfg, tp=2, pp=2)


def test_unknown_parameter_name(qwen3):
    cfg, _, shards = qwen3
    shards[(1, 0, 0)]["decoder.layers.0.self_attention.linear_qkv.weight_scale"] = torch.zeros(1)
    with pytest.raises(UnknownParameterError, match=r"linear_qkv\.weight_scale.*rank \(tp=1, pp=0, ep=0\)"):
        megarefit.megatron_to_hf(shards, cfg, tp=2, pp=2)


def test_missing_rank(qwen3):
    cfg, _, shards = qwen3
    del shards[(1, 1, 0)]
    with pytest.raises(LayoutError, match=r"missing \[\(1, 1, 0\)\]"):
        megarefit.megatron_to_hf(shards, cfg, tp=2, pp=2)


def test_wrong_tp_argument(qwen3):
    cfg, _, shards = qwen3
    with pytest.raises(LayoutError, match=r"unexpected \[\(1, 0, 0\), \(1, 1, 0\)\].*wrong tp"):
        megarefit.megatron_to_hf(shards, cfg, tp=1, pp=2)


def test_wrong_pp_argument_layers_on_wrong_stage(qwen3):
    cfg, hf, _ = qwen3
    shards = reference_shards(hf, cfg, tp=1, pp=2)
    merged = {(0, 0, 0): shards[(0, 0, 0)]}
    with pytest.raises(MissingParameterError, match=r"rank \(tp=0, pp=0, ep=0\) lacks .*decoder\.layers\.2\."):
        megarefit.megatron_to_hf(merged, cfg, tp=1, pp=1)


def test_tp_that_does_not_divide_groups(config):
    """Megatron-Core splits query groups over tp when one divides the other (a part of a group per
    rank when tp > groups); anything else is refused, naming both."""
    cfg = config("Qwen3-0.6B", num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(LayoutError, match="num_query_groups=3 neither a multiple nor a divisor of tp=2"):
        megarefit.hf_to_megatron(reference_hf_state(cfg, "qwen3"), cfg, tp=2)


def test_shape_mismatch_names_tensor_rank_expected_actual(qwen3):
    cfg, _, shards = qwen3
    name = "decoder.layers.1.mlp.linear_fc2.weight"
    shards[(0, 1, 0)][name] = torch.zeros(64, 96)  # full width instead of the tp=2 half
    with pytest.raises(ShapeMismatchError, match=rf"{name} @ rank \(tp=0, pp=1, ep=0\): expected shape \(64, 48\).*got \(64, 96\)"):
        megarefit.megatron_to_hf(shards, cfg, tp=2, pp=2)


def test_shape_mismatch_against_config(qwen3):
    cfg, _, shards = qwen3
    with pytest.raises(ShapeMismatchError, match=r"embedding\.word_embeddings\.weight @ rank \(tp=0, pp=0, ep=0\): expected shape \(128, 80\).*got \(128, 64\)"):
        megarefit.megatron_to_hf(shards, cfg | {"hidden_size": 80}, tp=2, pp=2)


def test_missing_parameter(qwen3):
    cfg, _, shards = qwen3
    del shards[(0, 1, 0)]["decoder.layers.0.self_attention.k_layernorm.weight"]
    with pytest.raises(MissingParameterError, match=r"rank \(tp=0, pp=1, ep=0\) lacks .*k_layernorm"):
        megarefit.megatron_to_hf(shards, cfg, tp=2, pp=2)


def test_output_layer_on_first_stage_is_unexpected(qwen3):
    cfg, _, shards = qwen3
    shards[(0, 0, 0)]["decoder.final_layernorm.weight"] = torch.zeros(64)
    with pytest.raises(UnexpectedParameterError, match=r"rank \(tp=0, pp=0, ep=0\).*final_layernorm"):
        megarefit.megatron_to_hf(shards, cfg, tp=2, pp=2)


def test_mixed_dtypes(qwen3):
    cfg, _, shards = qwen3
    shards[(1, 0, 0)]["decoder.layers.0.input_layernorm.weight"] = torch.zeros(64, dtype=torch.bfloat16)
    with pytest.raises(ShapeMismatchError, match=r"decoder\.layers\.0\.input_layernorm\.weight @ rank "
                                                 r"\(tp=1, pp=0, ep=0\): expected dtype float32, got bfloat16"):
        megarefit.megatron_to_hf(shards, cfg, tp=2, pp=2)


def test_mixed_norm_spellings(qwen3):
    cfg, _, shards = qwen3
    s = shards[(0, 0, 0)]
    s["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"] = s.pop("decoder.layers.0.input_layernorm.weight")
    with pytest.raises(UnexpectedParameterError, match=r"mix local-spec and Transformer-Engine-spec names: "
                                                       r"'decoder\.layers\.\d\.\S+' on rank \(tp=\d"):
        megarefit.megatron_to_hf(shards, cfg, tp=2, pp=2)


def test_hf_state_missing_and_unexpected(config):
    cfg = config("Llama-3.1-8B")
    hf = reference_hf_state(cfg, "llama")
    with pytest.raises(MissingParameterError, match="lm_head.weight"):
        megarefit.hf_to_megatron({k: v for k, v in hf.items() if k != "lm_head.weight"}, cfg)
    with pytest.raises(UnexpectedParameterError, match=r"q_norm"):
        megarefit.hf_to_megatron(hf | {"model.layers.0.self_attn.q_norm.weight": torch.zeros(16)}, cfg)
    with pytest.raises(ShapeMismatchError, match=r"model\.layers\.3\.mlp\.up_proj\.weight: expected shape \(96, 64\)"):
        megarefit.hf_to_megatron(hf | {"model.layers.3.mlp.up_proj.weight": torch.zeros(95, 64)}, cfg)


def test_unsupported_architecture():
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        family_for_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    # a supported model_type with another head is refused, not planned as the causal LM
    with pytest.raises(UnsupportedModelError, match="LlamaForSequenceClassification.*score head"):
        family_for_config({"architectures": ["LlamaForSequenceClassification"], "model_type": "llama"})
    assert family_for_config({"model_type": "llama"}).name == "llama"  # no architectures: model_type decides


@pytest.mark.parametrize(("key", "value", "message"), [
    ("num_key_value_heads", 0, "num_key_value_heads must be a positive divisor of num_attention_heads"),
    ("num_key_value_heads", 3, "num_key_value_heads must be a positive divisor"),
    ("hidden_size", -64, "hidden_size must be a positive integer, got -64"),
    ("num_hidden_layers", 0, "num_hidden_layers must be a positive integer"),
    ("vocab_size", "128", "vocab_size must be a positive integer, got '128'"),
])
def test_config_sizes_that_cannot_be_translated_are_refused(config, key, value, message):
    from megarefit.errors import MegarefitError
    from megarefit.layout.dims import ModelDims

    cfg = dict(config("Llama-3.1-8B"))
    assert ModelDims.from_hf_config(cfg).num_query_groups == cfg["num_key_value_heads"]
    with pytest.raises(MegarefitError, match=message):
        ModelDims.from_hf_config(cfg | {key: value})


def test_spec_table_errors():
    with pytest.raises(SpecTableError, match="unknown placeholder"):
        ParamSpec("decoder.layers.{lay}.x.weight", Role.COLUMN, ("y",), ("hidden",))
    with pytest.raises(SpecTableError, match="needs 3 HF names"):
        ParamSpec("a.weight", Role.QKV, ("q",), ("qkv", "hidden"))
    with pytest.raises(SpecTableError, match="pack needs the replicated role"):
        ParamSpec("a.alpha", Role.COLUMN, ("scale",), ("one",), pack=(0, 3))
    with pytest.raises(SpecTableError, match="pack needs the replicated role"):
        ParamSpec("a.alpha", Role.REPLICATED, ("scale",), ("one",), pack=(3, 3))
    with pytest.raises(SpecTableError, match="unquantized must index its HF names"):
        ParamSpec("a.weight", Role.COLUMN, ("x",), ("hidden", "hidden"), unquantized=(1,))
    with pytest.raises(SpecTableError, match="layers needs a layer row"):
        ParamSpec("a.weight", Role.COLUMN, ("x",), ("hidden", "hidden"), layers="csa")
    row = ParamSpec("a.weight", Role.COLUMN, ("x",), ("hidden",))
    with pytest.raises(SpecTableError, match="active together"):
        FamilySpec("f", ("A",), ("a",), (row, ParamSpec("a.weight", Role.ROW, ("y",), ("hidden", "hidden"))))


def test_ambiguous_match_is_reported():
    # Two rows whose patterns differ but match the same name: caught at match time.
    fam = FamilySpec("f", ("A",), ("a",), (
        ParamSpec("decoder.layers.{layer}.w", Role.COLUMN, ("h.{layer}.a",), ("hidden",)),
        ParamSpec("decoder.layers.0.w", Role.COLUMN, ("h.b",), ("hidden",)),
    ))
    with pytest.raises(AmbiguousParameterError, match=r"decoder\.layers\.0\.w.*2 rows"):
        fam.match("decoder.layers.0.w", frozenset())


def test_mixed_expert_layouts_name_a_tensor():
    from reference import moe_hf_state, moe_reference_shards

    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 8,
           "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 20,
           "num_local_experts": 2, "intermediate_size": 4, "tie_word_embeddings": False}
    hf = moe_hf_state(cfg, "mixtral")
    seq = moe_reference_shards(hf, cfg, "mixtral", tp=1, pp=1, ep=1, etp=1, layout="sequential")[(0, 0, 0)]
    grouped = moe_reference_shards(hf, cfg, "mixtral", tp=1, pp=1, ep=1, etp=1, layout="te_grouped")[(0, 0, 0)]
    mixed = {k: v for k, v in seq.items() if "layers.1." not in k} | {k: v for k, v in grouped.items()
                                                                     if "layers.1." in k}
    with pytest.raises(UnexpectedParameterError, match=r"mix expert layouts: .*layers\.1\..*on rank \(tp=0, pp=0, "
                                                       r"ep=0\) is te_grouped"):
        megarefit.megatron_to_hf({(0, 0, 0): mixed}, cfg)
