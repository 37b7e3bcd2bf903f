"""One vLLM worker's parameters: names, local shapes, and where each HF tensor lands.

A vLLM worker is placed by vLLM's parallel config (:class:`VllmTarget`): its
tensor-parallel rank ``t`` of ``T`` (attention, dense MLPs, vocab), and for the
routed experts vLLM's own rules (``FusedMoEParallelConfig.make``): without expert
parallelism the experts are tensor-parallel over all ``T*D`` workers of the DP
group (rank ``d*T + t``); with ``enable_expert_parallel`` each worker holds whole
experts, EP size ``T*D``, EP rank ``d*T + t``, placed ``linear`` or ``round_robin``
(``determine_expert_map``), or as an explicit expert map read from the engine.

Dense parts (vLLM's ``QKVParallelLinear``, ``MergedColumnParallelLinear``,
``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding`` /
``ParallelLMHead``, as their ``weight_loader``s fill them from full HF tensors)::

    qkv_proj      [q heads of t; k heads of t; v heads of t] rows   (kv heads replicated
                  when T > kv heads: rank t holds kv head t // (T / kv_heads))
    gate_up_proj  [gate.chunk(T)[t]; up.chunk(T)[t]] rows   (dense MLP, shared experts)
    q_b_proj, kv_b_proj, q_proj (MLA)   rows chunk t (column-parallel)
    wq_b, wo_a (DeepSeek-V4)            rows chunk t (wo_a: whole in Megatron, tp 1)
    o_proj, down_proj   columns chunk t (row-parallel)
    embed_tokens, lm_head   rows [t*P, (t+1)*P) of the vocab padded to a multiple of 64
                  (P = padded / T); rows past vocab_size are zero
    norms, router gate, e_score_correction_bias   whole (replicated)

MLA down-projections are ``ReplicatedLinear`` in vLLM (Megatron's local spec splits
them over tp); with ``q_lora_rank`` vLLM stacks them (``DeepSeekV2FusedQkvAProjLinear``)::

    fused_qkv_a_proj  [q_lora + kv_lora + rope, hidden] = [q_a_proj; kv_a_proj_with_mqa]

GLM-5's DSA indexer is replicated on every worker; vLLM fuses two of its linears
(``MergedColumnParallelLinear(..., disable_tp=True)``)::

    indexer.wk_weights_proj  [index_head_dim + index_heads, hidden] = [indexer.wk; indexer.weights_proj]

Routed experts (``FusedMoE``; E_l experts on this worker, slot j holds global expert
``local_experts[j]``; I_p = moe_intermediate_size / moe_tp, moe_tp = 1 under EP)::

    experts.routed_experts.w13_weight  [E_l, 2*I_p, hidden]
        slot j = [ gate_proj(e_j) rows chunk r ;      r = this worker's moe rank
                   up_proj(e_j)   rows chunk r ]
    experts.routed_experts.w2_weight   [E_l, hidden, I_p]
        slot j = down_proj(e_j) columns chunk r

gpt-oss's experts (vLLM ``gpt_oss.py``, bf16) carry biases and keep gate / up interleaved
row by row (its ``swigluoai`` activation reads them so); the plan's pivot holds them
``out_in`` (:func:`~megarefit.layout.geometry.fused_shapes`), so every part is a plain box::

    experts.routed_experts.w13_weight  [E_l, 2*I_p, hidden]  viewed [E_l, I_p, 2, hidden]
        slot j = gate_up(e_j) rows [r*I_p, (r+1)*I_p) of [E, I, 2, hidden], gate / up interleaved
    experts.routed_experts.w13_bias    [E_l, 2*I_p]          viewed [E_l, I_p, 2], the same rows
    experts.routed_experts.w2_weight   [E_l, hidden, I_p]    down(e_j) columns chunk r
    experts.routed_experts.w2_bias     [E_l, hidden]         down_bias(e_j) on moe rank 0; zero on
                                                             the others (vLLM adds it once)

and vLLM names its attention ``attn`` and its embedding ``embedding`` (``model.layers.L.attn.sinks``,
``model.embedding.weight``).

Under sequence-parallel MoE (EP with T > 1 and D > 1, vLLM's default all2all backend)
DeepSeek-V3's shared experts are not split (``disable_tp``): whole on every worker.

A worker's **draft model** (``VllmTarget(draft=True)``: vLLM's MTP drafters ``DeepSeekMTP``,
``Glm4MoeMTP``, as ``/start_draft_weight_update`` retargets the update to them) holds the
MTP layers only, under their HF index ``N + i`` (N = ``num_hidden_layers``)::

    model.layers.{N+i}.enorm / hnorm / shared_head.norm .weight   [hidden]      whole
    model.layers.{N+i}.eh_proj.weight                              [hidden, 2*hidden]  whole
                        (a plain ``nn.Linear`` in vLLM; Megatron splits it over tp)
    model.layers.{N+i}.mtp_block.<decoder-layer parameter>         as in a decoder layer

The drafter's embedding and head (``model.embed_tokens``, ``shared_head.head``) are the
target model's own modules in a running engine (the proposer shares them): a draft
update leaves them to the target's update.

Each vLLM parameter is a list of :class:`VllmPiece` -- a box of one HF tensor placed
at a box of the parameter (with leading expert-slot dims for FusedMoE) -- computed
from the spec table's roles and HF names; the few facts the roles do not imply
(MLA's replicated, fused down-projections; shared experts under sequence-parallel
MoE; FusedMoE names) are the small tables below.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from megarefit.errors import LayoutError, UnsupportedModelError
from megarefit.layout import Box, SourceLayout
from megarefit.layout.dims import ModelDims
from megarefit.layout.geometry import hf_shapes
from megarefit.specs.table import MTP_PREFIX, ParamSpec, Role, Stage

VLLM_VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE

ExpertPlacement = Literal["linear", "round_robin"]
EXPERT_PLACEMENTS: tuple[ExpertPlacement, ...] = ("linear", "round_robin")

# FusedMoE keeps its weights in a ``RoutedExperts`` submodule (vLLM >= 0.2x):
# ``mlp.experts.routed_experts.w13_weight``. Older vLLM spells ``mlp.experts.w13_weight``;
# the sharded install resolves either against the live model.
FUSED_MOE_W13, FUSED_MOE_W2 = "routed_experts.w13_weight", "routed_experts.w2_weight"
# gpt-oss's fused HF expert tensors -> FusedMoE parameters (with biases)
_FUSED_MOE_NAMES = {"gate_up_proj": FUSED_MOE_W13, "gate_up_proj_bias": "routed_experts.w13_bias",
                    "down_proj": FUSED_MOE_W2, "down_proj_bias": "routed_experts.w2_bias"}
# vLLM model classes that spell HF module names differently: (HF part, vLLM part) per family
_VLLM_RENAMES = {"gpt_oss": (("model.embed_tokens.", "model.embedding."), (".self_attn.", ".attn.")),
                 # DeepSeek-V4: shared experts stacked into gate_up_proj (named after w1), the learned router bias
                 "deepseek_v4": ((".shared_experts.w1.", ".shared_experts.gate_up_proj."),
                                 (".shared_experts.w2.", ".shared_experts.down_proj."),
                                 (".ffn.gate.bias", ".ffn.gate.e_score_correction_bias")),
                 "nemotron_h": (("backbone.", "model."), (".embeddings.", ".embed_tokens."), (".mixer.A_log", ".mixer.A")),
                 # vision-language checkpoints: vLLM's Qwen3VLForConditionalGeneration.hf_to_vllm_mapper
                 **dict.fromkeys(("qwen3_5_vl", "qwen3_5_moe_vl"), (("model.language_model.", "language_model.model."),
                                                                  ("lm_head.", "language_model.lm_head.")))}
# ... whose HF names lack the ``model.`` prefix: (HF prefix, vLLM prefix), matched at the start of a name only
# (DeepSeek-V4's checkpoint names, as vLLM's DeepseekV4ForCausalLM.load_weights maps them)
_VLLM_PREFIX_RENAMES = {"deepseek_v4": (("layers.", "model.layers."), ("embed.", "model.embed_tokens."),
                                        ("head.", "lm_head."), ("norm.", "model.norm."),
                                        ("hc_head_", "model.hc_head_"))}
# HF tensors vLLM stores transformed (a ValueStep in the plan): name suffix -> value function
_VLLM_VALUES = {".mixer.A_log": "neg_exp",  # MambaMixer2: A = -exp(A_log.float()), float32
                ".linear_attn.A_log": "as_float32"}  # Qwen3.5's gated DeltaNet holds A_log in float32
# ... per family: MiniMax-M2's router gate (vLLM GateLinear, params_dtype float32)
_VLLM_FAMILY_VALUES = {"minimax_m2": {".block_sparse_moe.gate.weight": "as_float32"}}

# vLLM stacks a multi-tensor role's HF tensors (in the spec row's order: q, k, v / gate,
# up) into one parameter, named after the first with this part replaced.
_VLLM_STACKED = {Role.QKV: ("q_proj", "qkv_proj"), Role.GATED_QKV: ("q_proj", "qkv_proj"),
                 Role.GATED_MLP: ("gate_proj", "gate_up_proj")}
# A segmented row over several HF tensors: the vLLM parameters its segments stack into, in order, as
# (name replacing the first HF name's last two parts, segments) -- Qwen3.5's gated DeltaNet: vLLM
# ``in_proj_qkvz`` [Q_t; K_t; V_t; Z_t] and ``in_proj_ba`` [b_t; a_t] (MergedColumnParallelLinear)
_VLLM_SEGMENT_PARAMS = {"linear_attn.in_proj_qkv.weight": (("linear_attn.in_proj_qkvz.weight", 4),
                                                           ("linear_attn.in_proj_ba.weight", 2))}

# MLA (vLLM deepseek_v2.py): the down-projections are ReplicatedLinear whatever Megatron's
# spec does, and with q_lora_rank the two are one DeepSeekV2FusedQkvAProjLinear.
_VLLM_REPLICATED = ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight")
# ... and the reverse: replicated in Megatron, rows chunk t in vLLM (DeepSeek-V4's grouped output ``wo_a``, a
# ColumnParallelLinear in vLLM; a bare Parameter on the Megatron dev branch, which runs at tp 1)
_VLLM_COLUMN = ("attn.wo_a.weight",)
# vLLM parameters that stack two replicated HF tensors (first on top), where both exist.
_VLLM_FUSED = (
    ("self_attn.fused_qkv_a_proj.weight", ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight")),
    ("self_attn.indexer.wk_weights_proj.weight", ("self_attn.indexer.wk.weight",
                                                  "self_attn.indexer.weights_proj.weight")),
    # DeepSeek-V4 (vLLM deepseek_v4): the low-rank query's and the KV's down-projections; a KV compressor's
    # two projections (the attention's and its indexer's; never quantized)
    ("attn.fused_wqa_wkv.weight", ("attn.wq_a.weight", "attn.wkv.weight")),
    ("compressor.fused_wkv_wgate.weight", ("compressor.wkv.weight", "compressor.wgate.weight")),
)

# An MTP layer's own modules in vLLM's drafters (models/deepseek_mtp.py ``_rewrite_spec_layer_name``):
# everything else of the layer is its decoder block, ``mtp_block.``.
_MTP_OWN_MODULES = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")

# Families whose vLLM shared experts follow sequence-parallel MoE (DeepseekV2MoE passes
# is_sequence_parallel -> disable_tp; GLM-5 is served by vLLM's DeepSeek-V3.2 model, the same
# MoE; Qwen3.5's shared expert is a Qwen2MoeMLP given is_sequence_parallel); GLM-4.5's Glm4MoeMLP
# always splits over tp.
_SHARED_EXPERTS_FOLLOW_SP_MOE = frozenset({"deepseek_v3", "glm_moe_dsa", "qwen3_5_moe", "qwen3_5_moe_vl"})


@dataclass(frozen=True)
class VllmTarget:
    """One vLLM worker, as vLLM's parallel config places it.

    Attributes:
        tp, rank: ``tensor_parallel_size`` and this worker's tensor-parallel rank.
        dp, dp_rank: ``data_parallel_size`` and this worker's data-parallel rank (MoE
            layers span the whole ``tp * dp`` group; attention is per DP replica).
        expert_parallel: vLLM's ``enable_expert_parallel``.
        expert_placement: vLLM's ``expert_placement_strategy`` (``linear``, ``round_robin``).
        expert_map: vLLM's global -> local expert map of this worker (``-1`` where another
            worker holds the expert), as read from the engine; overrides the placement rule.
            With ``physical_to_logical`` its entries are *physical* expert ids.
        physical_to_logical: vLLM's expert-parallel load balancer (EPLB) placement, as its
            ``EplbModelState.physical_to_logical_map`` holds it: per MoE layer (in layer
            order), the logical expert in each global physical slot (``num_experts +
            num_redundant_experts`` of them; a logical expert may sit in several). The
            worker's physical slots follow ``expert_map`` or the placement rule over the
            physical count; each slot gets its layer's logical expert. ``None``: no EPLB.
        vocab_padding: vLLM's vocab padding (``DEFAULT_VOCAB_PADDING_SIZE``).
        draft: the worker's MTP draft model (speculative decoding ``method="mtp"``), not its
            target model: the MTP layers only, named as vLLM's drafters name them (module
            docstring). Its expert map and EPLB placements are the drafter's own (its MoE
            layers: one per MTP layer).

    Raises:
        LayoutError: a rank outside its size, an unknown placement, an expert map
            without expert parallelism, EPLB maps without it or of unequal widths.
    """

    tp: int
    rank: int
    dp: int = 1
    dp_rank: int = 0
    expert_parallel: bool = False
    expert_placement: ExpertPlacement = "linear"
    expert_map: tuple[int, ...] | None = None
    physical_to_logical: tuple[tuple[int, ...], ...] | None = None
    vocab_padding: int = VLLM_VOCAB_PADDING
    draft: bool = False

    def __post_init__(self) -> None:
        for size, rank, what in ((self.tp, self.rank, "tp"), (self.dp, self.dp_rank, "dp")):
            if not (isinstance(size, int) and size >= 1 and isinstance(rank, int) and 0 <= rank < size):
                raise LayoutError(f"vLLM target {what} rank {rank} of {what}={size} is not a valid rank")
        if self.expert_placement not in EXPERT_PLACEMENTS:
            raise LayoutError(f"vLLM expert_placement {self.expert_placement!r}: expected one of {EXPERT_PLACEMENTS}")
        if self.expert_map is not None:
            object.__setattr__(self, "expert_map", tuple(int(i) for i in self.expert_map))
            if self.ep_size == 1:
                raise LayoutError("an expert map needs expert parallelism (expert_parallel=True and tp*dp > 1)")
        if self.physical_to_logical is not None:
            maps = tuple(tuple(int(e) for e in layer) for layer in self.physical_to_logical)
            object.__setattr__(self, "physical_to_logical", maps)
            if self.ep_size == 1:
                raise LayoutError("EPLB placements need expert parallelism (expert_parallel=True and tp*dp > 1)")
            if not maps or len({len(m) for m in maps}) != 1:
                raise LayoutError(f"EPLB physical_to_logical maps must be one per MoE layer, all as wide as the "
                                  f"physical expert count; got widths {sorted({len(m) for m in maps})}")

    @property
    def ep_size(self) -> int:
        """vLLM's EP size: ``tp * dp`` with expert parallelism, else 1."""
        return self.tp * self.dp if self.expert_parallel and self.tp * self.dp > 1 else 1

    @property
    def ep_rank(self) -> int:
        return self.dp_rank * self.tp + self.rank if self.ep_size > 1 else 0

    @property
    def moe_tp(self) -> int:
        """Tensor-parallel size of the routed experts: 1 under EP, else ``tp * dp``."""
        return 1 if self.ep_size > 1 else self.tp * self.dp

    @property
    def moe_rank(self) -> int:
        return 0 if self.ep_size > 1 else self.dp_rank * self.tp + self.rank

    @property
    def sequence_parallel_moe(self) -> bool:
        """vLLM's ``ParallelConfig.use_sequence_parallel_moe`` with its default all2all backend."""
        return self.expert_parallel and self.tp > 1 and self.dp > 1

    def local_experts(self, num_experts: int, moe_layer: int | None = None) -> tuple[int, ...]:
        """The routed (logical) expert in each of this worker's FusedMoE slots (slot j -> expert).

        With EPLB (``physical_to_logical``), ``moe_layer`` (the index among MoE layers)
        picks that layer's placement; without it, the sorted experts of any layer (what
        the worker's HF plan must hold). Redundant experts repeat.

        Raises:
            LayoutError: the expert map has the wrong length or its local slots are not
                ``0..n-1`` once each; an EPLB map names an expert outside the model or
                lacks the layer; a worker would hold no expert.
        """
        p2l = self.physical_to_logical
        physical = num_experts if p2l is None else len(p2l[0])
        if self.expert_map is not None:
            if len(self.expert_map) != physical:
                raise LayoutError(f"vLLM expert map has {len(self.expert_map)} entries, the model "
                                  f"{physical} {'physical' if p2l is not None else 'routed'} experts")
            slots = {local: g for g, local in enumerate(self.expert_map) if local >= 0}
            if sorted(slots) != list(range(len(slots))) or len(slots) != sum(i >= 0 for i in self.expert_map):
                raise LayoutError(f"vLLM expert map {list(self.expert_map)} does not give local slots 0..n-1 "
                                  "once each (redundant experts: pass the EPLB physical_to_logical maps)")
            experts = tuple(slots[j] for j in range(len(slots)))
        elif self.ep_size == 1:
            experts = tuple(range(physical))
        else:  # vLLM determine_expert_map: the first `remainder` ranks get one more
            base, remainder = divmod(physical, self.ep_size)
            n = base + (1 if self.ep_rank < remainder else 0)
            if self.expert_placement == "linear":
                start = self.ep_rank * base + min(self.ep_rank, remainder)
                experts = tuple(range(start, start + n))
            else:
                experts = tuple(range(self.ep_rank, physical, self.ep_size))
        if not experts:
            raise LayoutError(f"vLLM EP rank {self.ep_rank} of {self.ep_size} holds none of the {physical} "
                              "routed experts")
        if p2l is None:
            return experts
        bad = sorted({e for m in p2l for e in m if not 0 <= e < num_experts})
        if bad:
            raise LayoutError(f"EPLB physical_to_logical names experts {bad[:8]} outside the model's {num_experts}")
        if moe_layer is None:
            return tuple(sorted({m[p] for m in p2l for p in experts}))
        if not 0 <= moe_layer < len(p2l):
            raise LayoutError(f"EPLB placements cover {len(p2l)} MoE layers, asked for MoE layer {moe_layer}")
        return tuple(p2l[moe_layer][p] for p in experts)


