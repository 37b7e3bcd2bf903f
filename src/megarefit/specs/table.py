"""Spec-table types: what every Megatron parameter *is*, as frozen data.

A family's table is a tuple of :class:`ParamSpec` rows. Each row says: this
Megatron-Core parameter name pattern has this :class:`Role` and becomes these
HF checkpoint tensors. The role alone fixes how the tensor is sharded under
tensor parallelism and how its rows map onto the HF tensors; the planner
(:mod:`megarefit.planner`) holds that geometry, once, for every family.

Patterns use typed placeholders. ``{layer}`` is a non-negative integer: in a
Megatron name it is the layer index *local to the pipeline stage*; in an HF
template it is the global layer index (stage offset + local index)::

    decoder.layers.{layer}.self_attention.linear_qkv.weight     (Megatron, local)
    model.layers.{layer}.self_attn.q_proj.weight                 (HF, global)

Multi-token-prediction rows (``mtp.layers.{layer}...``, Megatron's ``mtp_num_layers``)
use ``{layer}`` for the MTP layer index; their HF templates get the global index
``num_layers + index`` (HF checkpoints store MTP layer i as ``model.layers.{N+i}``)::

    mtp.layers.{layer}.eh_proj.weight                            (Megatron, MTP index)
    model.layers.{layer}.eh_proj.weight                          (HF, num_layers + index)

Rows hold no functions: they serialize, print and compare as plain data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from megarefit.errors import AmbiguousParameterError, SpecTableError, UnknownParameterError

LayerSpec = Literal["local", "te"]
"""Megatron-Core layer spec. ``"local"`` (``get_gpt_layer_local_spec``) keeps
norms as separate modules (``input_layernorm``, ``pre_mlp_layernorm``);
``"te"`` (Transformer Engine spec) fuses them into the following linear as
``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``."""

LAYER_SPECS: tuple[LayerSpec, ...] = ("local", "te")

ExpertLayout = Literal["sequential", "te_grouped", "legacy_grouped"]
"""How Megatron-Core stores routed experts::

    sequential      SequentialMLP: mlp.experts.local_experts.{i}.linear_fc1.weight   [2*ffn/etp, hidden]
    te_grouped      TEGroupedMLP:  mlp.experts.linear_fc1.weight{i}                  [2*ffn/etp, hidden]
    legacy_grouped  GroupedMLP:    mlp.experts.weight1  [hidden, E_local*2*ffn/etp]  (transposed, all experts)

``i`` is the local expert index; the global expert is ``ep_rank * E/ep + i``."""

EXPERT_LAYOUTS: tuple[ExpertLayout, ...] = ("sequential", "te_grouped", "legacy_grouped")

Mixer = Literal["gdn", "attention"]
"""Which token mixer a decoder layer of a linear-attention hybrid has (Qwen3.5: HF ``layer_types``
``linear_attention`` -> ``"gdn"``, a gated DeltaNet; ``full_attention`` -> ``"attention"``), beside
its MLP kind (dense / MoE): a second per-layer axis, see ``ParamSpec.mixer``."""

ValueRule = Literal["plus_one"]
"""An elementwise value change between Megatron and HF (``ParamSpec.value``): ``"plus_one"``,
HF = Megatron + 1 (a norm weight Megatron-Core stores zero-centered, ``layernorm_zero_centered_gamma``,
where HF stores the weight itself). Computed in the tensor's dtype, one rounding; HF -> Megatron ->
HF is exact for HF weights in [0.5, 2] (Sterbenz), Megatron -> HF rounds to HF's precision."""

LayerSet = Literal["csa", "hca", "hash", "learned"]
"""DeepSeek-V4's per-layer variants (``ParamSpec.layers``; ``ModelDims.in_layer_set`` decides), from
HF ``compress_ratios`` and ``num_hash_layers``: ``"csa"``, compressed sparse attention (ratio 4: a KV
compressor with overlapping windows and a lightning indexer); ``"hca"``, heavily compressed attention
(any other positive ratio, 128 in the published models: a compressor, no indexer); ``"hash"``, the first
``num_hash_layers`` layers, routed by a token-id table (``tid2eid``) instead of a learned gate bias;
``"learned"``, every other MoE layer (a score-correction bias)."""

LayerKind = Literal["dense", "moe", "mamba", "attention"]
"""Which decoder layers a row exists in: MoE models mix dense and MoE layers; hybrid models
(Nemotron-H) have one kind per layer, from their pattern (``M`` mamba, ``*`` attention,
``-`` dense MLP, ``E`` MoE)."""


class ParallelMode(str, Enum):
    """How Megatron tensor parallelism splits a parameter (Megatron's ``partition_dim``)."""

    REPLICATED = "replicated"  # every TP rank holds the whole tensor
    COLUMN = "column"  # split on dim 0 (output features / vocab rows)
    ROW = "row"  # split on dim 1 (input features)


