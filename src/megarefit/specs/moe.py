"""Rows of MoE layers: pre-MLP norm, router, routed experts (all three Megatron
layouts), shared experts. Families pick their HF spelling of the block
(``mlp`` / ``block_sparse_moe``) and of the expert projections.

::

    Megatron (local layer i, local expert j on ep rank e)         HF (global layer, global expert e*E/ep + j)
    decoder.layers.i.mlp.router.weight            [E, hidden]     model.layers.L.mlp.gate.weight
    decoder.layers.i.mlp.router.expert_bias       [E]             model.layers.L.mlp.gate.e_score_correction_bias
    ...mlp.experts.local_experts.j.linear_fc1.weight  [2f/etp, h] model.layers.L.mlp.experts.E.{gate,up}_proj.weight
    ...mlp.experts.local_experts.j.linear_fc2.weight  [h, f/etp]  model.layers.L.mlp.experts.E.down_proj.weight
    ...mlp.experts.linear_fc1.weight{j}  (Transformer-Engine grouped experts, same shapes)
    ...mlp.experts.weight1  [h, E_local*2f/etp]   (legacy GroupedMLP: memory = [E_local, h, 2f/etp],
                                                   expert j's block is its [gate_r; up_r] transposed)
    ...mlp.experts.weight2  [E_local*f/etp, h]    (memory = [E_local, f/etp, h]: down_proj slab transposed)
    ...mlp.shared_experts.linear_fc1.weight           [2s/tp, h]  model.layers.L.mlp.shared_experts.{gate,up}_proj.weight
"""

from __future__ import annotations

from megarefit.specs.table import Condition, ParamSpec, Role

_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."
R = Role
C = Condition


def moe_rows(*, block: str = "mlp", gate: str = "gate", experts: str = "experts",
             expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
             shared: str | None = None, expert_bias: str | None = None, hf_layer: str = _H,
             norm: str = "post_attention_layernorm",
             shared_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> tuple[ParamSpec, ...]:
    """MoE-layer rows for one family's HF spelling (data built once at import); ``expert_bias``:
    the router's score-correction bias under the block, where not ``<gate>.e_score_correction_bias``
    (MiniMax-M2: ``block_sparse_moe.e_score_correction_bias``); ``hf_layer``: a layer's HF prefix
    (DeepSeek-V4's checkpoints: ``layers.{layer}.``); ``norm``: the pre-MLP norm's HF module;
    ``shared_proj``: the shared experts' gate / up / down names."""
    hb = hf_layer + block + "."
    g, u, d = (f"{hb}{experts}.{{expert}}.{p}.weight" for p in expert_proj)
    rows = [
        ParamSpec(_L + "pre_mlp_layernorm.weight", R.REPLICATED, (hf_layer + norm + ".weight",),
                  ("hidden",), layer_kind="moe"),
        ParamSpec(_L + "mlp.router.weight", R.REPLICATED, (hb + gate + ".weight",), ("experts", "hidden"),
                  layer_kind="moe"),
        # a persistent fp32 buffer of TopKRouter (not a parameter), fp32 in HF too
        ParamSpec(_L + "mlp.router.expert_bias", R.REPLICATED,
                  (hb + (expert_bias or gate + ".e_score_correction_bias"),), ("experts",),
                  requires=frozenset({C.ROUTER_BIAS}), layer_kind="moe", dtype="float32"),
        ParamSpec(_L + "mlp.experts.local_experts.{expert}.linear_fc1.weight", R.EXPERT_GATED_MLP, (g, u),
                  ("2moe_ffn", "hidden"), layer_kind="moe", expert_layout="sequential"),
        ParamSpec(_L + "mlp.experts.local_experts.{expert}.linear_fc2.weight", R.EXPERT_ROW, (d,),
                  ("hidden", "moe_ffn"), layer_kind="moe", expert_layout="sequential"),
        ParamSpec(_L + "mlp.experts.linear_fc1.weight{expert}", R.EXPERT_GATED_MLP, (g, u),
                  ("2moe_ffn", "hidden"), layer_kind="moe", expert_layout="te_grouped"),
        ParamSpec(_L + "mlp.experts.linear_fc2.weight{expert}", R.EXPERT_ROW, (d,),
                  ("hidden", "moe_ffn"), layer_kind="moe", expert_layout="te_grouped"),
        # legacy GroupedMLP: shapes are one expert's block as stored ([h, 2F] and [F, h], transposed)
        ParamSpec(_L + "mlp.experts.weight1", R.GROUPED_EXPERT_FC1, (g, u), ("hidden", "2moe_ffn"),
                  layer_kind="moe", expert_layout="legacy_grouped"),
        ParamSpec(_L + "mlp.experts.weight2", R.GROUPED_EXPERT_FC2, (d,), ("moe_ffn", "hidden"),
                  layer_kind="moe", expert_layout="legacy_grouped"),
    ]
    if shared is not None:
        sg, su, sd = (f"{hb}{shared}.{p}.weight" for p in shared_proj)
        rows += [
            ParamSpec(_L + "mlp.shared_experts.linear_fc1.weight", R.GATED_MLP,
                      (sg, su), ("2shared_ffn", "hidden"),
                      requires=frozenset({C.SHARED_EXPERTS}), layer_kind="moe"),
            ParamSpec(_L + "mlp.shared_experts.linear_fc2.weight", R.ROW, (sd,),
                      ("hidden", "shared_ffn"), requires=frozenset({C.SHARED_EXPERTS}), layer_kind="moe"),
        ]
    return tuple(rows)
