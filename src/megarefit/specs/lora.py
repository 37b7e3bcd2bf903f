"""Megatron-Bridge LoRA adapter parameters as frozen data, beside the base rows they adapt.

Bridge 0.6.2 (``megatron/bridge/peft/``) wraps a target linear in ``LoRALinear(to_wrap, adapter)``:
the base weight moves to ``<linear>.to_wrap.weight`` (same shape, same split) and the adapter is a
``ParallelLinearAdapter`` with two linears, A = ``linear_in`` ``[r, in]`` and B = ``linear_out``
``[out, r]``; the layer computes ``W x + (alpha / r) * B (A x)``. ``CanonicalLoRA`` keeps one adapter
per HF projection (``adapter.adapter_q`` / ``_k`` / ``_v`` on ``linear_qkv``, ``adapter_gate`` /
``adapter_up`` on ``linear_fc1``) and a plain adapter on ``linear_proj`` / ``linear_fc2``.

How TP splits them (Bridge's ``ParallelLinearAdapter.__init__``, measured on real megatron-core
0.19.2 modules at tp=2 by tests/bridge_lora.py: module class, ``partition_dim``, local shape)::

    base       factor  Bridge module                         split              local shape
    column     A       ColumnParallelLinear(in, r,           dim 0 over r       [r/tp, hidden]
    (qkv, fc1)           gather_output=True)
    column     B       ColumnParallelLinear(r, out)          dim 0 as the base  [out/tp, r]
                                                             (QKV groups, [gate_r; up_r])
    row        A       RowParallelLinear(in, r,              dim 1, as the      [r, in/tp]
    (proj, fc2)          input_is_parallel=True)             base's input
    row        B       ColumnParallelLinear(r, out,          dim 0 over out     [hidden/tp, r]
                         gather_output=True)

MoE layers (``MOE_ROWS``, measured on a GLM-4.5-style model by tests/bridge_lora_moe.py): the shared
expert's ``linear_fc1`` / ``linear_fc2`` split as the dense MLP's, over TP (``2shared_ffn`` / ``shared_ffn``);
each SequentialMLP expert (``mlp.experts.local_experts.{expert}.``) has its own adapter, split as above but
over expert-TP (``etp``; Bridge's ``is_expert_linear``), on the EP rank that holds the expert.
Transformer-Engine grouped experts (``TEGroupedMLP``: ``mlp.experts.linear_fc1.weight{expert}``) get, under
Bridge's default ``share_expert_adapters=True``, one ``ParallelLinearAdapter`` per grouped linear, shared by
the EP rank's local experts (``mlp.experts.linear_fc1.adapter.linear_in.weight``, 2-D, split over expert-TP
as a SequentialMLP expert's): each local expert's weight takes the same ``B @ A``. ``CanonicalLoRA`` gives a
grouped ``linear_fc1`` one such adapter too, not gate / up apart. Measured on real TE 2.9 modules at tp 1,
ep 1 by tests/bridge_lora_te_gpu.py (by hand, on a GPU). Bridge's other grouped adapters, one per
expert (``GroupedExpertLinearAdapter``) or shared-outer (``SharedOuterGroupedExpertAdapter``), have the same
names with 3-D factors and are refused by shape (:mod:`megarefit.online.trainer.lora_merge`).

So the factor a rank lacks in full is A for a column base and B for a row base (Bridge's
``LoRAMerge.merge`` gathers exactly that one); the other factor is already this rank's part of the
product. CanonicalLoRA's B of q / k / v is a plain column split of ``q_proj`` / ``k_proj`` /
``v_proj`` rows (heads ``[t*H/tp, (t+1)*H/tp)``), which the wrapper interleaves per query group into
``linear_qkv``'s order at run time.

Rows hold no functions. :func:`adapter_row` finds a name's row and refuses, naming the module and
why, what is not verified (:class:`~megarefit.errors.UnsupportedAdapterError`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from megarefit.errors import UnknownParameterError, UnsupportedAdapterError
from megarefit.specs.gpt import ATTENTION, GATED_MLP
from megarefit.specs.moe import moe_rows
from megarefit.specs.table import ParallelMode, ParamSpec, Role

Wrapper = Literal["lora", "canonical_lora"]
"""Bridge's ``LoRA`` (one adapter per linear) or ``CanonicalLoRA`` (one per HF projection)."""