class Role(str, Enum):
    """What a tensor is; fixes its TP sharding and its Megatron <-> HF row mapping.

    ========== ===== ================================================================
    role       split HF tensors
    ========== ===== ================================================================
    replicated  --   1, identical on every TP rank (norms, row-parallel biases)
    column     dim 0 1, rank r holds rows ``[r*n/tp, (r+1)*n/tp)``
    row        dim 1 1, rank r holds columns ``[r*n/tp, (r+1)*n/tp)``
    vocab      dim 0 1, column over the *padded* vocab; HF keeps ``vocab_size`` rows
    qkv        dim 0 3 (q, k, v), rows interleaved per query group, see planner
    gated_mlp  dim 0 2 (gate, up), rank r holds ``[gate_r; up_r]``, see planner
    expert_gated_mlp  dim 0 over expert-TP, per expert, like gated_mlp
    expert_row        dim 1 over expert-TP, per expert, like row
    expert_gate_up_fused     dim 0 over expert-TP, per expert [gate_r; up_r]; 1 HF tensor
                             per layer holding every expert, gate/up interleaved
    expert_row_fused         dim 1 over expert-TP, per expert; 1 HF tensor per layer
    expert_replicated_fused  --, per expert (a row-parallel bias); 1 HF tensor per layer
    expert_column     dim 0 over expert-TP, per expert, like column (non-gated experts)
    segmented  dim 0 1+, rows are ``ParamSpec.segments``, each split over TP: rank r holds
                     ``[seg0_r; seg1_r; ...]`` (Mamba's ``in_proj`` [z; x; B; C; dt],
                     ``conv1d`` [x; B; C]); HF keeps the segments whole, in order, in the HF
                     tensor ``ParamSpec.segment_hf`` names (gated DeltaNet ``in_proj``
                     [Q; K; V; Z; b; a] -> ``in_proj_qkv`` [Q; K; V], ``in_proj_z``, ``_b``, ``_a``),
                     or packed per group (``ParamSpec.segment_groups``: Qwen3-Next's
                     ``in_proj_qkvz`` [q_g; k_g; v_g; z_g] and ``in_proj_ba`` [b_g; a_g] per key head g)
    gated_qkv  dim 0 3 (q, k, v), attention with an output gate (Megatron ``attention_output_gate``):
                     per query group [q heads; gate heads; k; v], HF ``q_proj`` per head
                     [q_h; gate_h]; see the planner
    ========== ===== ================================================================

    Fused roles (gpt-oss): HF stores a layer's experts as one tensor, expert on dim 0,
    each expert's weight as ``[in, out]`` (transformers' gpt-oss computes ``x @ W``, the
    transpose of Megatron's ``[out, in]``) and its bias as is; gate and up are interleaved
    element by element (gate at even, up at odd positions of the ``2*moe_ffn`` dim)::

        Megatron expert e, etp rank r            HF (E experts)
        linear_fc1.weight [2f/etp, h]       ->   gate_up_proj       [E, h, 2f]   viewed [E, h, f, 2]
          = [gate_r; up_r]                        gate_r^T -> (e, :, r*f/etp.., 0), up_r^T -> (.., 1)
        linear_fc1.bias   [2f/etp]          ->   gate_up_proj_bias  [E, 2f]      viewed [E, f, 2]
        linear_fc2.weight [h, f/etp]        ->   down_proj          [E, f, h]    rows r*f/etp.. of e, transposed
        linear_fc2.bias   [h]               ->   down_proj_bias     [E, h]       row e

    Expert roles are split over expert-tensor-parallel ranks (``etp``, Megatron's
    ``expert_tensor_parallel_size``, 1 or ``tp``) and spread over ``ep`` ranks by expert.
    """

    REPLICATED = "replicated"
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"
    QKV = "qkv"
    GATED_MLP = "gated_mlp"
    EXPERT_GATED_MLP = "expert_gated_mlp"
    EXPERT_ROW = "expert_row"
    GROUPED_EXPERT_FC1 = "grouped_expert_fc1"  # legacy GroupedMLP weight1: all local experts, transposed
    GROUPED_EXPERT_FC2 = "grouped_expert_fc2"  # legacy GroupedMLP weight2
    EXPERT_GATE_UP_FUSED = "expert_gate_up_fused"  # gpt-oss linear_fc1 -> gate_up_proj (all experts, interleaved)
    EXPERT_ROW_FUSED = "expert_row_fused"  # gpt-oss linear_fc2.weight -> down_proj (all experts)
    EXPERT_REPLICATED_FUSED = "expert_replicated_fused"  # gpt-oss linear_fc2.bias -> down_proj_bias (all experts)
    EXPERT_COLUMN = "expert_column"  # non-gated expert linear_fc1 (Nemotron-H relu2 experts) -> up_proj
    SEGMENTED = "segmented"  # Mamba in_proj / conv1d: segments each split over tp
    GATED_QKV = "gated_qkv"  # linear_qkv with an output gate per head (Qwen3.5 / Qwen3-Next full attention)

    @property
    def is_expert(self) -> bool:
        return self in (Role.EXPERT_GATED_MLP, Role.EXPERT_ROW, Role.GROUPED_EXPERT_FC1, Role.GROUPED_EXPERT_FC2,
                        Role.EXPERT_GATE_UP_FUSED, Role.EXPERT_ROW_FUSED, Role.EXPERT_REPLICATED_FUSED,
                        Role.EXPERT_COLUMN)

    @property
    def is_fused(self) -> bool:
        """The HF tensor holds every expert of a layer (expert on dim 0; no ``{expert}`` in its name)."""
        return self in (Role.EXPERT_GATE_UP_FUSED, Role.EXPERT_ROW_FUSED, Role.EXPERT_REPLICATED_FUSED)

    @property
    def is_grouped(self) -> bool:
        """One tensor holds every local expert (no ``{expert}`` in the Megatron name)."""
        return self in (Role.GROUPED_EXPERT_FC1, Role.GROUPED_EXPERT_FC2)

    @property
    def parallel_mode(self) -> ParallelMode:
        return _ROLE_MODE[self]

    @property
    def hf_arity(self) -> int:
        """Number of HF tensors one Megatron tensor of this role becomes."""
        return _ROLE_ARITY.get(self, 1)