@dataclass(frozen=True)
class VllmPiece:
    """``param[param_box] = hf_tensor[hf_box]``; ``param_box`` may have leading
    expert-slot dims of length 1 that ``hf_box`` lacks."""

    hf_name: str
    hf_box: Box
    param_box: Box


@dataclass(frozen=True)
class VllmParam:
    """A vLLM parameter on one worker: its local shape (elements) and what fills it;
    ``storage``: the stored shape where ``shape`` is a row-major view of it (gpt-oss's
    interleaved ``w13``), else ``None``. What no piece fills is zero."""

    shape: tuple[int, ...]
    pieces: tuple[VllmPiece, ...]
    storage: tuple[int, ...] | None = None
    value_fn: str | None = None  # the parameter is fn(pieces) (a ValueStep: Mamba's A = -exp(A_log)), float32


def _split(n: int, parts: int, what: str, group: str = "tp") -> int:
    if n % parts:
        raise LayoutError(f"{what}={n} does not split over vLLM {group}={parts}")
    return n // parts


def _stacked(parts: list[tuple[str, tuple[int, ...], int, int]], lead: tuple[int, ...] = ()) -> VllmParam:
    """Rows ``[first, first+n)`` of each HF tensor ``(name, shape, first, n)``, stacked on the
    parameter's first non-slot dim; ``lead``: the expert slot's index (FusedMoE)."""
    rows, pieces = 0, []
    for name, shape, first, n in parts:
        rest = tuple(shape[1:])
        pieces.append(VllmPiece(name, Box.rows(shape, first, n),
                                Box(lead + (rows,) + (0,) * len(rest), (1,) * len(lead) + (n,) + rest)))
        rows += n
    return VllmParam((rows,) + tuple(parts[0][1][1:]), tuple(pieces))


