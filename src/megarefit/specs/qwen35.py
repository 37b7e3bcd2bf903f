"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next: gated DeltaNet (GDN) layers and gated full attention, one mixer
per layer from the config's ``layer_types`` (``linear_attention`` / ``full_attention``; by default every
``full_attention_interval``-th layer is full attention), each followed by a dense or MoE MLP.

Megatron-Core builds them as Megatron-Bridge does: ``GPTModel`` with the experimental attention
variant ``gated_delta_net`` (``linear_attention_freq``), ``attention_output_gate=True``,
``qk_layernorm=True`` and ``layernorm_zero_centered_gamma=True`` (norms store w - 1)::

    Megatron decoder.layers.{layer}.             HF model.layers.{layer}.      TP split
    GDN  self_attention.in_proj.weight             ->  linear_attn.in_proj_qkv  [Q; K; V]   segmented: rank r
           [Q; K; V; Z; b; a]                          linear_attn.in_proj_z / _b / _a      [Q_r; K_r; V_r; Z_r; b_r; a_r]
         self_attention.conv1d.weight [Q; K; V]    ->  linear_attn.conv1d.weight            segmented [Q_r; K_r; V_r]
         self_attention.A_log, dt_bias             ->  linear_attn.A_log, dt_bias           by value heads
         self_attention.out_norm.weight  (w - 1)   ->  linear_attn.norm.weight  (w)          replicated, value step +1
         self_attention.out_proj.weight            ->  linear_attn.out_proj.weight          columns
    attn self_attention.linear_qkv.weight          ->  self_attn.q_proj (per head [q; gate]), k_proj, v_proj
           per group [q heads; gate heads; k; v]                                           query groups (or a part of one)
         self_attention.q_layernorm / k_layernorm  ->  self_attn.q_norm / k_norm
         self_attention.linear_proj.weight         ->  self_attn.o_proj.weight
    norm input_layernorm (local spec) / in_proj.layer_norm_weight, linear_qkv.layer_norm_weight (TE spec)
                                                   ->  input_layernorm.weight
    MLP  as Qwen3 (dense) / Qwen3-MoE, plus mlp.shared_experts.gate_weight [1, hidden] -> mlp.shared_expert_gate.weight

Norms: HF Qwen3.5's RMSNorms compute ``(1 + w)`` and store w as Megatron's zero-centered norms do,
so they copy; the GDN's gated norm computes ``w`` (HF stores w, Megatron w - 1): ``value="plus_one"``.