_ROLE_MODE = {
    Role.REPLICATED: ParallelMode.REPLICATED,
    Role.COLUMN: ParallelMode.COLUMN,
    Role.ROW: ParallelMode.ROW,
    Role.VOCAB: ParallelMode.COLUMN,
    Role.QKV: ParallelMode.COLUMN,
    Role.GATED_MLP: ParallelMode.COLUMN,
    Role.EXPERT_GATED_MLP: ParallelMode.COLUMN,
    Role.EXPERT_ROW: ParallelMode.ROW,
    Role.GROUPED_EXPERT_FC1: ParallelMode.ROW,  # weight1 [h, E_local*2F/etp]: Megatron partition_dim 1
    Role.GROUPED_EXPERT_FC2: ParallelMode.COLUMN,  # weight2 [E_local*F/etp, h]: partition_dim 0
    Role.EXPERT_GATE_UP_FUSED: ParallelMode.COLUMN,
    Role.EXPERT_ROW_FUSED: ParallelMode.ROW,
    Role.EXPERT_REPLICATED_FUSED: ParallelMode.REPLICATED,
    Role.EXPERT_COLUMN: ParallelMode.COLUMN,
    Role.SEGMENTED: ParallelMode.COLUMN,
    Role.GATED_QKV: ParallelMode.COLUMN,
}
_ROLE_ARITY = {Role.QKV: 3, Role.GATED_QKV: 3, Role.GATED_MLP: 2, Role.EXPERT_GATED_MLP: 2, Role.GROUPED_EXPERT_FC1: 2}


MTP_PREFIX = "mtp.layers."  # Megatron-Core's multi-token-prediction block (``GPTModel.mtp``)


class Stage(str, Enum):
    """Which pipeline stage(s) hold a parameter."""

    FIRST = "first"  # embedding
    LAST = "last"  # final norm, output layer
    LAYER = "layer"  # per decoder layer; the stage owning that layer
    MTP = "mtp"  # per multi-token-prediction layer (``mtp.layers.{layer}``), on the last stage


class Condition(str, Enum):
    """Model/layout facts that decide whether a table row exists at all."""

    QKV_BIAS = "qkv_bias"  # q/k/v projections carry a bias
    PROJ_BIAS = "proj_bias"  # attention output projection carries a bias
    MLP_BIAS = "mlp_bias"  # MLP linears carry biases
    UNTIED = "untied"  # separate output layer / lm_head
    TIED_COPY = "tied_copy"  # tied embeddings and pp > 1: last stage keeps a synced copy
    SHARED_EXPERTS = "shared_experts"  # MoE layers have shared (always-on) experts
    Q_LORA = "q_lora"  # MLA with a low-rank q projection (q_a_proj / q_b_proj)
    Q_PROJ = "q_proj"  # MLA without q_lora_rank: one q projection (Megatron linear_q_proj, HF q_proj)
    QK_NORM = "qk_norm"  # per-head q/k RMSNorm (Qwen3; GLM-4.5 when use_qk_norm)
    ROUTER_BIAS = "router_bias"  # router has a score-correction bias (DeepSeek-V3 noaux_tc)
    DSA_INDEXER = "dsa_indexer"  # every layer's attention carries a DSA lightning indexer (GLM-5)
    # Megatron-Core release facts (megarefit.specs.megatron_core.RELEASES says which hold where)
    MTP_TRANSFORMER_LAYER = "mtp_transformer_layer"  # 0.16: mtp.layers.{i}.transformer_layer.*
    MTP_MODEL_LAYER = "mtp_model_layer"  # 0.17+: mtp.layers.{i}.mtp_model_layer.*
    DSA_ROPE_LAST = "dsa_rope_last"  # up to 0.18: a DSA indexer head is [nope; rope]
    DSA_ROPE_FIRST = "dsa_rope_first"  # 0.19+: [rope; nope], as HF
    MAMBA_CONV_MODULE = "mamba_conv_module"  # up to 0.18: mixer.conv1d.weight / .bias (an nn.Conv1d)
    MAMBA_CONV_PARAMS = "mamba_conv_params"  # 0.19+: mixer.conv1d_weight / conv1d_bias


