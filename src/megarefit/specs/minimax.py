"""MiniMax-M2 (and M2.5 / M2.7, ``MiniMaxM2ForCausalLM``): GQA attention whose q / k RMSNorms run
over a token's whole query / key (all heads at once), every layer a MoE with sigmoid routing and a
score-correction bias, Mixtral's expert names.

Megatron-Core builds it as Megatron-Bridge 0.6's ``MiniMaxM2Bridge`` does: a ``GPTModel`` whose
``q_layernorm`` / ``k_layernorm`` are Bridge's full-dimension norms (``FullDimQNorm`` /
``FullDimKNorm``, through Megatron-Core's ``qk_layernorm`` submodules), split over TP by heads::

    Megatron decoder.layers.{layer}.               HF model.layers.{layer}.             TP split
    self_attention.q_layernorm.weight [heads*d/tp] -> self_attn.q_norm.weight [heads*d]   column: rank r's heads
    self_attention.k_layernorm.weight [G*d/tp]     -> self_attn.k_norm.weight [G*d]       column: rank r's query groups
    mlp.router.weight                              -> block_sparse_moe.gate.weight
    mlp.router.expert_bias                         -> block_sparse_moe.e_score_correction_bias  (fp32)
    mlp.experts...linear_fc1 [gate; up]            -> block_sparse_moe.experts.{e}.w1 (gate), w3 (up)
    mlp.experts...linear_fc2                       -> block_sparse_moe.experts.{e}.w2

(d = head_dim, G = num_key_value_heads.) Megatron-Core also trains with tp > G, each K-norm shard
then replicated over tp / G ranks (Bridge's ``_get_k_norm_layout``): megarefit refuses that layout
(:meth:`~megarefit.layout.dims.ModelDims.check_layout`). The checkpoints' MTP modules
(``use_mtp``, ``num_mtp_modules``; HF layers ``num_hidden_layers + i``) are not planned: Bridge maps
none and vLLM's target model drops them. ``rotary_dim`` (RoPE on part of each head) changes no weight.
"""

from megarefit.specs import gpt
from megarefit.specs.moe import moe_rows
from megarefit.specs.table import Condition, FamilySpec, ParamSpec, Role

_L = "decoder.layers.{layer}.self_attention."
_ATTN = "model.layers.{layer}.self_attn."

FULL_QK_NORM = (  # one norm over all heads: split over tp as the heads are
    ParamSpec(_L + "q_layernorm.weight", Role.COLUMN, (_ATTN + "q_norm.weight",), ("q",),
              requires=frozenset({Condition.QK_NORM})),
    ParamSpec(_L + "k_layernorm.weight", Role.COLUMN, (_ATTN + "k_norm.weight",), ("kv",),
              requires=frozenset({Condition.QK_NORM})),
)

MINIMAX_M2 = FamilySpec(
    name="minimax_m2",
    architectures=("MiniMaxM2ForCausalLM",),
    model_types=("minimax_m2",),
    entries=gpt.EMBEDDING + gpt.ATTENTION + FULL_QK_NORM + gpt.OUTPUT
    + moe_rows(block="block_sparse_moe", expert_proj=("w1", "w3", "w2"), expert_bias="e_score_correction_bias"),
    qkv_bias="attention_bias",
    proj_bias="attention_bias",
    qk_norm="use_qk_norm",
    experts_key="num_local_experts",
    moe_ffn_key="intermediate_size",
    router_bias=("use_routing_bias", True),
    router_score="sigmoid",  # top-k weights always renormalised (HF MiniMaxM2)
    config_requires=(("qk_norm_type", "per_layer"),),
)
