"""DeepSeek-V3 / Kimi-K2 (``DeepseekV3ForCausalLM``): multi-latent attention, dense first
``first_k_dense_replace`` layers, routed + shared experts, an fp32 router score-correction
bias (``noaux_tc``), and GLM-4.5 (``Glm4MoeForCausalLM``): GQA with q/k/v bias, the same
MoE block.

MLA (checked against a real Megatron-Core model; a straight copy, no row permutation)::

    Megatron self_attention.                 HF self_attn.           shape (tp=1)
    linear_q_down_proj.weight            ->  q_a_proj.weight         [q_lora, hidden]
    q_layernorm.weight                   ->  q_a_layernorm.weight    [q_lora]
    linear_q_up_proj.weight              ->  q_b_proj.weight         [heads*(qk_nope+qk_rope), q_lora]
    linear_q_proj.weight                 ->  q_proj.weight           [heads*(qk_nope+qk_rope), hidden]  (no q_lora_rank)
    linear_kv_down_proj.weight           ->  kv_a_proj_with_mqa      [kv_lora+qk_rope, hidden]  ([kv_lora; rope])
    kv_layernorm.weight                  ->  kv_a_layernorm.weight   [kv_lora]
    linear_kv_up_proj.weight             ->  kv_b_proj.weight        [heads*(qk_nope+v), kv_lora]  (per head [k_nope; v])
    linear_proj.weight                   ->  o_proj.weight           [hidden, heads*v]

The local layer spec splits the down-projections over TP (column-parallel); the
Transformer-Engine spec replicates them and fuses the two norms into
``linear_q_up_proj.layer_norm_weight`` / ``linear_kv_up_proj.layer_norm_weight``.
MTP layers (HF ``model.layers.{num_layers + i}``): see :mod:`megarefit.specs.mtp`.

GLM-5 (``GlmMoeDsaForCausalLM``, ``glm_moe_dsa``): DeepSeek-V3's MLA and MoE plus a DSA
lightning indexer in every layer. Megatron-Core 0.16.1 builds it inside the core attention
(``experimental_attention_variant="dsa"``, ``DSAttention.indexer``, ``DSAIndexer``), every
tensor whole on each rank (``parallel_mode="duplicated"``); vLLM keeps it replicated too::

    Megatron self_attention.core_attention.indexer.   HF self_attn.indexer.   shape
    linear_wq_b.weight                            ->  wq_b.weight             [index_heads*index_head_dim, q_lora]  *
    linear_wk.weight                              ->  wk.weight               [index_head_dim, hidden]  *
    k_norm.weight, k_norm.bias (LayerNorm)        ->  k_norm.weight, .bias    [index_head_dim]  *
    linear_weights_proj.weight                    ->  weights_proj.weight     [index_heads, hidden]

(*) rows rotated within each indexer head: Megatron-Core 0.16.1's ``DSAIndexer._apply_rope``
splits a head ``[nope; rope]`` (RoPE on its *last* ``qk_rope_head_dim`` dims), HF's and
vLLM's GLM-5 indexer ``[rope; nope]`` (the *first*). A straight copy (what the bridges do)
makes the served indexer rank tokens differently from the trained one wherever it drops
tokens (``index_topk`` < sequence length: GLM-5 keeps 2048); rotating each head's rows (and
the LayerNorm ``k_norm``'s, which is equivariant to it) makes them the same function, checked
against real Megatron-Core on CPU (``megarefit demo``, top-8 of 16 tokens).

The indexer reads the *normalized* low-rank query (HF ``q_a_layernorm(q_a_proj(x))``), so a
DSA trainer keeps MLA's norms separate (``q_layernorm`` / ``kv_layernorm``, as MBridge's
DeepSeek-V3.2 and GLM-5 bridges map them) and its down-projections whole on every rank
(``TELinear``, ``parallel_mode="duplicated"``), whatever the layer spec of the rest of the
layer. (Megatron-Core 0.16.1's stock DSA spec fuses the norms into the up-projections, which
hands the indexer the un-normalized query: a different model than HF's, refused here by
its names.) Block FP8 quantizes ``wq_b`` (vLLM's ``ReplicatedLinear`` with the quant config);
``wk`` and ``weights_proj`` stay in the model dtype, as vLLM's fused ``wk_weights_proj``
holds them.
Without ``q_lora_rank`` (DeepSeek-V2-Lite style) Megatron has one column-parallel
``linear_q_proj`` (HF ``q_proj``) instead of the q down / up pair.
"""