# Dimension symbols allowed in ParamSpec.shape; ModelDims.size() resolves them.
SHAPE_SYMBOLS = frozenset({
    "hidden", "2hidden", "ffn", "2ffn", "vocab", "head_dim", "q", "qkv",  # dense
    "kv",  # num_key_value_heads * head_dim (MiniMax-M2's K norm over all key heads)
    "experts", "moe_ffn", "2moe_ffn", "shared_ffn", "2shared_ffn",  # MoE
    "q_lora", "kv_lora", "q_up", "kv_down", "kv_up", "v_heads",  # MLA
    "index_q", "index_head_dim", "index_heads",  # DSA indexer: heads * head_dim, head_dim, heads
    "qk_rope",  # MLA's qk_rope_head_dim (the rotated part of a head; see ParamSpec.head_rotate)
    "heads",  # num_attention_heads (gpt-oss attention sinks: one learned logit per head)
    # Mamba2 (Nemotron-H): in_proj rows 2*inner + 2*groups*state + heads, conv1d rows inner + 2*groups*state,
    # inner = mamba heads * mamba head_dim, a conv1d weight [rows, one, conv_kernel]
    "mamba_in", "mamba_conv", "mamba_inner", "mamba_gs", "mamba_heads", "conv_kernel", "one",
    # gated attention: linear_qkv rows 2 * heads * head_dim + 2 * groups * head_dim (q, gate, k, v)
    "qkvg",
    # gated DeltaNet (HF linear_*): key heads nk x dk, value heads nv x dv; in_proj rows 2*nk*dk + 2*nv*dv
    # + 2*nv ([Q; K; V; Z; b; a]), conv1d rows 2*nk*dk + nv*dv ([Q; K; V])
    "gdn_in", "gdn_conv", "gdn_qk", "gdn_v", "gdn_heads", "gdn_dv",
    "gdn_kheads",  # nk: the groups Qwen3-Next packs its in_proj_qkvz / in_proj_ba by
    # DeepSeek-V4: grouped low-rank output (o_groups x o_lora_rank rows; heads*head_dim/o_groups inputs per
    # group), a compressor's [2*d] (csa, overlapping) or [d] (hca) rows and its ratio, hyper-connections
    # (hc = hc_mult copies of the residual: a mixing projection [(2+hc)*hc, hc*hidden]), hash routing
    # (tid2eid [token_ids = unpadded vocab, topk = num_experts_per_tok]), scalars ("one")
    "o_lora_all", "o_group_in", "2head_dim", "2index_head_dim", "csa_ratio", "hca_ratio", "hc", "hc_mix",
    "hc_hidden", "token_ids", "topk",
})
_ROLE_LEADING_SYMBOL = {Role.QKV: "qkv", Role.GATED_QKV: "qkvg", Role.GATED_MLP: ("2ffn", "2shared_ffn"), Role.VOCAB: "vocab",
                        Role.EXPERT_GATED_MLP: "2moe_ffn", Role.EXPERT_GATE_UP_FUSED: "2moe_ffn"}

_PLACEHOLDERS = {"layer": r"(?P<layer>0|[1-9][0-9]*)", "expert": r"(?P<expert>0|[1-9][0-9]*)"}
_PLACEHOLDER_RE = re.compile(r"\{([a-z_]+)\}")


def _compile(pattern: str) -> re.Pattern[str]:
    parts, pos = [], 0
    for m in _PLACEHOLDER_RE.finditer(pattern):
        if m.group(1) not in _PLACEHOLDERS:
            raise SpecTableError(
                f"pattern {pattern!r}: unknown placeholder {{{m.group(1)}}}; "
                f"known: {sorted(_PLACEHOLDERS)}"
            )
        parts.append(re.escape(pattern[pos : m.start()]))
        parts.append(_PLACEHOLDERS[m.group(1)])
        pos = m.end()
    parts.append(re.escape(pattern[pos:]))
    return re.compile("".join(parts))


