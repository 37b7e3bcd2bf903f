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
    ========== ===== ================================================================
    """

    REPLICATED = "replicated"
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"
    QKV = "qkv"
    GATED_MLP = "gated_mlp"

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
}
_ROLE_ARITY = {Role.QKV: 3, Role.GATED_MLP: 2}


class Stage(str, Enum):
    """Which pipeline stage(s) hold a parameter."""

    FIRST = "first"  # embedding
    LAST = "last"  # final norm, output layer
    LAYER = "layer"  # per decoder layer; the stage owning that layer


class Condition(str, Enum):
    """Model/layout facts that decide whether a table row exists at all."""

    QKV_BIAS = "qkv_bias"  # q/k/v projections carry a bias
    PROJ_BIAS = "proj_bias"  # attention output projection carries a bias
    MLP_BIAS = "mlp_bias"  # MLP linears carry biases
    UNTIED = "untied"  # separate output layer / lm_head
    TIED_COPY = "tied_copy"  # tied embeddings and pp > 1: last stage keeps a synced copy


# Dimension symbols allowed in ParamSpec.shape; ModelDims.size() resolves them.
SHAPE_SYMBOLS = frozenset({"hidden", "ffn", "2ffn", "vocab", "head_dim", "q", "qkv"})
_ROLE_LEADING_SYMBOL = {Role.QKV: "qkv", Role.GATED_MLP: "2ffn", Role.VOCAB: "vocab"}

_PLACEHOLDERS = {"layer": r"(?P<layer>0|[1-9][0-9]*)"}
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
    """

    megatron: str
    role: Role
    hf: tuple[str, ...]
    shape: tuple[str, ...]
    requires: frozenset[Condition] = frozenset()
    spelling: LayerSpec | None = None
    duplicate: bool = False
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regex", _compile(self.megatron))
        where = f"spec row {self.megatron!r}"
        if len(self.hf) != self.role.hf_arity:
            raise SpecTableError(
                f"{where}: role {self.role.value} needs {self.role.hf_arity} HF names, got {len(self.hf)}"
            )
        for template in self.hf:
            _compile(template)  # placeholder check
            if ("{layer}" in template) != self.per_layer:
                raise SpecTableError(f"{where}: HF name {template!r} and pattern disagree on {{layer}}")
        unknown = set(self.shape) - SHAPE_SYMBOLS
        if unknown:
            raise SpecTableError(f"{where}: unknown shape symbols {sorted(unknown)}")
        lead = _ROLE_LEADING_SYMBOL.get(self.role)
        if lead is not None and self.shape[:1] != (lead,):
            raise SpecTableError(f"{where}: role {self.role.value} needs leading dim {lead!r}, got {self.shape}")
        if self.role is Role.ROW and len(self.shape) != 2:
            raise SpecTableError(f"{where}: a row-parallel tensor must be 2-D, got {self.shape}")

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.megatron

    @property
    def stage(self) -> Stage:
        if self.per_layer:
            return Stage.LAYER
        return Stage.FIRST if self.megatron.startswith("embedding.") else Stage.LAST

    def active(self, conditions: frozenset[Condition], spelling: LayerSpec | None) -> bool:
        """Whether this row exists under ``conditions`` and layer spec ``spelling``
        (``spelling=None`` accepts either spelling)."""
        if not self.requires <= conditions:
            return False
        return spelling is None or self.spelling is None or self.spelling == spelling

    def megatron_name(self, layer: int | None = None) -> str:
        return self.megatron.format(layer=layer) if self.per_layer else self.megatron

    def hf_names(self, layer: int | None = None) -> tuple[str, ...]:
        """HF names for global layer ``layer`` (ignored for non-layer rows)."""
        if not self.per_layer:
            return self.hf
        return tuple(t.format(layer=layer) for t in self.hf)


@dataclass(frozen=True)
class Match:
    """A Megatron name resolved against a table: the row and the local layer index."""

    spec: ParamSpec
    layer: int | None


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

    def __post_init__(self) -> None:
        for i, row in enumerate(self.entries):
            for other in self.entries[:i]:
                if other.megatron == row.megatron and not _exclusive(row, other):
                    raise SpecTableError(f"family {self.name}: rows for {row.megatron!r} can be active together")

    def rows(self, conditions: frozenset[Condition], spelling: LayerSpec | None = None) -> tuple[ParamSpec, ...]:
        return tuple(r for r in self.entries if r.active(conditions, spelling))

    def match(
        self, name: str, conditions: frozenset[Condition], spelling: LayerSpec | None = None, *, rank: object = None
    ) -> Match:
        """Resolve one Megatron parameter name.

        Raises:
            UnknownParameterError: no active row matches ``name``.
            AmbiguousParameterError: two active rows match ``name``.
        """
        hits = []
        for row in self.entries:
            m = row._regex.fullmatch(name)
            if m is not None and row.active(conditions, spelling):
                layer = int(m.group("layer")) if row.per_layer else None
                hits.append(Match(row, layer))
        where = f" on rank {rank}" if rank is not None else ""
        if not hits:
            raise UnknownParameterError(
                f"Megatron parameter {name!r}{where} matches no row of the {self.name} spec table "
                f"(active conditions: {sorted(c.value for c in conditions)})"
            )
        if len(hits) > 1:
            raise AmbiguousParameterError(
                f"Megatron parameter {name!r}{where} matches {len(hits)} rows of the {self.name} "
                f"spec table: {[h.spec.megatron for h in hits]}"
            )
        return hits[0]


_EXCLUSIVE = {frozenset({Condition.UNTIED, Condition.TIED_COPY})}


def _exclusive(a: ParamSpec, b: ParamSpec) -> bool:
    if a.spelling is not None and b.spelling is not None and a.spelling != b.spelling:
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