WRAPPED = ".to_wrap."  # LoRALinear keeps the base module as ``to_wrap``


class Factor(str, Enum):
    """Which of the two adapter matrices: A ``[r, in]`` or B ``[out, r]``."""

    A = "linear_in"
    B = "linear_out"


@dataclass(frozen=True)
class AdapterRow:
    """One adapter parameter of one wrapped linear.

    Attributes:
        megatron: name pattern (``{layer}`` local to the stage), as ``named_parameters()`` spells it.
        wrappers: the Bridge wrappers that make this parameter (both, for ``linear_proj`` / ``linear_fc2``).
        factor: A (``linear_in``) or B (``linear_out``).
        base: the base row (its ``megatron`` is the name without ``to_wrap.``).
        role: how TP splits this tensor (the table above): ``column`` (A of a column base over r; B of
            a row base over out; canonical B of one projection), ``row`` (A of a row base), ``qkv`` /
            ``gated_mlp`` (B of a fused column base: the base's row order with inner dim r).
        shape: global shape at TP=1 as shape symbols, ``"r"`` the adapter rank.
        parts: indices into ``base.hf`` this tensor adapts (LoRA on ``linear_qkv``: ``(0, 1, 2)``;
            CanonicalLoRA's ``adapter_k``: ``(1,)``).
    """

    megatron: str
    wrappers: tuple[Wrapper, ...]
    factor: Factor
    base: ParamSpec
    role: Role
    shape: tuple[str, ...]
    parts: tuple[int, ...]

    @property
    def expert(self) -> bool:
        """Split over the expert-TP group (``etp``; Bridge's ``is_expert_linear``: routed experts, not shared)."""
        return self.base.role.is_expert

    @property
    def gathered(self) -> bool:
        """The factor a merge gathers over TP: A of a column base, B of a row base."""
        return (self.factor is Factor.A) == (self.base.role.parallel_mode is ParallelMode.COLUMN)

    def peft_modules(self) -> tuple[str, ...]:
        """HF module templates (``model.layers.{layer}.self_attn.q_proj``) of :attr:`parts`."""
        return tuple(self.base.hf[i].removesuffix(".weight") for i in self.parts)


def _row(pattern: str) -> ParamSpec:
    return next(r for r in ATTENTION + GATED_MLP + moe_rows(shared="shared_experts") if r.megatron == pattern)


_L = "decoder.layers.{layer}."
_E = _L + "mlp.experts.local_experts.{expert}."  # SequentialMLP experts (the local spelling)
QKV = _row(_L + "self_attention.linear_qkv.weight")
PROJ = _row(_L + "self_attention.linear_proj.weight")
FC1 = _row(_L + "mlp.linear_fc1.weight")
FC2 = _row(_L + "mlp.linear_fc2.weight")
SHARED_FC1 = _row(_L + "mlp.shared_experts.linear_fc1.weight")
SHARED_FC2 = _row(_L + "mlp.shared_experts.linear_fc2.weight")
EXPERT_FC1 = _row(_E + "linear_fc1.weight")
EXPERT_FC2 = _row(_E + "linear_fc2.weight")
GROUPED_FC1 = _row(_L + "mlp.experts.linear_fc1.weight{expert}")  # TEGroupedMLP: one tensor a local expert
GROUPED_FC2 = _row(_L + "mlp.experts.linear_fc2.weight{expert}")
R = Role


def _adapter(base: ParamSpec, sub: str) -> str:
    """The adapter parameter ``sub`` of ``base``'s wrapped module (a grouped linear's shared adapter sits under
    the module, not under one of its ``weight{expert}`` tensors)."""
    return base.megatron.removesuffix(".weight{expert}").removesuffix(".weight") + f".adapter.{sub}"


def _plain(base: ParamSpec, wrappers: tuple[Wrapper, ...], b_role: Role, b_out: str, a_role: Role, a_in: str) -> tuple[AdapterRow, ...]:
    parts = tuple(range(len(base.hf)))
    return (AdapterRow(_adapter(base, "linear_in.weight"), wrappers, Factor.A, base, a_role, ("r", a_in), parts),
            AdapterRow(_adapter(base, "linear_out.weight"), wrappers, Factor.B, base, b_role, (b_out, "r"), parts))