@dataclass(frozen=True)
class ParamSpec:
    """One table row: a Megatron parameter pattern, its role, its HF names.

    Attributes:
        megatron: Megatron-Core name pattern, as ``named_parameters()`` spells it
            on one rank (local layer index in ``{layer}``).
        role: the tensor's :class:`Role`.
        hf: HF checkpoint name templates, in role order (q, k, v for ``qkv``;
            gate, up for ``gated_mlp``).
        shape: the Megatron tensor's global shape at TP=1 as dimension symbols
            (see ``SHAPE_SYMBOLS``); ``vocab`` means the unpadded vocab.
        requires: conditions that must all hold for the row to exist.
        spelling: the layer spec that uses this spelling; ``None`` for both.
        duplicate: the tensor is a kept-in-sync copy of another row's HF tensor
            (tied output layer at PP>1); it is filled on import, skipped on export.
        layer_kind: ``"dense"`` / ``"moe"``: the row exists only in that kind of
            decoder layer; ``None``: in every layer (or not a layer row).
        expert_layout: the expert storage this spelling belongs to; ``None`` for all.
        dtype: a dtype the tensor always has, whatever the model's (the fp32
            router ``expert_bias`` buffer of a bf16 model); ``None``: the model dtype.
        linear: the row is the weight of a linear layer of attention, an MLP or an
            expert, which block-FP8 checkpoints store quantized (``None``: 2-D rows of
            every role but ``replicated`` and ``vocab``; set where a replicated tensor is
            such a weight, e.g. MLA down-projections in the TE spec). Embeddings,
            ``lm_head``, norms, the router gate and biases never are.
        head_rotate: ``(head, rope)`` shape symbols of a ``replicated`` row whose dim 0 is
            whole heads of ``head`` rows, each stored ``[nope; rope]`` by Megatron and
            ``[rope; nope]`` by HF (the last ``rope`` rows of a Megatron head are the first
            of the HF head): Megatron-Core 0.16.1's ``DSAIndexer`` ropes the last
            ``qk_rope`` dims of an indexer head, HF / vLLM GLM-5 the first. Two row runs
            per head, both directions; ``None``: rows map one to one.
        segments: the ``segmented`` role's dim-0 segments as shape symbols, in order
            (Mamba ``in_proj``: ``("mamba_inner", "mamba_inner", "mamba_gs", "mamba_gs",
            "mamba_heads")`` for [z; x; B; C; dt]); they sum to ``shape[0]``.
        segment_hf: per segment, the index in ``hf`` of the HF tensor it lands in (segments of
            one HF tensor are stacked in order); ``()``: every segment in ``hf[0]``.
        segment_groups: a shape symbol G: each HF tensor is packed per group, group g holding
            ``[seg_a rows of g; seg_b rows of g; ...]`` (its segments, each cut in G equal parts,
            in order), and TP splits the groups (Qwen3-Next's per-key-head ``in_proj_qkvz``);
            ``None``: each segment whole, one after another.
        mixer: ``"gdn"`` / ``"attention"``: the row exists only in layers with that token mixer
            (``ModelDims.linear_layers``); ``None``: in every layer.
        value: an elementwise value change from Megatron to HF (:data:`ValueRule`; the plan
            carries it as a value step, with its inverse on import); ``None``: bytes copy as is.
        layers: the row exists only in layers of this :data:`LayerSet` (DeepSeek-V4's compressors,
            indexers and routers); ``None``: in every layer its other fields allow.
        unquantized: indices into ``hf`` of a linear weight's HF tensors that block-FP8 checkpoints keep in
            the model dtype all the same (gated DeltaNet's ``in_proj_b`` / ``in_proj_a``, ``in_proj_ba``: vLLM
            builds them unquantized, "ba_proj doesn't support blockwise fp8"); ``()``: all follow ``linear``.
        pack: ``(slot, parts)``: the Megatron tensor is dim-0 part ``slot`` of ``parts`` equal parts of
            its HF tensor, which ``parts`` rows share (DeepSeek-V4's ``hc_attn_scale`` [3] =
            [alpha_pre; alpha_post; alpha_res], each a Megatron ``[1]``, as Megatron-Bridge 0.6's
            ``_HCAlphaMapping`` packs them); replicated rows only. ``None``: the HF tensor is this row's.
    """

    megatron: str
    role: Role
    hf: tuple[str, ...]
    shape: tuple[str, ...]
    requires: frozenset[Condition] = frozenset()
    spelling: LayerSpec | None = None
    duplicate: bool = False
    layer_kind: LayerKind | None = None
    expert_layout: ExpertLayout | None = None
    dtype: str | None = None
    linear: bool | None = None
    head_rotate: tuple[str, str] | None = None
    segments: tuple[str, ...] = ()
    segment_hf: tuple[int, ...] = ()
    segment_groups: str | None = None
    mixer: Mixer | None = None
    value: ValueRule | None = None
    layers: LayerSet | None = None
    pack: tuple[int, int] | None = None
    unquantized: tuple[int, ...] = ()
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regex", _compile(self.megatron))
        where = f"spec row {self.megatron!r}"
        arity = max(self.segment_hf) + 1 if self.segment_hf else self.role.hf_arity
        if len(self.hf) != arity:
            raise SpecTableError(f"{where}: role {self.role.value} needs {arity} HF names, got {len(self.hf)}")
        if self.value is not None and len(self.hf) > 4:  # the planner orders a value's product after k + 4
            raise SpecTableError(f"{where}: a value rule needs at most 4 HF names, got {len(self.hf)}")
        if self.segment_hf and (len(self.segment_hf) != len(self.segments)
                                or set(self.segment_hf) != set(range(arity))):
            raise SpecTableError(f"{where}: segment_hf must name an HF tensor for each of the {len(self.segments)} "
                                 f"segments and use every one of the {arity} HF names, got {self.segment_hf}")
        for template in self.hf:
            _compile(template)  # placeholder check
            if ("{layer}" in template) != self.per_layer:
                raise SpecTableError(f"{where}: HF name {template!r} and pattern disagree on {{layer}}")
        unknown = set(self.shape) - SHAPE_SYMBOLS
        if unknown:
            raise SpecTableError(f"{where}: unknown shape symbols {sorted(unknown)}")
        lead = _ROLE_LEADING_SYMBOL.get(self.role)
        leads = (lead,) if isinstance(lead, str) else lead
        if leads is not None and self.shape[0] not in leads:
            raise SpecTableError(f"{where}: role {self.role.value} needs leading dim {leads}, got {self.shape}")
        if self.per_expert != (self.role.is_expert and not self.role.is_grouped):
            raise SpecTableError(f"{where}: per-expert roles and the {{expert}} placeholder go together")
        if self.role.is_expert and self.layer_kind != "moe":
            raise SpecTableError(f"{where}: expert rows exist in MoE layers only (layer_kind='moe')")
        for template in self.hf:
            if ("{expert}" in template) != (self.role.is_expert and not self.role.is_fused):
                raise SpecTableError(f"{where}: HF name {template!r} and the role disagree on {{expert}}")
        if self.role in (Role.ROW, Role.EXPERT_ROW, Role.EXPERT_ROW_FUSED) and len(self.shape) != 2:
            raise SpecTableError(f"{where}: a row-parallel tensor must be 2-D, got {self.shape}")
        groups_ok = self.segment_groups is None or (bool(self.segments) and self.segment_groups in SHAPE_SYMBOLS)
        if (self.role is Role.SEGMENTED) != bool(self.segments) or not set(self.segments) <= SHAPE_SYMBOLS \
                or not groups_ok:
            raise SpecTableError(f"{where}: the segmented role and known segment (group) symbols go together, got "
                                 f"{self.role.value} {self.segments} {self.segment_groups}")
        if not set(self.unquantized) <= set(range(len(self.hf))) or (self.layers is not None and not self.per_layer):
            raise SpecTableError(f"{where}: unquantized must index its HF names and layers needs a layer row, got "
                                 f"{self.unquantized} {self.layers}")
        if self.pack is not None and (self.role is not Role.REPLICATED or len(self.pack) != 2
                                      or not 0 <= self.pack[0] < self.pack[1]):
            raise SpecTableError(f"{where}: pack needs the replicated role and (slot, parts) with 0 <= slot < "
                                 f"parts, got {self.role.value} {self.pack}")
        if self.head_rotate is not None and (self.role is not Role.REPLICATED
                                             or not set(self.head_rotate) <= SHAPE_SYMBOLS):
            raise SpecTableError(f"{where}: head_rotate needs the replicated role and two shape symbols, got "
                                 f"{self.role.value} {self.head_rotate}")

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.megatron

    @property
    def is_linear_weight(self) -> bool:
        """A linear layer's 2-D weight (what block-FP8 checkpoints quantize), see ``linear``."""
        if self.linear is not None:
            return self.linear
        return self.role not in (Role.REPLICATED, Role.VOCAB) and len(self.shape) == 2

    @property
    def quantized_hf(self) -> tuple[str, ...]:
        """The HF name templates block-FP8 checkpoints quantize (``is_linear_weight``, less ``unquantized``)."""
        if not self.is_linear_weight:
            return ()
        return tuple(t for k, t in enumerate(self.hf) if k not in self.unquantized)

    def matches(self, name: str) -> bool:
        """Whether ``name`` fits this row's pattern (conditions not considered)."""
        return self._regex.fullmatch(name) is not None

    @property
    def per_expert(self) -> bool:
        return "{expert}" in self.megatron

    @property
    def stage(self) -> Stage:
        if self.megatron.startswith(MTP_PREFIX):
            return Stage.MTP
        if self.per_layer:
            return Stage.LAYER
        return Stage.FIRST if self.megatron.startswith("embedding.") else Stage.LAST

    def active(self, conditions: frozenset[Condition], spelling: LayerSpec | None,
               expert_layout: ExpertLayout | None = None) -> bool:
        """Whether this row exists under ``conditions``, layer spec ``spelling`` and
        ``expert_layout`` (``None`` accepts any)."""
        if not self.requires <= conditions:
            return False
        if expert_layout is not None and self.expert_layout is not None and self.expert_layout != expert_layout:
            return False
        return spelling is None or self.spelling is None or self.spelling == spelling

    def megatron_name(self, layer: int | None = None, expert: int | None = None) -> str:
        """Megatron name for local layer ``layer`` and local expert ``expert``."""
        return self.megatron.format(layer=layer, expert=expert)

    def hf_names(self, layer: int | None = None, expert: int | None = None) -> tuple[str, ...]:
        """HF names for global layer ``layer`` and global expert ``expert``."""
        return tuple(t.format(layer=layer, expert=expert) for t in self.hf)