def _whole(name: str, shape: tuple[int, ...]) -> VllmParam:
    return VllmParam(shape, (VllmPiece(name, Box.full(shape), Box.full(shape)),))


def _split_group(row: ParamSpec, dims: ModelDims, target: VllmTarget) -> tuple[int, int, str]:
    """(size, rank, name) of the vLLM group that splits this row's tensors."""
    if row.role.is_expert:
        return target.moe_tp, target.moe_rank, "moe tp (tp*dp)"
    shared = "shared_ffn" in row.shape or "2shared_ffn" in row.shape
    if shared and target.sequence_parallel_moe and dims.family in _SHARED_EXPERTS_FOLLOW_SP_MOE:
        return 1, 0, "tp"
    return target.tp, target.rank, "tp"


def _dense(row: ParamSpec, named: list[tuple[str, tuple[int, ...]]], dims: ModelDims, target: VllmTarget,
           out: dict[str, VllmParam]) -> None:
    T, t, group = _split_group(row, dims, target)
    if row.role is Role.SEGMENTED:
        (_segmented_params if row.segment_hf else _segmented)(row, named, dims, T, t, out)  # type: ignore[operator]
        return
    if any(name.endswith(_VLLM_REPLICATED) for name, _ in named):
        for name, shape in named:
            out[name] = _whole(name, shape)
        return
    if row.role in (Role.QKV, Role.GATED_QKV):
        _qkv(row, named, dims, T, t, out)
    elif row.role is Role.GATED_MLP:  # gate chunk t, then up chunk t
        out[named[0][0].replace(*_VLLM_STACKED[Role.GATED_MLP])] = _stacked(
            [(n, s, t * _split(s[0], T, f"{n} rows", group), _split(s[0], T, f"{n} rows", group)) for n, s in named])
    elif row.role is Role.COLUMN and row.shape == ("kv",):  # MiniMax-M2's K norm: as qkv_proj's k rows
        kv_local, kv_start = _kv_heads(dims, T, t)
        for name, shape in named:
            out[name] = _stacked([(name, shape, kv_start * dims.head_dim, kv_local * dims.head_dim)])
    elif row.role is Role.COLUMN or any(name.endswith(_VLLM_COLUMN) for name, _ in named):
        if row.role is not Role.COLUMN and dims.o_groups % T:  # a rank's rows must be whole groups
            raise LayoutError(f"{named[0][0]}: vLLM tp={T} must divide o_groups={dims.o_groups} (each rank holds "
                              "whole groups of DeepSeek-V4's grouped output)")
        for name, shape in named:
            n = _split(shape[0], T, f"{name} rows", group)
            out[name] = _stacked([(name, shape, t * n, n)])
    elif row.role is Role.ROW:
        for name, shape in named:
            n = _split(shape[1], T, f"{name} columns", group)
            out[name] = VllmParam((shape[0], n), (VllmPiece(name, Box((0, t * n), (shape[0], n)),
                                                            Box.full((shape[0], n))),))
    elif row.role is Role.VOCAB:
        for name, shape in named:
            padded = -(-shape[0] // target.vocab_padding) * target.vocab_padding
            per = padded // T
            start, stop = t * per, min((t + 1) * per, shape[0])
            local = (per,) + tuple(shape[1:])
            out[name] = VllmParam(local, (VllmPiece(name, Box.rows(shape, start, stop - start),
                                                    Box.rows(local, 0, stop - start)),) if stop > start else ())
    elif row.role is Role.REPLICATED:
        for name, shape in named:
            out[name] = _whole(name, shape)
    else:
        raise UnsupportedModelError(f"{named[0][0]}: role {row.role.value} has no vLLM shard rule")
    values = _VLLM_VALUES | _VLLM_FAMILY_VALUES.get(dims.family, {})
    for name, _ in named:
        fn = next((f for suffix, f in values.items() if name.endswith(suffix)), None)
        if fn is not None and name in out:
            out[name] = VllmParam(out[name].shape, out[name].pieces, value_fn=fn)


def _qkv(row: ParamSpec, named: list[tuple[str, tuple[int, ...]]], dims: ModelDims, T: int, t: int,
         out: dict[str, VllmParam]) -> None:
    """``qkv_proj`` (``QKVParallelLinear``): rank t's q heads, then its k and v heads (a kv head
    replicated over ``T / kv`` ranks when ``T`` exceeds the kv heads); a gated attention's q head is
    ``q_proj``'s [q_h; gate_h] rows (vLLM builds it with twice the heads, Qwen3-Next / Qwen3.5)."""
    d = dims.head_dim
    q_rows = 2 * d if row.role is Role.GATED_QKV else d
    heads = _split(dims.num_attention_heads, T, "num_attention_heads")
    kv_local, kv_start = _kv_heads(dims, T, t)
    (qn, qs), (kn, ks), (vn, vs) = named
    out[qn.replace(*_VLLM_STACKED[row.role])] = _stacked(
        [(qn, qs, t * heads * q_rows, heads * q_rows), (kn, ks, kv_start * d, kv_local * d),
         (vn, vs, kv_start * d, kv_local * d)])


def _kv_heads(dims: ModelDims, T: int, t: int) -> tuple[int, int]:
    """``(kv heads, first kv head)`` of tp rank ``t`` of ``T`` (``QKVParallelLinear``; MiniMax-M2's
    ``k_norm``): a split of the kv heads, or one head replicated over ``T / kv`` ranks.

    Raises:
        LayoutError: ``T`` neither divides nor is a multiple of the kv heads."""
    kv = dims.num_query_groups
    if T >= kv:
        if T % kv:
            raise LayoutError(f"vLLM tp={T} must be a multiple of num_key_value_heads={kv} (or divide it)")
        return 1, t // (T // kv)
    kv_local = _split(kv, T, "num_key_value_heads")
    return kv_local, t * kv_local


def _segmented_params(row: ParamSpec, named: list[tuple[str, tuple[int, ...]]], dims: ModelDims, T: int, t: int,
                      out: dict[str, VllmParam]) -> None:
    """A segmented row over several HF tensors (Qwen3.5's gated DeltaNet ``in_proj``): each segment's
    rows chunk ``t`` of ``T``, stacked into the vLLM parameters :data:`_VLLM_SEGMENT_PARAMS` names;
    HF tensors packed per group (Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``): each its rows chunk ``t``,
    under its own name (vLLM keeps the packing and unpacks it in ``forward``).

    Raises:
        UnsupportedModelError: no vLLM parameters are known for the row.
        LayoutError: a segment does not split over ``T``.
    """
    if row.segment_groups is not None:  # packed per group (Qwen3-Next, vLLM ``gqa_interleaved_layout``): the
        for name, shape in named:      # HF tensor's rows chunk t, whole groups, as one output shard
            n = _split(shape[0], T, f"{name} rows", "tp")
            out[name] = _stacked([(name, shape, t * n, n)])
        return
    first = named[0][0]
    key = next((k for k in _VLLM_SEGMENT_PARAMS if first.endswith(k)), None)
    if key is None:
        raise UnsupportedModelError(f"{first}: no vLLM parameters known for its segments")
    starts = [0] * len(named)
    parts = []
    for sym, k in zip(row.segments, row.segment_hf):
        name, shape = named[k]
        n = _split(dims.size(sym), T, f"{name} part {sym}={dims.size(sym)}", "tp")
        parts.append((name, shape, starts[k] + t * n, n))
        starts[k] += dims.size(sym)
    for param, count in _VLLM_SEGMENT_PARAMS[key]:
        out[first[:-len(key)] + param] = _stacked(parts[:count])
        parts = parts[count:]


def _segmented(row: ParamSpec, named: list[tuple[str, tuple[int, ...]]], dims: ModelDims, T: int, t: int,
               out: dict[str, VllmParam]) -> None:
    """Mamba's ``in_proj`` / ``conv1d`` (vLLM ``MambaMixer2``'s merged column-parallel layers): each
    segment's rows chunk ``t`` of ``T``, stacked; with ``n_groups == 1`` and ``T > 1`` vLLM keeps B and
    C whole on every rank.

    Raises:
        LayoutError: a segment does not split over ``T`` (vLLM asserts ``n_groups % tp == 0`` or 1 group).
    """
    name, shape = named[0]
    parts, start = [], 0
    for sym in row.segments:
        size = dims.size(sym)
        if sym == "mamba_gs" and dims.mamba_groups == 1 and T > 1:
            parts.append((name, shape, start, size))  # one group: replicated
        else:
            n = _split(size, T, f"{name} part {sym}={size}", "tp")
            parts.append((name, shape, start + t * n, n))
        start += size
    out[name] = _stacked(parts)


def _experts(row: ParamSpec, layer: int, dims: ModelDims, target: VllmTarget, slots: tuple[int, ...],
             out: dict[str, VllmParam]) -> None:
    """FusedMoE ``w13_weight`` (gated fc1 rows) or ``w2_weight`` (fc2 columns) of one layer."""
    T, r, group = _split_group(row, dims, target)
    template = row.hf[0]
    prefix = template[:template.index("{expert}")].format(layer=layer)
    ffn = _split(dims.moe_ffn_hidden_size, T, "moe_intermediate_size", group)
    h = dims.hidden_size
    if row.role in (Role.EXPERT_GATED_MLP, Role.GROUPED_EXPERT_FC1, Role.EXPERT_COLUMN):
        param = prefix + FUSED_MOE_W13  # non-gated experts (Nemotron-H relu2): up_proj alone
        shape: tuple[int, ...] = (len(slots), len(row.hf) * ffn, h)
        pieces = [p for j, e in enumerate(slots)
                  for p in _stacked([(n, (dims.moe_ffn_hidden_size, h), r * ffn, ffn) for n in row.hf_names(layer, e)],
                                    lead=(j,)).pieces]
    else:
        param = prefix + FUSED_MOE_W2
        shape = (len(slots), h, ffn)
        pieces = [VllmPiece(row.hf_names(layer, e)[0], Box((0, r * ffn), (h, ffn)), Box((j, 0, 0), (1, h, ffn)))
                  for j, e in enumerate(slots)]
    out[param] = VllmParam(shape, tuple(pieces))


def _fused_experts(row: ParamSpec, layer: int, dims: ModelDims, target: VllmTarget, slots: tuple[int, ...],
                   out: dict[str, VllmParam]) -> None:
    """gpt-oss's FusedMoE ``w13_weight`` / ``w13_bias`` / ``w2_weight`` / ``w2_bias`` of one layer
    from the ``out_in`` pivot (module docstring), whose expert dim holds the worker's experts
    (EP: the sorted set it owns; else all of them)."""
    T, r, group = _split_group(row, dims, target)
    hf_name = row.hf_names(layer)[0]
    prefix, _, leaf = hf_name.rpartition(".")
    f, h = _split(dims.moe_ffn_hidden_size, T, "intermediate_size", group), dims.hidden_size
    owned = sorted(set(slots)) if target.ep_size > 1 else None
    pos = [owned.index(e) if owned is not None else e for e in slots]
    n = len(slots)
    if leaf == "down_proj_bias":  # vLLM loads it on moe rank 0 only (the others add zero)
        pieces = [VllmPiece(hf_name, Box((p, 0), (1, h)), Box((j, 0), (1, h))) for j, p in enumerate(pos)] \
            if r == 0 else []
        out[f"{prefix}.{_FUSED_MOE_NAMES[leaf]}"] = VllmParam((n, h), tuple(pieces))
        return
    view = {"gate_up_proj": (n, f, 2, h), "gate_up_proj_bias": (n, f, 2), "down_proj": (n, h, f)}[leaf]
    box = {"gate_up_proj": ((r * f, 0, 0), (f, 2, h)), "gate_up_proj_bias": ((r * f, 0), (f, 2)),
           "down_proj": ((0, r * f), (h, f))}[leaf]
    storage = {"gate_up_proj": (n, 2 * f, h), "gate_up_proj_bias": (n, 2 * f)}.get(leaf)
    pieces = [VllmPiece(hf_name, Box((p,) + box[0], (1,) + box[1]), Box((j,) + (0,) * len(box[1]), (1,) + box[1]))
              for j, p in enumerate(pos)]
    out[f"{prefix}.{_FUSED_MOE_NAMES[leaf]}"] = VllmParam(view, tuple(pieces), storage)


def _fuse(out: dict[str, VllmParam]) -> dict[str, VllmParam]:
    """Stack the replicated pairs of :data:`_VLLM_FUSED` (MLA's down-projections into
    ``fused_qkv_a_proj``, the DSA indexer's ``wk`` and ``weights_proj``) where both exist."""
    for fused, (first, second) in _VLLM_FUSED:
        result: dict[str, VllmParam] = {}
        for name, param in out.items():
            if name.endswith(second) and name[:-len(second)] + first in out:
                continue  # folded into the fused parameter below
            if name.endswith(first) and name[:-len(first)] + second in out:
                prefix = name[:-len(first)]
                parts = [out[prefix + first].pieces[0], out[prefix + second].pieces[0]]
                result[prefix + fused] = _stacked([(p.hf_name, p.hf_box.lengths, 0, p.hf_box.lengths[0])
                                                   for p in parts])
                continue
            result[name] = param
        out = result
    return out


@lru_cache(maxsize=64)
def vllm_params(dims: ModelDims, target: VllmTarget) -> dict[str, VllmParam]:
    """vLLM parameter name -> :class:`VllmParam` of worker ``target``, in HF order.

    Names are vLLM's ``named_parameters()`` names (vLLM 0.2x-0.32 spelling), shapes are
    the worker's local shapes in vLLM's checkpoint ("model") format, before any
    ``process_weights_after_loading``. The target model has no MTP layers (vLLM loads
    them into a separate draft model); a ``draft`` target has only them.

    Raises:
        LayoutError: heads / ffn / moe_intermediate_size / hidden do not split over the
            worker's tensor-parallel group; a bad expert map or placement; a draft target
            of a model without MTP layers (``num_nextn_predict_layers`` 0).
    """
    hf_layout = SourceLayout.build(tp=1, pp=1, padded_vocab_size=dims.vocab_size, num_layers=dims.num_layers)
    rows = [r for r in dims.spec.rows(dims.conditions(1), "local", "sequential")
            if not r.duplicate and (r.stage is Stage.MTP) == target.draft]
    layers = _layers(dims, target)
    moe_layers = [layer for layer in layers if dims.layer_kind(layer) == "moe"]
    if target.physical_to_logical is not None and len(target.physical_to_logical) != len(moe_layers):
        raise LayoutError(f"EPLB placements for {len(target.physical_to_logical)} MoE layers, the "
                          f"{'draft ' if target.draft else ''}model has {len(moe_layers)}")
    slots = {layer: target.local_experts(dims.num_experts, m) for m, layer in enumerate(moe_layers)}
    out: dict[str, VllmParam] = {}
    order = [(row, None) for row in rows if row.stage is Stage.FIRST]  # embedding, then layer by layer, then head
    order += [(row, layer) for layer in layers for row in rows if row.stage in (Stage.LAYER, Stage.MTP)
              and dims.has_row(row, layer)]
    order += [(row, None) for row in rows if row.stage is Stage.LAST]
    for row, layer in order:
        named = list(zip(row.hf_names(layer), hf_shapes(row, dims, hf_layout)))
        if row.role.is_fused:
            _fused_experts(row, layer, dims, target, slots[layer], out)  # type: ignore[index]
        elif row.role.is_expert:
            _experts(row, layer, dims, target, slots[layer], out)  # type: ignore[index]
        elif _mtp_own(row):  # whole on every worker, eh_proj included
            out.update((name, _whole(name, shape)) for name, shape in named)
        else:
            _dense(row, named, dims, target, out)
    renames = _VLLM_RENAMES.get(dims.family, ())
    prefixes = _VLLM_PREFIX_RENAMES.get(dims.family, ())
    fused = _fuse(out)
    if target.draft:
        fused = {_draft_name(name): param for name, param in fused.items()}
    return {_prefixed(_renamed(name, renames), prefixes): param for name, param in fused.items()}


def _layers(dims: ModelDims, target: VllmTarget) -> list[int]:
    """The global (HF) layer indices ``target`` holds: the decoder's, or a draft's MTP layers."""
    if not target.draft:
        return list(range(dims.num_layers))
    dims.check_draft()
    return [dims.num_layers + i for i in range(dims.mtp_layers)]


def _mtp_own(row: ParamSpec) -> bool:
    """An MTP layer's own tensor (enorm, hnorm, eh_proj, final norm), not its decoder block's."""
    return row.stage is Stage.MTP and not row.megatron.startswith(MTP_PREFIX + "{layer}.transformer_layer.")


def _draft_name(name: str) -> str:
    """An MTP layer's HF name as vLLM's drafter names it: its decoder block under ``mtp_block.``."""
    m = _LAYER_NAME.match(name)
    if m is None or name[m.end():].startswith(_MTP_OWN_MODULES):
        return name
    return name[:m.end()] + "mtp_block." + name[m.end():]


def _prefixed(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    """``name`` with its first matching HF prefix replaced by vLLM's (unchanged if none matches)."""
    hf, vllm = next(((a, b) for a, b in prefixes if name.startswith(a)), ("", ""))
    return vllm + name[len(hf):]


def _renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for hf, vllm in renames:
        name = name.replace(hf, vllm)
    return name


__all__ = ["EXPERT_PLACEMENTS", "FUSED_MOE_W13", "FUSED_MOE_W2", "VLLM_VOCAB_PADDING", "ExpertPlacement",
           "VllmParam", "VllmPiece", "VllmTarget", "vllm_params"]
