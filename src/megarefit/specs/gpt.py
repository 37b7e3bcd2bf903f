"""Rows shared by every dense GPT-style family (Llama, Mistral, Qwen2, Qwen3).

Megatron-Core ``GPTModel`` names on the left, HF ``*ForCausalLM`` on-disk
checkpoint names on the right. Both spellings of the fused norms appear: the
local layer spec (``input_layernorm``, ``pre_mlp_layernorm``) and the
Transformer-Engine spec (``linear_qkv.layer_norm_weight``,
``linear_fc1.layer_norm_weight``).
"""

from __future__ import annotations

from megarefit.specs.table import Condition, ParamSpec, Role

_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."
_ATTN = _H + "self_attn."
_MLP = _H + "mlp."

R = Role
C = Condition

EMBEDDING = (
    ParamSpec("embedding.word_embeddings.weight", R.VOCAB, ("model.embed_tokens.weight",), ("vocab", "hidden")),
)

ATTENTION = (
    ParamSpec(_L + "input_layernorm.weight", R.REPLICATED, (_H + "input_layernorm.weight",), ("hidden",),
              spelling="local"),
    ParamSpec(_L + "self_attention.linear_qkv.layer_norm_weight", R.REPLICATED, (_H + "input_layernorm.weight",),
              ("hidden",), spelling="te"),
    ParamSpec(_L + "self_attention.linear_qkv.weight", R.QKV,
              (_ATTN + "q_proj.weight", _ATTN + "k_proj.weight", _ATTN + "v_proj.weight"), ("qkv", "hidden")),
    ParamSpec(_L + "self_attention.linear_qkv.bias", R.QKV,
              (_ATTN + "q_proj.bias", _ATTN + "k_proj.bias", _ATTN + "v_proj.bias"), ("qkv",),
              requires=frozenset({C.QKV_BIAS})),
    ParamSpec(_L + "self_attention.linear_proj.weight", R.ROW, (_ATTN + "o_proj.weight",), ("hidden", "q")),
    ParamSpec(_L + "self_attention.linear_proj.bias", R.REPLICATED, (_ATTN + "o_proj.bias",), ("hidden",),
              requires=frozenset({C.PROJ_BIAS})),
)

QK_NORM = (
    ParamSpec(_L + "self_attention.q_layernorm.weight", R.REPLICATED, (_ATTN + "q_norm.weight",), ("head_dim",),
              requires=frozenset({C.QK_NORM})),
    ParamSpec(_L + "self_attention.k_layernorm.weight", R.REPLICATED, (_ATTN + "k_norm.weight",), ("head_dim",),
              requires=frozenset({C.QK_NORM})),
)

GATED_MLP = (  # the MLP of dense layers (every layer of a dense model)
    ParamSpec(_L + "pre_mlp_layernorm.weight", R.REPLICATED, (_H + "post_attention_layernorm.weight",), ("hidden",),
              spelling="local", layer_kind="dense"),
    ParamSpec(_L + "mlp.linear_fc1.layer_norm_weight", R.REPLICATED, (_H + "post_attention_layernorm.weight",),
              ("hidden",), spelling="te", layer_kind="dense"),
    ParamSpec(_L + "mlp.linear_fc1.weight", R.GATED_MLP, (_MLP + "gate_proj.weight", _MLP + "up_proj.weight"),
              ("2ffn", "hidden"), layer_kind="dense"),
    ParamSpec(_L + "mlp.linear_fc1.bias", R.GATED_MLP, (_MLP + "gate_proj.bias", _MLP + "up_proj.bias"), ("2ffn",),
              requires=frozenset({C.MLP_BIAS}), layer_kind="dense"),
    ParamSpec(_L + "mlp.linear_fc2.weight", R.ROW, (_MLP + "down_proj.weight",), ("hidden", "ffn"),
              layer_kind="dense"),
    ParamSpec(_L + "mlp.linear_fc2.bias", R.REPLICATED, (_MLP + "down_proj.bias",), ("hidden",),
              requires=frozenset({C.MLP_BIAS}), layer_kind="dense"),
)

OUTPUT = (
    ParamSpec("decoder.final_layernorm.weight", R.REPLICATED, ("model.norm.weight",), ("hidden",)),
    ParamSpec("output_layer.weight", R.VOCAB, ("lm_head.weight",), ("vocab", "hidden"),
              requires=frozenset({C.UNTIED})),
    # Tied embeddings with PP > 1: the last stage keeps its own copy of the
    # embedding, synced by Megatron. It is not a separate HF tensor.
    ParamSpec("output_layer.weight", R.VOCAB, ("model.embed_tokens.weight",), ("vocab", "hidden"),
              requires=frozenset({C.TIED_COPY}), duplicate=True),
)