def _canonical(base: ParamSpec, keys: tuple[str, ...], outs: tuple[str, ...],
               column: Role = R.COLUMN) -> tuple[AdapterRow, ...]:
    return tuple(row for i, (key, out) in enumerate(zip(keys, outs)) for row in (
        AdapterRow(_adapter(base, f"adapter_{key}.linear_in.weight"), ("canonical_lora",), Factor.A, base, column,
                   ("r", "hidden"), (i,)),
        AdapterRow(_adapter(base, f"adapter_{key}.linear_out.weight"), ("canonical_lora",), Factor.B, base, column,
                   (out, "r"), (i,))))


_BOTH: tuple[Wrapper, ...] = ("lora", "canonical_lora")
_ROW_BASES = (_plain(PROJ, _BOTH, R.COLUMN, "hidden", R.ROW, "q") + _plain(FC2, _BOTH, R.COLUMN, "hidden", R.ROW, "ffn"))
_CANONICAL_ONLY = _canonical(QKV, ("q", "k", "v"), ("q", "kv", "kv")) + _canonical(FC1, ("gate", "up"), ("ffn", "ffn"))
_MOE_ROW_BASES = (_plain(SHARED_FC2, _BOTH, R.COLUMN, "hidden", R.ROW, "shared_ffn")
                  + _plain(EXPERT_FC2, _BOTH, R.EXPERT_COLUMN, "hidden", R.EXPERT_ROW, "moe_ffn")
                  + _plain(GROUPED_FC2, _BOTH, R.EXPERT_COLUMN, "hidden", R.EXPERT_ROW, "moe_ffn"))
_MOE_CANONICAL_ONLY = (_canonical(SHARED_FC1, ("gate", "up"), ("shared_ffn", "shared_ffn"))
                       + _canonical(EXPERT_FC1, ("gate", "up"), ("moe_ffn", "moe_ffn"), R.EXPERT_COLUMN))

LORA_ROWS: tuple[AdapterRow, ...] = (
    _plain(QKV, ("lora",), R.QKV, "qkv", R.COLUMN, "hidden")
    + _plain(FC1, ("lora",), R.GATED_MLP, "2ffn", R.COLUMN, "hidden") + _ROW_BASES)
"""Bridge ``LoRA`` on the four dense linears (its default ``target_modules``)."""

CANONICAL_ROWS: tuple[AdapterRow, ...] = _CANONICAL_ONLY + _ROW_BASES
"""Bridge ``CanonicalLoRA``: q / k / v and gate / up adapters apart; ``linear_proj`` / ``linear_fc2`` as LoRA."""

MOE_ROWS: tuple[AdapterRow, ...] = (
    _plain(SHARED_FC1, ("lora",), R.GATED_MLP, "2shared_ffn", R.COLUMN, "hidden")
    + _plain(EXPERT_FC1, ("lora",), R.EXPERT_GATED_MLP, "2moe_ffn", R.EXPERT_COLUMN, "hidden")
    # CanonicalLoRA keeps a grouped linear_fc1 unfused too (its _should_treat_linear_fc1_as_unfused)
    + _plain(GROUPED_FC1, _BOTH, R.EXPERT_GATED_MLP, "2moe_ffn", R.EXPERT_COLUMN, "hidden")
    + _MOE_ROW_BASES + _MOE_CANONICAL_ONLY)
"""MoE layers' adapters, both wrappers (Bridge's default ``target_modules`` name ``linear_fc1`` / ``linear_fc2``,
which match the shared experts' and the routed experts'): shared experts split over TP like the dense MLP
(Bridge's ``is_expert_linear`` excludes them), routed experts over expert-TP (``etp``), one adapter per
SequentialMLP expert (``local_experts.{expert}``) or one per TEGroupedMLP linear, shared by its local experts."""

ADAPTER_ROWS = LORA_ROWS + _CANONICAL_ONLY + MOE_ROWS  # each parameter name once

