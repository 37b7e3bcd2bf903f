"""Nemotron-H / Nemotron-3-Nano (``NemotronHForCausalLM``, ``nemotron_h``): a hybrid of Mamba2
mixers, attention, dense MLP and MoE layers, one kind per layer from the config's pattern
(``M`` Mamba2, ``*`` attention, ``-`` MLP, ``E`` MoE). Megatron-Core builds it as ``MambaModel``;
HF checkpoints name every layer's block ``mixer`` under ``backbone.``::

    Megatron decoder.layers.{layer}.          HF backbone.layers.{layer}.   TP split
    M  mixer.in_proj.weight   [z; x; B; C; dt]  ->  mixer.in_proj.weight    segmented: rank r [z_r; x_r; B_r; C_r; dt_r]
       mixer.conv1d.weight / .bias  [x; B; C]   ->  mixer.conv1d.*          segmented: [x_r; B_r; C_r] ([rows, 1, k])
       mixer.A_log, mixer.D, mixer.dt_bias      ->  the same              by heads
       mixer.norm.weight  (gated, per group)    ->  mixer.norm.weight       rows (groups split over TP)
       mixer.out_proj.weight                    ->  mixer.out_proj.weight   columns
    *  self_attention.linear_qkv.weight         ->  mixer.{q,k,v}_proj      query groups (or a part of one: tp > groups)
       self_attention.linear_proj.weight        ->  mixer.o_proj.weight
    -  mlp.linear_fc1.weight / linear_fc2       ->  mixer.up_proj / down_proj   (relu2, not gated)
    E  mlp.router.weight / .expert_bias (fp32)  ->  mixer.gate.weight / .e_score_correction_bias
       mlp.experts.local_experts.{e}.linear_fc1 ->  mixer.experts.{e}.up_proj.weight   (relu2, not gated)
       ...linear_fc2                            ->  mixer.experts.{e}.down_proj.weight
       mlp.shared_experts.linear_fc1 / fc2      ->  mixer.shared_experts.up_proj / down_proj
    every layer's norm: decoder.layers.{layer}.norm (M), input_layernorm (*), pre_mlp_layernorm (-, E) in the
    local spec; fused into in_proj / linear_qkv / linear_fc1 (layer_norm_weight) in the TE spec
                                                ->  backbone.layers.{layer}.norm.weight
    embedding.word_embeddings.weight -> backbone.embeddings.weight; decoder.final_norm.weight -> backbone.norm_f.weight

The Mamba mixer's TP split needs ``n_groups % tp == 0`` (Megatron-Core asserts it); each
segment of ``in_proj`` / ``conv1d`` is split on its own, which is the same per-rank layout
vLLM's ``MambaMixer2`` loads (checked against Megatron-Bridge's ``MambaInProjMapping`` /
``MambaConv1dMapping`` scheme).
"""

from megarefit.specs import gpt
from megarefit.specs.table import Condition, FamilySpec, ParamSpec, Role

_L = "decoder.layers.{layer}."
_H = "backbone.layers.{layer}."
_M = _H + "mixer."
R = Role
C = Condition
_NORM = (_H + "norm.weight",)
_CONV = ((".", C.MAMBA_CONV_MODULE), ("_", C.MAMBA_CONV_PARAMS))


def _mamba_rows() -> tuple[ParamSpec, ...]:
    m, k = "mamba", "mamba"
    return (
        ParamSpec(_L + "norm.weight", R.REPLICATED, _NORM, ("hidden",), spelling="local", layer_kind=k),
        ParamSpec(_L + "mixer.in_proj.layer_norm_weight", R.REPLICATED, _NORM, ("hidden",), spelling="te",
                  layer_kind=k),
        ParamSpec(_L + "mixer.in_proj.weight", R.SEGMENTED, (_M + "in_proj.weight",), ("mamba_in", "hidden"),
                  layer_kind=m, segments=("mamba_inner", "mamba_inner", "mamba_gs", "mamba_gs", "mamba_heads")),
        # megatron-core up to 0.18: an nn.Conv1d module; 0.19: plain parameters (same shapes)
        *(ParamSpec(_L + f"mixer.conv1d{sep}weight", R.SEGMENTED, (_M + "conv1d.weight",),
                    ("mamba_conv", "one", "conv_kernel"), requires=frozenset({fact}),
                    layer_kind=m, segments=("mamba_inner", "mamba_gs", "mamba_gs"), linear=False)
          for sep, fact in _CONV),
        *(ParamSpec(_L + f"mixer.conv1d{sep}bias", R.SEGMENTED, (_M + "conv1d.bias",), ("mamba_conv",),
                    requires=frozenset({fact}), layer_kind=m, segments=("mamba_inner", "mamba_gs", "mamba_gs"))
          for sep, fact in _CONV),
        *(ParamSpec(_L + f"mixer.{p}", R.COLUMN, (_M + p,), ("mamba_heads",), layer_kind=m)
          for p in ("A_log", "D", "dt_bias")),
        ParamSpec(_L + "mixer.norm.weight", R.COLUMN, (_M + "norm.weight",), ("mamba_inner",), layer_kind=m),
        ParamSpec(_L + "mixer.out_proj.weight", R.ROW, (_M + "out_proj.weight",), ("hidden", "mamba_inner"),
                  layer_kind=m),
    )