import dataclasses

from megarefit.specs import gpt
from megarefit.specs.moe import moe_rows
from megarefit.specs.mtp import mtp_rows
from megarefit.specs.table import Condition, FamilySpec, ParamSpec, Role

_L = "decoder.layers.{layer}.self_attention."
_H = "model.layers.{layer}.self_attn."
R = Role
Q = frozenset({Condition.Q_LORA})

MLA = (
    ParamSpec("decoder.layers.{layer}.input_layernorm.weight", R.REPLICATED,
              ("model.layers.{layer}.input_layernorm.weight",), ("hidden",)),
    ParamSpec(_L + "linear_q_down_proj.weight", R.COLUMN, (_H + "q_a_proj.weight",), ("q_lora", "hidden"),
              requires=Q, spelling="local"),
    ParamSpec(_L + "linear_q_down_proj.weight", R.REPLICATED, (_H + "q_a_proj.weight",), ("q_lora", "hidden"),
              requires=Q, spelling="te", linear=True),
    ParamSpec(_L + "q_layernorm.weight", R.REPLICATED, (_H + "q_a_layernorm.weight",), ("q_lora",),
              requires=Q, spelling="local"),
    ParamSpec(_L + "linear_q_up_proj.layer_norm_weight", R.REPLICATED, (_H + "q_a_layernorm.weight",), ("q_lora",),
              requires=Q, spelling="te"),
    ParamSpec(_L + "linear_q_up_proj.weight", R.COLUMN, (_H + "q_b_proj.weight",), ("q_up", "q_lora"), requires=Q),
    ParamSpec(_L + "linear_q_proj.weight", R.COLUMN, (_H + "q_proj.weight",), ("q_up", "hidden"),
              requires=frozenset({Condition.Q_PROJ})),
    ParamSpec(_L + "linear_kv_down_proj.weight", R.COLUMN, (_H + "kv_a_proj_with_mqa.weight",), ("kv_down", "hidden"),
              spelling="local"),
    ParamSpec(_L + "linear_kv_down_proj.weight", R.REPLICATED, (_H + "kv_a_proj_with_mqa.weight",),
              ("kv_down", "hidden"), spelling="te", linear=True),
    ParamSpec(_L + "kv_layernorm.weight", R.REPLICATED, (_H + "kv_a_layernorm.weight",), ("kv_lora",),
              spelling="local"),
    ParamSpec(_L + "linear_kv_up_proj.layer_norm_weight", R.REPLICATED, (_H + "kv_a_layernorm.weight",), ("kv_lora",),
              spelling="te"),
    ParamSpec(_L + "linear_kv_up_proj.weight", R.COLUMN, (_H + "kv_b_proj.weight",), ("kv_up", "kv_lora")),
    ParamSpec(_L + "linear_proj.weight", R.ROW, (_H + "o_proj.weight",), ("hidden", "v_heads")),
)

_I = _L + "core_attention.indexer."
_HI = _H + "indexer."
DI = frozenset({Condition.Q_LORA, Condition.DSA_INDEXER})

_ROT = ("index_head_dim", "qk_rope")  # Megatron [nope; rope] per indexer head up to 0.18, HF [rope; nope]


def _indexer_rows(fact: Condition, rotate: tuple[str, str] | None) -> tuple[ParamSpec, ...]:
    """The DSA indexer's rows where release fact ``fact`` holds (heads rotated by ``rotate``)."""
    di = DI | {fact}
    return (
        ParamSpec(_I + "linear_wq_b.weight", R.REPLICATED, (_HI + "wq_b.weight",), ("index_q", "q_lora"),
                  requires=di, linear=True, head_rotate=rotate),
        ParamSpec(_I + "linear_wk.weight", R.REPLICATED, (_HI + "wk.weight",), ("index_head_dim", "hidden"),
                  requires=di, head_rotate=rotate),
        ParamSpec(_I + "k_norm.weight", R.REPLICATED, (_HI + "k_norm.weight",), ("index_head_dim",), requires=di,
                  head_rotate=rotate),
        ParamSpec(_I + "k_norm.bias", R.REPLICATED, (_HI + "k_norm.bias",), ("index_head_dim",), requires=di,
                  head_rotate=rotate),
    )


