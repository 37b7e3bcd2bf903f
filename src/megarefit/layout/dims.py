"""ModelDims: the numbers from an HF config that every layout depends on."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from megarefit.errors import LayoutError, MegarefitError
from megarefit.layout.hf_dims import load_hf_config, read_hf_dims
from megarefit.specs import FamilySpec, family_for_config, get_family
from megarefit.specs.megatron_core import REFERENCE, MegatronCore, ModelNeeds
from megarefit.specs.table import Condition, ParamSpec

DEFAULT_VOCAB_DIVISOR = 128
"""Megatron's default ``--make-vocab-size-divisible-by``."""


@dataclass(frozen=True)
class ModelDims:
    """Model dimensions (element counts, not bytes) from an HF config.

    ``head_dim`` is Megatron's ``kv_channels``; it may differ from
    ``hidden_size / num_attention_heads`` (Qwen3). ``num_query_groups`` is HF's
    ``num_key_value_heads`` (equal to the head count for MHA).
    """

    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0  # routed experts per MoE layer; 0 for dense models
    moe_ffn_hidden_size: int = 0  # per routed expert
    shared_expert_ffn: int = 0  # total shared-expert intermediate size; 0 for none
    router_bias: bool = False  # router score-correction bias (DeepSeek-V3 e_score_correction_bias)
    router_unnormalized: bool = False  # HF does not renormalise the top-k router probabilities (norm_topk_prob)
    dense_layers: tuple[int, ...] = ()  # global indices of dense layers in an MoE model
    q_lora_rank: int = 0  # MLA; 0 without a low-rank q projection
    kv_lora_rank: int = 0  # MLA; 0 for non-MLA attention
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0  # HF num_nextn_predict_layers: MTP layers the checkpoint stores after the decoder
    index_n_heads: int = 0  # DSA lightning indexer (GLM-5); 0 without one
    index_head_dim: int = 0
    # decoder layers whose DSA indexer is shared (GLM-5.2 ``indexer_types`` "shared"): they reuse the
    # last full layer's top-k and hold no indexer weights of their own (HF, vLLM, Megatron-Core 0.19)
    shared_indexer_layers: tuple[int, ...] = ()
    # hybrid Mamba2 models (Nemotron-H): one letter per layer (M mamba, * attention, - dense MLP, E MoE)
    layer_pattern: str = ""
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0  # HF n_groups (Megatron mamba_num_groups)
    mamba_state: int = 0  # HF ssm_state_size (Megatron mamba_state_dim)
    conv_kernel: int = 0  # Mamba2 / gated DeltaNet conv1d kernel width
    # gated-DeltaNet hybrids (Qwen3.5): global indices of the GDN layers (the rest are gated full attention),
    # key heads x key head dim, value heads x value head dim (HF linear_num_key_heads, linear_key_head_dim, ...)
    linear_layers: tuple[int, ...] = ()
    gdn_key_heads: int = 0
    gdn_key_dim: int = 0
    gdn_value_heads: int = 0
    gdn_value_dim: int = 0
    # DeepSeek-V4: each decoder layer's KV compression ratio (0: none, 4: compressed sparse attention with an
    # indexer, other: heavily compressed), the first ``hash_layers`` layers routed by token id, hyper-connections
    # (hc_mult residual copies), a grouped low-rank output (o_groups x o_lora_rank), experts per token
    compress_ratios: tuple[int, ...] = ()
    hash_layers: int = 0
    hc_mult: int = 0
    o_groups: int = 0
    o_lora_rank: int = 0
    experts_per_token: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_layers", tuple(sorted(self.dense_layers)))
        object.__setattr__(self, "shared_indexer_layers", tuple(sorted(self.shared_indexer_layers)))
        object.__setattr__(self, "linear_layers", tuple(sorted(self.linear_layers)))
        object.__setattr__(self, "compress_ratios", tuple(self.compress_ratios))
        if self.layer_pattern and (len(self.layer_pattern) != self.num_layers or set(self.layer_pattern) - set(_KINDS)):
            raise MegarefitError(f"layer pattern {self.layer_pattern!r}: expected {self.num_layers} letters of "
                                 f"{''.join(_KINDS)}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim",
                     "ffn_hidden_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise MegarefitError(f"ModelDims.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            raise MegarefitError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any] | Any, family: FamilySpec | None = None) -> ModelDims:
        """Read dims from an HF config dict / ``PretrainedConfig`` / path.

        Raises:
            UnsupportedModelError: the config names no supported family.
            MegarefitError: a required key is missing.
        """
        cfg = load_hf_config(hf_config)
        return cls(**read_hf_dims(cfg, family or family_for_config(cfg)))

    @property
    def spec(self) -> FamilySpec:
        return get_family(self.family)

    def padded_vocab_size(self, tp: int, divisible_by: int = DEFAULT_VOCAB_DIVISOR) -> int:
        """Megatron's padded vocab: ``vocab_size`` rounded up to a multiple of ``divisible_by * tp``."""
        multiple = divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def size(self, symbol: str, *, padded_vocab: int | None = None) -> int:
        """Resolve a spec-table shape symbol to an element count."""
        q = self.num_attention_heads * self.head_dim
        heads = self.num_attention_heads
        table = {
            "experts": self.num_experts,
            "heads": heads,
            "moe_ffn": self.moe_ffn_hidden_size,
            "2moe_ffn": 2 * self.moe_ffn_hidden_size,
            "shared_ffn": self.shared_expert_ffn,
            "2shared_ffn": 2 * self.shared_expert_ffn,
            "q_lora": self.q_lora_rank,
            "kv_lora": self.kv_lora_rank,
            "q_up": heads * (self.qk_nope_head_dim + self.qk_rope_head_dim),
            "kv_down": self.kv_lora_rank + self.qk_rope_head_dim,
            "kv_up": heads * (self.qk_nope_head_dim + self.v_head_dim),
            "v_heads": heads * self.v_head_dim,
            "index_q": self.index_n_heads * self.index_head_dim,
            "index_head_dim": self.index_head_dim,
            "index_heads": self.index_n_heads,
            "qk_rope": self.qk_rope_head_dim,
            "mamba_inner": self.mamba_heads * self.mamba_head_dim,
            "mamba_gs": self.mamba_groups * self.mamba_state,
            "mamba_heads": self.mamba_heads,
            "mamba_in": 2 * self.mamba_heads * self.mamba_head_dim + 2 * self.mamba_groups * self.mamba_state
            + self.mamba_heads,
            "mamba_conv": self.mamba_heads * self.mamba_head_dim + 2 * self.mamba_groups * self.mamba_state,
            "conv_kernel": self.conv_kernel,
            "qkvg": 2 * q + 2 * self.num_query_groups * self.head_dim,
            **_gdn_sizes(self),
            **_dsv4_sizes(self),
            "one": 1,
            "hidden": self.hidden_size,
            "ffn": self.ffn_hidden_size,
            "2ffn": 2 * self.ffn_hidden_size,
            "2hidden": 2 * self.hidden_size,
            "vocab": self.vocab_size if padded_vocab is None else padded_vocab,
            "head_dim": self.head_dim,
            "q": q,
            "qkv": q + 2 * self.num_query_groups * self.head_dim,
            "kv": self.num_query_groups * self.head_dim,
        }
        return table[symbol]

    def conditions(self, pp: int, megatron: MegatronCore = REFERENCE) -> frozenset[Condition]:
        """Spec-table conditions that hold for this model at pipeline size ``pp``, trained on
        ``megatron`` (its release's layout facts; default megarefit's reference layout).

        Raises:
            UnverifiedMegatronError: ``megatron`` is not a verified version.
        """
        out = set(megatron.facts())
        if self.qkv_bias:
            out.add(Condition.QKV_BIAS)
        if self.proj_bias:
            out.add(Condition.PROJ_BIAS)
        if self.mlp_bias:
            out.add(Condition.MLP_BIAS)
        if not self.tie_word_embeddings:
            out.add(Condition.UNTIED)
        elif pp > 1:
            out.add(Condition.TIED_COPY)
        if self.shared_expert_ffn:
            out.add(Condition.SHARED_EXPERTS)
        if self.router_bias:
            out.add(Condition.ROUTER_BIAS)
        if self.q_lora_rank:
            out.add(Condition.Q_LORA)
        elif self.kv_lora_rank:
            out.add(Condition.Q_PROJ)
        if self.qk_norm:
            out.add(Condition.QK_NORM)
        if self.index_n_heads:
            out.add(Condition.DSA_INDEXER)
        return frozenset(out)

    def megatron_needs(self, mtp_layers: int = 0) -> ModelNeeds:
        """What this model needs of its trainer's ``TransformerConfig``, with ``mtp_layers`` MTP layers
        trained (see :func:`megatron_needs`)."""
        return megatron_needs(self, mtp_layers)

    def has_row(self, row: ParamSpec, layer: int | None) -> bool:
        """Whether spec row ``row`` exists in global layer ``layer`` (``None``: not a layer row):
        its ``layer_kind`` is this layer's, and a DSA indexer row only where the layer has its
        own indexer (not one of :attr:`shared_indexer_layers`; MTP layers always do); a row of a
        token mixer (``mixer``) only in layers with that mixer (:attr:`linear_layers` are ``"gdn"``)."""
        if layer is None or layer < 0:
            return row.layer_kind is None
        if row.layer_kind is not None and row.layer_kind != self.layer_kind(layer):
            return False
        if row.mixer is not None and row.mixer != ("gdn" if layer in self.linear_layers else "attention"):
            return False
        if row.layers is not None and not self.in_layer_set(row.layers, layer):
            return False
        return not (Condition.DSA_INDEXER in row.requires and layer in self.shared_indexer_layers)

    def in_layer_set(self, layer_set: str, layer: int) -> bool:
        """Whether global layer ``layer`` belongs to DeepSeek-V4's ``layer_set``
        (:data:`~megarefit.specs.table.LayerSet`): ``compress_ratios[layer]`` 4 (``"csa"``) or another
        positive ratio (``"hca"``); below ``hash_layers`` (``"hash"``) or not (``"learned"``)."""
        ratio = self.compress_ratios[layer] if layer < len(self.compress_ratios) else 0
        return {"csa": ratio == CSA_RATIO, "hca": ratio not in (0, CSA_RATIO), "hash": layer < self.hash_layers,
                "learned": layer >= self.hash_layers}[layer_set]

    def layer_kind(self, layer: int) -> str:
        """``"moe"`` or ``"dense"`` for global decoder layer ``layer``; a hybrid model's letter's kind
        (``"mamba"``, ``"attention"``, ``"dense"``, ``"moe"``)."""
        if self.layer_pattern and layer < len(self.layer_pattern):
            return _KINDS[self.layer_pattern[layer]]
        return "moe" if self.num_experts and layer not in self.dense_layers else "dense"

    def check_expert_layout(self, expert_layout: str) -> None:
        """Raise :class:`LayoutError` if this model's experts have no spelling in ``expert_layout``
        (gpt-oss's biased experts are not a legacy ``GroupedMLP``, which has no biases)."""
        if not self.num_experts:
            return
        rows = self.spec.rows(self.conditions(1), None, expert_layout)  # type: ignore[arg-type]
        if not any(r.role.is_expert for r in rows):
            have = sorted({r.expert_layout for r in self.spec.entries if r.role.is_expert and r.expert_layout})
            raise LayoutError(f"{self.family} experts have no {expert_layout} layout in Megatron-Core; "
                              f"use one of {have}")

    @property
    def expert_biases(self) -> bool:
        """Routed experts carry biases (gpt-oss)."""
        return any(r.role.is_expert and len(r.shape) == 1 for r in self.spec.rows(self.conditions(1)))

    def default_etp(self, tp: int) -> int:
        """Megatron's expert-TP size when none is given: ``tp``, or 1 for experts with biases
        (Megatron-Core supports those at ``expert_tensor_parallel_size`` 1 only)."""
        return 1 if self.num_experts and self.expert_biases else tp

    @property
    def full_qk_norm(self) -> bool:
        """Whether the family's q / k norms run over all heads at once (a ``kv``-shaped
        ``k_layernorm`` row: MiniMax-M2) rather than per head."""
        return any(row.megatron.endswith("k_layernorm.weight") and row.shape == ("kv",) for row in self.spec.entries)

    def check_draft(self) -> None:
        """Raise :class:`LayoutError` unless this model has MTP layers megarefit plans (the layers
        vLLM's MTP draft model holds): the family's table has them and the HF config counts some."""
        if self.spec.mtp_key is None:
            raise LayoutError(f"{self.family}: megarefit does not plan this family's multi-token-prediction layers, "
                              "so it refits no MTP draft model (refit the target model only)")
        if not self.mtp_layers:
            raise LayoutError(f"{self.family}: the HF config has no MTP layers ({self.spec.mtp_key} is 0), so "
                              "vLLM serves no MTP draft model to refit")

    def check_layout(self, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
        """Raise :class:`LayoutError` if Megatron could not shard this model with these sizes
        (the layer split over ``pp`` is checked by ``SourceLayout.build``). ``etp`` is
        Megatron's ``expert_tensor_parallel_size`` (default :meth:`default_etp`)."""
        etp = self.default_etp(tp) if etp is None else etp
        if etp > 1 and self.num_experts and self.expert_biases:
            raise LayoutError(f"{self.family} experts carry biases, which Megatron-Core supports only at "
                              f"expert_tensor_parallel_size 1 (its TransformerConfig asserts 'Bias in Moe is only "
                              f"supported when ETP==1'); got etp={etp}: use etp=1 (--etp 1)")
        for name, value in (("tp", tp), ("pp", pp), ("ep", ep)):
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        problems = []
        if self.kv_lora_rank:  # MLA splits by heads
            pass
        elif self.num_query_groups % tp and tp % self.num_query_groups:  # Megatron-Core's rule
            problems.append(f"num_query_groups={self.num_query_groups} neither a multiple nor a divisor of tp={tp}")
        if self.mamba_heads and (self.mamba_heads % tp or self.mamba_groups % tp):
            problems.append(f"mamba heads={self.mamba_heads} and groups (n_groups)={self.mamba_groups} must divide "
                            f"over tp={tp} (Megatron-Core's MambaMixer asserts ngroups % tp == 0)")
        problems += _gdn_problems(self, tp)
        problems += _dsv4_problems(self, tp)
        if tp > self.num_query_groups and self.qk_norm and self.full_qk_norm:
            problems.append(f"tp={tp} exceeds num_query_groups={self.num_query_groups}: each K-norm shard "
                            f"(k_layernorm, a norm over all key heads) would be replicated over tp/groups ranks, a "
                            f"layout megarefit does not plan; use tp <= {self.num_query_groups}")
        if self.num_attention_heads % tp:
            problems.append(f"num_attention_heads={self.num_attention_heads} not divisible by tp={tp}")
        if self.ffn_hidden_size % tp:
            problems.append(f"ffn_hidden_size={self.ffn_hidden_size} not divisible by tp={tp}")
        problems += _moe_problems(self, tp, ep, etp)
        if problems:
            raise LayoutError(f"{self.family} model cannot be laid out at tp={tp} pp={pp} ep={ep}: "
                              + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["dense_layers"] = list(self.dense_layers)
        d["shared_indexer_layers"] = list(self.shared_indexer_layers)
        d["linear_layers"] = list(self.linear_layers)
        d["compress_ratios"] = list(self.compress_ratios)
        for key in _OPTIONAL_FIELDS:  # absent when unused: the same dict (and plan digests) as before them
            if not d[key]:
                del d[key]
        return d


def megatron_needs(d: ModelDims, mtp_layers: int = 0) -> ModelNeeds:
    """Which config flags matter for ``d`` (:func:`megatron_features`) and the values of those
    that follow its HF config or its family's table
    (:attr:`~megarefit.specs.table.FamilySpec.megatron_config`)::

        flag                            values for this model
        add_bias_linear                 (o_proj or MLP biases,)
        add_qkv_bias                    (q/k/v biases,); either, where add_bias_linear builds them
        qk_layernorm                    (q/k norms or MLA,)
        moe_router_score_function       (the family's router_score,)
        moe_router_pre_softmax          softmax: (not renormalised,); sigmoid: (False, True), none where
                                        HF does not renormalise (Megatron-Core always does)
        moe_router_enable_expert_bias   (router_bias,)
    """
    linear = d.proj_bias or d.mlp_bias
    values = dict(d.spec.megatron_config)
    values.update(add_bias_linear=(linear,), add_qkv_bias=(True, False) if linear and d.qkv_bias else (d.qkv_bias,),
                  qk_layernorm=(bool(d.qk_norm or d.kv_lora_rank),))
    if d.num_experts:
        score = d.spec.router_score
        pre = (d.router_unnormalized,) if score == "softmax" else () if d.router_unnormalized else (False, True)
        values.update(moe_router_score_function=(score,), moe_router_pre_softmax=pre,
                      moe_router_enable_expert_bias=(d.router_bias,))
    return ModelNeeds(megatron_features(d, mtp_layers), tuple(sorted(values.items())))


def megatron_features(d: ModelDims, mtp_layers: int = 0) -> frozenset[str]:
    """What ``d`` has of :data:`megarefit.specs.megatron_core.Feature` (which config flags matter),
    with ``mtp_layers`` MTP layers trained."""
    out = {"any"}
    dsa = d.index_n_heads and not d.hc_mult  # DeepSeek-V4's indexers are not Megatron-Core's DSA
    moe = d.num_experts and any(d.layer_kind(i) == "moe" for i in range(d.num_layers))  # (a hybrid may have none)
    for feature, present in (("moe", moe), ("mla", d.kv_lora_rank), ("dsa", dsa),
                             ("mtp", mtp_layers), ("shared_experts", d.shared_expert_ffn), ("gdn", d.linear_layers)):
        if present:
            out.add(feature)
    return frozenset(out)


def _moe_problems(d: ModelDims, tp: int, ep: int, etp: int) -> list[str]:
    """Why the experts cannot split over ``ep`` and ``etp`` (and shared experts over ``tp``)."""
    problems = []
    if ep != 1 and not d.num_experts:
        problems.append(f"ep={ep}: this {d.family} model has no experts; use ep=1")
    if d.num_experts and d.num_experts % ep:
        problems.append(f"num_experts={d.num_experts} not divisible by ep={ep}")
    if d.num_experts and d.moe_ffn_hidden_size % etp:
        problems.append(f"moe_ffn_hidden_size={d.moe_ffn_hidden_size} not divisible by etp={etp}")
    if d.shared_expert_ffn % tp:
        problems.append(f"shared expert ffn={d.shared_expert_ffn} not divisible by tp={tp}")
    if etp not in (1, tp):
        problems.append(f"etp={etp}: expert tensor parallelism must be 1 or tp={tp}")
    return problems


def _dsv4_problems(d: ModelDims, tp: int) -> list[str]:
    """Why DeepSeek-V4 cannot split over ``tp``: only Megatron-LM's dev branch builds it, at tp 1."""
    if d.hc_mult and tp > 1:
        return [f"tp={tp}: Megatron-Core builds DeepSeek-V4 only on Megatron-LM's dev branch, which asserts "
                "tensor_model_parallel_size 1 for it (its TransformerConfig and DSv4 attention); use tp=1 (pp, ep "
                "and etp split it)"]
    return []


CSA_RATIO = 4
"""DeepSeek-V4's compression ratio of compressed sparse attention (overlapping windows, an indexer)."""


def _dsv4_sizes(d: ModelDims) -> dict[str, int]:
    """DeepSeek-V4's shape symbols (zero for other models); ``hca_ratio``: the one ratio other than 0
    and 4 (:func:`~megarefit.layout.hf_dims.dsv4_dims` refuses configs with several)."""
    hca = [r for r in d.compress_ratios if r not in (0, CSA_RATIO)]
    return {"o_lora_all": d.o_groups * d.o_lora_rank,
            "o_group_in": d.num_attention_heads * d.head_dim // d.o_groups if d.o_groups else 0,
            "2head_dim": 2 * d.head_dim, "2index_head_dim": 2 * d.index_head_dim, "csa_ratio": CSA_RATIO,
            "hca_ratio": hca[0] if hca else 0, "hc": d.hc_mult, "hc_mix": (2 + d.hc_mult) * d.hc_mult,
            "hc_hidden": d.hc_mult * d.hidden_size, "token_ids": d.vocab_size, "topk": d.experts_per_token}


def _gdn_sizes(d: ModelDims) -> dict[str, int]:
    """The gated-DeltaNet shape symbols (zero for other models)."""
    qk, v = d.gdn_key_heads * d.gdn_key_dim, d.gdn_value_heads * d.gdn_value_dim
    return {"gdn_in": 2 * qk + 2 * v + 2 * d.gdn_value_heads, "gdn_conv": 2 * qk + v, "gdn_qk": qk, "gdn_v": v,
            "gdn_heads": d.gdn_value_heads, "gdn_dv": d.gdn_value_dim, "gdn_kheads": d.gdn_key_heads}


def _gdn_problems(d: ModelDims, tp: int) -> list[str]:
    """Why a gated DeltaNet cannot split over ``tp`` (Megatron-Core's TransformerConfig asserts that
    both head counts divide by tp)."""
    if d.gdn_key_heads and (d.gdn_key_heads % tp or d.gdn_value_heads % tp):
        return [f"gated DeltaNet key heads={d.gdn_key_heads} and value heads={d.gdn_value_heads} must divide over "
                f"tp={tp} (Megatron-Core asserts linear_num_key_heads % tp == 0 and linear_num_value_heads % tp == 0)"]
    return []


_KINDS = {"M": "mamba", "*": "attention", "-": "dense", "E": "moe"}
_OPTIONAL_FIELDS = ("layer_pattern", "mamba_heads", "mamba_head_dim", "mamba_groups", "mamba_state", "conv_kernel",
                  "shared_indexer_layers", "linear_layers", "gdn_key_heads", "gdn_key_dim", "gdn_value_heads",
                  "gdn_value_dim", "compress_ratios", "hash_layers", "hc_mult", "o_groups", "o_lora_rank",
                  "experts_per_token", "router_unnormalized")