def _attention_rows() -> tuple[ParamSpec, ...]:
    a = "attention"
    return (
        ParamSpec(_L + "input_layernorm.weight", R.REPLICATED, _NORM, ("hidden",), spelling="local", layer_kind=a),
        ParamSpec(_L + "self_attention.linear_qkv.layer_norm_weight", R.REPLICATED, _NORM, ("hidden",), spelling="te",
                  layer_kind=a),
        ParamSpec(_L + "self_attention.linear_qkv.weight", R.QKV,
                  (_M + "q_proj.weight", _M + "k_proj.weight", _M + "v_proj.weight"), ("qkv", "hidden"), layer_kind=a),
        ParamSpec(_L + "self_attention.linear_proj.weight", R.ROW, (_M + "o_proj.weight",), ("hidden", "q"),
                  layer_kind=a),
    )


def _mlp_rows() -> tuple[ParamSpec, ...]:
    d = "dense"
    return (
        ParamSpec(_L + "pre_mlp_layernorm.weight", R.REPLICATED, _NORM, ("hidden",), spelling="local", layer_kind=d),
        ParamSpec(_L + "mlp.linear_fc1.layer_norm_weight", R.REPLICATED, _NORM, ("hidden",), spelling="te",
                  layer_kind=d),
        ParamSpec(_L + "mlp.linear_fc1.weight", R.COLUMN, (_M + "up_proj.weight",), ("ffn", "hidden"), layer_kind=d),
        ParamSpec(_L + "mlp.linear_fc2.weight", R.ROW, (_M + "down_proj.weight",), ("hidden", "ffn"), layer_kind=d),
    )


def _moe_rows() -> tuple[ParamSpec, ...]:
    e, x = "moe", _M + "experts.{expert}."
    rows = [
        ParamSpec(_L + "pre_mlp_layernorm.weight", R.REPLICATED, _NORM, ("hidden",), layer_kind=e),
        ParamSpec(_L + "mlp.router.weight", R.REPLICATED, (_M + "gate.weight",), ("experts", "hidden"), layer_kind=e),
        ParamSpec(_L + "mlp.router.expert_bias", R.REPLICATED, (_M + "gate.e_score_correction_bias",), ("experts",),
                  requires=frozenset({C.ROUTER_BIAS}), layer_kind=e, dtype="float32"),
        ParamSpec(_L + "mlp.shared_experts.linear_fc1.weight", R.COLUMN, (_M + "shared_experts.up_proj.weight",),
                  ("shared_ffn", "hidden"), requires=frozenset({C.SHARED_EXPERTS}), layer_kind=e),
        ParamSpec(_L + "mlp.shared_experts.linear_fc2.weight", R.ROW, (_M + "shared_experts.down_proj.weight",),
                  ("hidden", "shared_ffn"), requires=frozenset({C.SHARED_EXPERTS}), layer_kind=e),
    ]
    for fc1, fc2, layout in (("mlp.experts.local_experts.{expert}.linear_fc1.weight",
                              "mlp.experts.local_experts.{expert}.linear_fc2.weight", "sequential"),
                             ("mlp.experts.linear_fc1.weight{expert}", "mlp.experts.linear_fc2.weight{expert}",
                              "te_grouped")):
        rows += [ParamSpec(_L + fc1, R.EXPERT_COLUMN, (x + "up_proj.weight",), ("moe_ffn", "hidden"), layer_kind=e,
                           expert_layout=layout),  # type: ignore[arg-type]
                 ParamSpec(_L + fc2, R.EXPERT_ROW, (x + "down_proj.weight",), ("hidden", "moe_ffn"), layer_kind=e,
                           expert_layout=layout)]  # type: ignore[arg-type]
    return tuple(rows)


NEMOTRON_H = FamilySpec(
    name="nemotron_h",
    architectures=("NemotronHForCausalLM",),
    model_types=("nemotron_h",),
    entries=(ParamSpec("embedding.word_embeddings.weight", R.VOCAB, ("backbone.embeddings.weight",),
                       ("vocab", "hidden")),)
    + _mamba_rows() + _attention_rows() + _mlp_rows() + _moe_rows() + (
        ParamSpec("decoder.final_norm.weight", R.REPLICATED, ("backbone.norm_f.weight",), ("hidden",)),
    ) + tuple(r for r in gpt.OUTPUT if r.megatron == "output_layer.weight"),
    experts_key="n_routed_experts",
    moe_ffn_key="moe_intermediate_size",
    shared_experts_key="n_shared_experts",
    shared_ffn_key="moe_shared_expert_intermediate_size",
    router_bias=True,
    hybrid=True,
    router_score="sigmoid",
    router_renorm=("norm_topk_prob", True),
    megatron_config=(("gated_linear_unit", (False,)), ("activation_func", ("squared_relu",))),
)

__all__ = ["NEMOTRON_H"]