DSA_INDEXER = (
    # megatron-core up to 0.18 ropes the last qk_rope dims of a head, 0.19 the first (as HF)
    *_indexer_rows(Condition.DSA_ROPE_LAST, _ROT),
    *_indexer_rows(Condition.DSA_ROPE_FIRST, None),
    ParamSpec(_I + "linear_weights_proj.weight", R.REPLICATED, (_HI + "weights_proj.weight",),
              ("index_heads", "hidden"), requires=DI),
)

DSA_MLA = (  # MLA as DSA trainers lay it out: down-projections whole, norms separate (any layer spec)
    MLA[0],
    ParamSpec(_L + "linear_q_down_proj.weight", R.REPLICATED, (_H + "q_a_proj.weight",), ("q_lora", "hidden"),
              requires=Q, linear=True),
    ParamSpec(_L + "q_layernorm.weight", R.REPLICATED, (_H + "q_a_layernorm.weight",), ("q_lora",), requires=Q),
    ParamSpec(_L + "linear_q_up_proj.weight", R.COLUMN, (_H + "q_b_proj.weight",), ("q_up", "q_lora"), requires=Q),
    ParamSpec(_L + "linear_kv_down_proj.weight", R.REPLICATED, (_H + "kv_a_proj_with_mqa.weight",),
              ("kv_down", "hidden"), linear=True),
    ParamSpec(_L + "kv_layernorm.weight", R.REPLICATED, (_H + "kv_a_layernorm.weight",), ("kv_lora",)),
    ParamSpec(_L + "linear_kv_up_proj.weight", R.COLUMN, (_H + "kv_b_proj.weight",), ("kv_up", "kv_lora")),
    ParamSpec(_L + "linear_proj.weight", R.ROW, (_H + "o_proj.weight",), ("hidden", "v_heads")),
)

_DSV3 = gpt.EMBEDDING + MLA + gpt.GATED_MLP + gpt.OUTPUT + moe_rows(shared="shared_experts")
_GLM5 = gpt.EMBEDDING + DSA_MLA + DSA_INDEXER + gpt.GATED_MLP + gpt.OUTPUT + moe_rows(shared="shared_experts")
_GLM = (gpt.EMBEDDING + gpt.ATTENTION + gpt.QK_NORM + gpt.GATED_MLP + gpt.OUTPUT
        + moe_rows(shared="shared_experts"))

DEEPSEEK_V3 = FamilySpec(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    model_types=("deepseek_v3", "kimi_k2"),
    entries=_DSV3 + mtp_rows(_DSV3),
    experts_key="n_routed_experts",
    moe_ffn_key="moe_intermediate_size",
    shared_experts_key="n_shared_experts",
    first_dense_key="first_k_dense_replace",
    router_bias=("topk_method", "noaux_tc"),
    mtp_key="num_nextn_predict_layers",
    mla=True,
    router_score="sigmoid",
    router_renorm=("norm_topk_prob", True),
)

# GLM-5: DeepSeek-V3's MoE / MTP rules, its own rows (DSA MLA + indexer)
GLM_MOE_DSA = dataclasses.replace(DEEPSEEK_V3, name="glm_moe_dsa", architectures=("GlmMoeDsaForCausalLM",),
                                  model_types=("glm_moe_dsa",), entries=_GLM5 + mtp_rows(_GLM5), dsa_indexer=True)

GLM4_MOE = FamilySpec(
    name="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    model_types=("glm4_moe",),
    entries=_GLM + mtp_rows(_GLM),
    qkv_bias="attention_bias",
    qk_norm="use_qk_norm",
    experts_key="n_routed_experts",
    moe_ffn_key="moe_intermediate_size",
    shared_experts_key="n_shared_experts",
    first_dense_key="first_k_dense_replace",
    router_bias=True,
    mtp_key="num_nextn_predict_layers",
    router_score="sigmoid",  # HF Glm4Moe's noaux_tc router
    router_renorm=("norm_topk_prob", True),
)