@dataclass(frozen=True)
class Match:
    """A Megatron name resolved against a table: the row and the local layer index."""

    spec: ParamSpec
    layer: int | None
    expert: int | None = None


@dataclass(frozen=True)
class FamilySpec:
    """A model family's table plus how its HF config turns rows on and off.

    Bias rules are ``True``/``False`` or the HF config key that holds the flag
    (e.g. Llama's ``attention_bias``), so the rule is data, not code.
    """

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    entries: tuple[ParamSpec, ...]
    qkv_bias: bool | str = False
    proj_bias: bool | str = False
    mlp_bias: bool | str = False
    tie_word_embeddings_default: bool = False
    qk_norm: bool | str = False  # True/False or the HF config key holding the flag
    # MoE: HF config keys (None: the family has no such setting)
    experts_key: str | None = None  # number of routed experts
    moe_ffn_key: str | None = None  # per-expert intermediate size
    shared_experts_key: str | None = None  # number of shared experts (x moe ffn)
    first_dense_key: str | None = None  # first k layers are dense (DeepSeek first_k_dense_replace)
    mlp_only_key: str | None = None  # explicit dense layers (Qwen3-MoE mlp_only_layers)
    sparse_step_key: str | None = None  # every n-th layer is MoE (Qwen3-MoE decoder_sparse_step)
    router_bias: bool | tuple[str, object] = False  # True/False, or (config key, value that means "on")
    mtp_key: str | None = None  # HF key counting multi-token-prediction layers (num_nextn_predict_layers)
    mla: bool = False  # multi-latent attention dims from q_lora_rank / kv_lora_rank / qk_*_head_dim / v_head_dim
    dsa_indexer: bool = False  # DSA lightning-indexer dims from index_n_heads / index_head_dim
    hybrid: bool = False  # Mamba2 hybrid: layer pattern and Mamba dims (see ModelDims.from_hf_config)
    shared_ffn_key: str | None = None  # per shared expert intermediate size, where not moe_ffn_key's
    gdn: bool = False  # gated-DeltaNet hybrid (Qwen3.5): linear_* dims, layer_types, a gated attention
    text_config: bool = False  # a vision-language checkpoint: the language model's dims are in ``text_config``
    hyper_connections: bool = False  # DeepSeek-V4: hc_mult, compress_ratios, hash layers, grouped output (ModelDims)
    # where the Megatron names come from when no megatron-core release builds the family (said beside plans)
    megatron_source: str | None = None
    # (HF config key, value) a block-FP8 config must hold, absent keys included (DeepSeek-V4: vLLM reads routed
    # experts as MXFP4 unless ``expert_dtype`` is ``fp8``)
    fp8_config_requires: tuple[tuple[str, object], ...] = ()
    # (HF config key, value): where the key is present it must hold the value, else the config is refused
    config_requires: tuple[tuple[str, object], ...] = ()
    # the router: its score function as Megatron-Core names it, and whether HF renormalises the top-k
    # probabilities (True / False, or (HF config key, its default when absent): Qwen3-MoE's norm_topk_prob)
    router_score: str = "softmax"
    router_renorm: bool | tuple[str, bool] = True
    # (TransformerConfig flag, values the table is written for) where they are not the flag's default
    # (megarefit.specs.megatron_flags): Qwen3.5's zero-centered norms, gpt-oss's sinks and offset GLU
    megatron_config: tuple[tuple[str, tuple[object, ...]], ...] = ()

    def __post_init__(self) -> None:
        for i, row in enumerate(self.entries):
            for other in self.entries[:i]:
                if other.megatron == row.megatron and not _exclusive(row, other):
                    raise SpecTableError(f"family {self.name}: rows for {row.megatron!r} can be active together")

    def rows(self, conditions: frozenset[Condition], spelling: LayerSpec | None = None,
             expert_layout: ExpertLayout | None = None) -> tuple[ParamSpec, ...]:
        return tuple(r for r in self.entries if r.active(conditions, spelling, expert_layout))

    def layer_index(self, name: str, stage: Stage = Stage.LAYER) -> int | None:
        """The local index in ``name`` of a decoder layer (``stage=Stage.LAYER``) or of an
        MTP layer (``Stage.MTP``), per this table's patterns (no role resolution);
        ``None`` for other or unknown names."""
        for row in self.entries:
            if row.stage is stage and (m := row._regex.fullmatch(name)) is not None:
                return int(m.group("layer"))
        return None

    def match(
        self, name: str, conditions: frozenset[Condition], spelling: LayerSpec | None = None, *, rank: object = None,
        expert_layout: ExpertLayout | None = None,
    ) -> Match:
        """Resolve one Megatron parameter name (local layer / expert indices in the result).

        Rows for different layer kinds may share a pattern (``pre_mlp_layernorm`` in
        dense and MoE layers); they resolve to one match when they agree on role,
        HF names and shape (rows of layer sets, ``layers``, on role and HF names: the
        shape is the layer's, which the name does not say).

        Raises:
            UnknownParameterError: no active row matches ``name``.
            AmbiguousParameterError: two different active rows match ``name``.
        """
        hits = []
        for row in self.entries:
            m = row._regex.fullmatch(name)
            if m is not None and row.active(conditions, spelling, expert_layout):
                layer = int(m.group("layer")) if row.per_layer else None
                expert = int(m.group("expert")) if row.per_expert else None
                hits.append(Match(row, layer, expert))
        where = f" on rank {rank}" if rank is not None else ""
        if not hits:
            raise UnknownParameterError(
                f"Megatron parameter {name!r}{where} matches no row of the {self.name} spec table "
                f"(active conditions: {sorted(c.value for c in conditions)})"
            )
        # rows of exclusive layer sets (DeepSeek-V4's compressors at ratio 4 / 128) differ in shape only: which
        # one a layer has is the model's (ModelDims.has_row), not the name's
        distinct = {(h.spec.role, h.spec.hf, h.spec.shape if h.spec.layers is None else None, h.spec.duplicate)
                    for h in hits}
        if len(distinct) > 1:
            raise AmbiguousParameterError(
                f"Megatron parameter {name!r}{where} matches {len(hits)} rows of the {self.name} "
                f"spec table: {[h.spec.megatron for h in hits]}"
            )
        return hits[0]