@dataclass(frozen=True)
class Refused:
    """Adapters megarefit refuses: parameter names matching ``pattern`` (a regex) lie on ``module``;
    ``why`` it is refused and the ``fix`` (what to train instead) go into the error."""

    pattern: str
    module: str
    why: str
    fix: str


REFUSED: tuple[Refused, ...] = (
    Refused(r"\.adapter\.weight_magnitude$", "DoRA",
            "the merged weight is m * (W + s B A) / ||W + s B A|| per output row, a different formula, not verified "
            "here", "train with LoRA or CanonicalLoRA"),
    Refused(r"\.mlp\.router\.", "the MoE router",
            "a router adapter changes routing logits (LoRATopKRouter), which no merged or vLLM LoRA path here verifies",
            "leave mlp.router out of target_modules"),
    Refused(r"\.self_attention\.linear_(q_proj|q_down_proj|q_up_proj|kv_down_proj|kv_up_proj)\.", "MLA attention",
            "MLA's low-rank projections have no verified adapter rows", "target only linear_proj and the MLP"),
    Refused(r"\.mixer\.", "a Mamba mixer", "Mamba in_proj / out_proj adapters are not verified",
            "exclude *.mixer.* (exclude_modules)"),
)

_INDEX = r"(?P<{}>0|[1-9][0-9]*)"


def _regex(pattern: str) -> re.Pattern[str]:
    out = re.escape(pattern)
    for key in ("layer", "expert"):
        out = out.replace(re.escape(f"{{{key}}}"), _INDEX.format(key))
    return re.compile(out)


_COMPILED = tuple((_regex(r.megatron), r) for r in ADAPTER_ROWS)


def is_adapter(name: str) -> bool:
    """``name`` is a parameter of a Bridge PEFT adapter (``.adapter.`` inside a wrapped linear)."""
    return ".adapter." in name


def base_name(name: str) -> str:
    """The base parameter's name as an unwrapped model spells it (``to_wrap.`` dropped)."""
    return name.replace(WRAPPED, ".")


def adapter_row(name: str) -> tuple[AdapterRow, int]:
    """The row of adapter parameter ``name`` and its layer index.

    Raises:
        UnsupportedAdapterError: the adapter is DoRA, or adapts the router, MLA or a Mamba mixer (the message
            names the module, why, and what to do instead).
        UnknownParameterError: no row matches (an adapter on a linear Bridge does not target by default).
    """
    for refused in REFUSED:
        if re.search(refused.pattern, name):
            raise UnsupportedAdapterError(f"adapter parameter {name!r} on {refused.module} is refused: {refused.why}; "
                                          f"{refused.fix}")
    for regex, row in _COMPILED:
        m = regex.fullmatch(name)
        if m:
            return row, int(m["layer"])
    raise UnknownParameterError(f"adapter parameter {name!r} matches no LoRA / CanonicalLoRA row; known: "
                                f"{sorted({r.megatron for r in ADAPTER_ROWS})}")


def peft_row(name: str) -> tuple[AdapterRow, int]:
    """:func:`adapter_row` for the adapter-only refit (PEFT tensors into vLLM's LoRA): dense rows only.

    Raises:
        UnsupportedAdapterError: ``name`` adapts shared or routed experts (the merged refit,
            :class:`~megarefit.online.trainer.lora_merge.MergedLoRA`, takes them), and what :func:`adapter_row`
            raises.
    """
    row, layer = adapter_row(name)
    if row in MOE_ROWS:
        raise UnsupportedAdapterError(
            f"adapter parameter {name!r} adapts an MoE layer's experts: the adapter-only refit plans dense "
            "adapters only (vLLM's MoE LoRA takes per-expert PEFT tensors no plan here writes yet); refit the "
            "model merged (MergedLoRA serves W + (alpha / r) B A), or exclude *.mlp.* of MoE layers (exclude_modules)")
    return row, layer


__all__ = ["ADAPTER_ROWS", "CANONICAL_ROWS", "LORA_ROWS", "MOE_ROWS", "REFUSED", "AdapterRow", "Factor", "Refused",
           "UnsupportedAdapterError", "Wrapper", "adapter_row", "base_name", "is_adapter", "peft_row"]