The vision-language checkpoints (``Qwen3_5*ForConditionalGeneration``) keep the language model
under ``model.language_model.`` beside a vision tower (``model.visual.``) megarefit does not move:
their families plan the language model only, dims from ``text_config``. The checkpoints' MTP layer
(``mtp.*``, ``mtp_num_hidden_layers``) is not planned (vLLM's target model skips it).
Qwen3-Next (``Qwen3NextForCausalLM``) is Qwen3.5-MoE's text model whose checkpoints pack the GDN
input projections per key head g: ``in_proj_qkvz`` [q_g; k_g; v_g; z_g], ``in_proj_ba`` [b_g; a_g]
(``ParamSpec.segment_groups``; Megatron-Bridge's ``merge_gdn_linear_weights``).
Checked against Megatron-Bridge 0.6's ``Qwen35MoEBridge`` (``GDNLinearMappingSeparate``,
``GDNConv1dMapping``, ``RMSNorm2ZeroCenteredRMSNormMapping``, the gated ``QKVMapping``).
"""

from __future__ import annotations

import dataclasses

from megarefit.specs import gpt
from megarefit.specs.moe import moe_rows
from megarefit.specs.table import Condition, FamilySpec, ParamSpec, Role

_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."
_G, _A = _H + "linear_attn.", _H + "self_attn."
R = Role
C = Condition
_NORM = (_H + "input_layernorm.weight",)


_IN_PROJ = ("gdn_qk", "gdn_qk", "gdn_v", "gdn_v", "gdn_heads", "gdn_heads")  # [Q; K; V; Z; b; a]


def _in_proj(packed: bool) -> ParamSpec:
    """The GDN ``in_proj``: Qwen3.5's four HF tensors [Q; K; V], Z, b, a, or (``packed``) Qwen3-Next's
    two, packed per key head g: ``in_proj_qkvz`` [q_g; k_g; v_g; z_g], ``in_proj_ba`` [b_g; a_g]. Block FP8
    keeps b / a in the model dtype, as vLLM builds ``in_proj_ba`` and Qwen's FP8 checkpoints store it."""
    name, shape = _L + "self_attention.in_proj.weight", ("gdn_in", "hidden")
    if packed:
        return ParamSpec(name, R.SEGMENTED, (_G + "in_proj_qkvz.weight", _G + "in_proj_ba.weight"), shape,
                         segments=_IN_PROJ, segment_hf=(0, 0, 0, 0, 1, 1), segment_groups="gdn_kheads", mixer="gdn",
                         unquantized=(1,))
    return ParamSpec(name, R.SEGMENTED, tuple(_G + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")), shape,
                     segments=_IN_PROJ, segment_hf=(0, 0, 0, 1, 2, 3), mixer="gdn", unquantized=(2, 3))


def _gdn_rows(packed: bool = False) -> tuple[ParamSpec, ...]:
    g = "gdn"
    return (
        ParamSpec(_L + "self_attention.in_proj.layer_norm_weight", R.REPLICATED, _NORM, ("hidden",), spelling="te",
                  mixer=g),
        _in_proj(packed),
        ParamSpec(_L + "self_attention.conv1d.weight", R.SEGMENTED, (_G + "conv1d.weight",),
                  ("gdn_conv", "one", "conv_kernel"), segments=("gdn_qk", "gdn_qk", "gdn_v"), linear=False, mixer=g),
        *(ParamSpec(_L + f"self_attention.{p}", R.COLUMN, (_G + p,), ("gdn_heads",), mixer=g)
          for p in ("A_log", "dt_bias")),
        ParamSpec(_L + "self_attention.out_norm.weight", R.REPLICATED, (_G + "norm.weight",), ("gdn_dv",),
                  mixer=g, value="plus_one"),
        ParamSpec(_L + "self_attention.out_proj.weight", R.ROW, (_G + "out_proj.weight",), ("hidden", "gdn_v"),
                  mixer=g),
    )


def _attention_rows() -> tuple[ParamSpec, ...]:
    a = "attention"
    return (
        ParamSpec(_L + "input_layernorm.weight", R.REPLICATED, _NORM, ("hidden",), spelling="local"),
        ParamSpec(_L + "self_attention.linear_qkv.layer_norm_weight", R.REPLICATED, _NORM, ("hidden",),
                  spelling="te", mixer=a),
        ParamSpec(_L + "self_attention.linear_qkv.weight", R.GATED_QKV,
                  (_A + "q_proj.weight", _A + "k_proj.weight", _A + "v_proj.weight"), ("qkvg", "hidden"), mixer=a),
        ParamSpec(_L + "self_attention.q_layernorm.weight", R.REPLICATED, (_A + "q_norm.weight",), ("head_dim",),
                  mixer=a),
        ParamSpec(_L + "self_attention.k_layernorm.weight", R.REPLICATED, (_A + "k_norm.weight",), ("head_dim",),
                  mixer=a),
        ParamSpec(_L + "self_attention.linear_proj.weight", R.ROW, (_A + "o_proj.weight",), ("hidden", "q"),
                  mixer=a),
    )


_SHARED_GATE = ParamSpec(_L + "mlp.shared_experts.gate_weight", R.REPLICATED, (_H + "mlp.shared_expert_gate.weight",),
                         ("one", "hidden"), requires=frozenset({C.SHARED_EXPERTS}), layer_kind="moe", linear=False)
_DENSE = gpt.EMBEDDING + _gdn_rows() + _attention_rows() + gpt.GATED_MLP + gpt.OUTPUT
_MOE = _DENSE + moe_rows(shared="shared_expert") + (_SHARED_GATE,)
_NEXT = (gpt.EMBEDDING + _gdn_rows(packed=True) + _attention_rows() + gpt.GATED_MLP + gpt.OUTPUT
         + moe_rows(shared="shared_expert") + (_SHARED_GATE,))


def _language_model(rows: tuple[ParamSpec, ...]) -> tuple[ParamSpec, ...]:
    """``rows`` with HF names under ``model.language_model.`` (the vision-language checkpoints)."""
    def moved(name: str) -> str:
        return "model.language_model." + name[len("model."):] if name.startswith("model.") else name
    return tuple(dataclasses.replace(r, hf=tuple(moved(h) for h in r.hf)) for r in rows)


# HF's norms compute (1 + w) (the GDN's gated out_norm w): Megatron's zero-centered weights are read as they are
_MEGATRON = (("layernorm_zero_centered_gamma", (True,)), ("attention_output_gate", (True,)),
             ("moe_shared_expert_gate", (True,)))
_COMMON = dict(qk_norm=True, gdn=True, tie_word_embeddings_default=False, megatron_config=_MEGATRON)
# every Qwen3.5-MoE layer is MoE: transformers and vLLM read no mlp_only_layers / decoder_sparse_step
# (a non-empty mlp_only_layers is refused, see hf_dims.gdn_dims)
_MOE_KEYS = dict(experts_key="num_experts", moe_ffn_key="moe_intermediate_size",
                 shared_ffn_key="shared_expert_intermediate_size")

QWEN3_5 = FamilySpec(name="qwen3_5", architectures=("Qwen3_5ForCausalLM",), model_types=("qwen3_5_text",),
                     entries=_DENSE, **_COMMON)  # type: ignore[arg-type]
QWEN3_5_VL = FamilySpec(name="qwen3_5_vl", architectures=("Qwen3_5ForConditionalGeneration",),
                        model_types=("qwen3_5",), entries=_language_model(_DENSE), text_config=True,
                        **_COMMON)  # type: ignore[arg-type]
QWEN3_5_MOE = FamilySpec(name="qwen3_5_moe", architectures=("Qwen3_5MoeForCausalLM",),
                         model_types=("qwen3_5_moe_text",), entries=_MOE, **_COMMON, **_MOE_KEYS)  # type: ignore[arg-type]
QWEN3_5_MOE_VL = FamilySpec(name="qwen3_5_moe_vl", architectures=("Qwen3_5MoeForConditionalGeneration",),
                            model_types=("qwen3_5_moe",), entries=_language_model(_MOE), text_config=True,
                            **_COMMON, **_MOE_KEYS)  # type: ignore[arg-type]

QWEN3_NEXT = FamilySpec(name="qwen3_next", architectures=("Qwen3NextForCausalLM",), model_types=("qwen3_next",),
                        entries=_NEXT, router_renorm=("norm_topk_prob", True), **_COMMON,
                        **_MOE_KEYS)  # type: ignore[arg-type]

__all__ = ["QWEN3_5", "QWEN3_5_MOE", "QWEN3_5_MOE_VL", "QWEN3_5_VL", "QWEN3_NEXT"]