_EXCLUSIVE_SETS = {frozenset({"csa", "hca"}), frozenset({"hash", "learned"})}
_EXCLUSIVE = {frozenset({Condition.UNTIED, Condition.TIED_COPY}),
              frozenset({Condition.MTP_TRANSFORMER_LAYER, Condition.MTP_MODEL_LAYER}),
              frozenset({Condition.DSA_ROPE_LAST, Condition.DSA_ROPE_FIRST}),
              frozenset({Condition.MAMBA_CONV_MODULE, Condition.MAMBA_CONV_PARAMS})}


def _exclusive(a: ParamSpec, b: ParamSpec) -> bool:
    if a.spelling is not None and b.spelling is not None and a.spelling != b.spelling:
        return True
    if a.layer_kind is not None and b.layer_kind is not None and a.layer_kind != b.layer_kind:
        return True
    if a.expert_layout is not None and b.expert_layout is not None and a.expert_layout != b.expert_layout:
        return True
    if a.mixer is not None and b.mixer is not None and a.mixer != b.mixer:
        return True
    if frozenset({a.layers, b.layers}) in _EXCLUSIVE_SETS:
        return True
    return any(frozenset({x, y}) in _EXCLUSIVE for x in a.requires for y in b.requires)


_WRAPPER_PREFIXES = ("module.",)


def canonical_name(name: str) -> str | None:
    """Strip DDP/FSDP/Float16Module ``module.`` prefixes; ``None`` for ``_extra_state`` entries
    (Transformer-Engine / Megatron state-dict metadata, not weights)."""
    while name.startswith(_WRAPPER_PREFIXES):
        name = name[len("module."):]
    if name.endswith("._extra_state") or name == "_extra_state":
        return None
    return name
