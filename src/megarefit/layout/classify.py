"""Role classifier: check a live Megatron-Core model against the spec table.

Three independent sources must agree for every parameter:

1. the owning module's class, via :data:`MODULE_MODES` (Megatron-Core local and
   Transformer-Engine classes) -> :class:`ParallelMode`;
2. Megatron's own parameter attributes ``tensor_model_parallel`` /
   ``partition_dim`` (set by ``set_tensor_model_parallel_attributes``), when present;
3. the spec table row the name matches -> its role's parallel mode.

Any disagreement, unknown name, or unknown module class is reported with the
parameter name. Megatron-Bridge LoRA models classify too: a wrapped base
(``<linear>.to_wrap.weight``) by its base row, adapter parameters by their
:mod:`~megarefit.specs.lora` rows (a refused adapter is reported as the problem). Works on any ``torch.nn.Module``; imports no Megatron code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megarefit.errors import ClassificationError, MegarefitError
from megarefit.layout.dims import ModelDims
from megarefit.specs.lora import adapter_row, base_name, is_adapter
from megarefit.specs.megatron_core import MegatronCore
from megarefit.specs.table import FamilySpec, LayerSpec, ParallelMode, Role, canonical_name

P = ParallelMode

# (module class name, parameter attribute) -> parallel mode; "*" matches any attribute.
MODULE_MODES: Mapping[tuple[str, str], ParallelMode] = {
    ("ColumnParallelLinear", "*"): P.COLUMN,
    ("RowParallelLinear", "weight"): P.ROW,
    ("RowParallelLinear", "bias"): P.REPLICATED,
    ("VocabParallelEmbedding", "weight"): P.COLUMN,
    ("TEColumnParallelLinear", "*"): P.COLUMN,
    ("TELayerNormColumnParallelLinear", "weight"): P.COLUMN,
    ("TELayerNormColumnParallelLinear", "bias"): P.COLUMN,
    ("TELayerNormColumnParallelLinear", "layer_norm_weight"): P.REPLICATED,
    ("TELayerNormColumnParallelLinear", "layer_norm_bias"): P.REPLICATED,
    ("TERowParallelLinear", "weight"): P.ROW,
    ("TERowParallelLinear", "bias"): P.REPLICATED,
    ("TENorm", "*"): P.REPLICATED,
    ("RMSNorm", "*"): P.REPLICATED,
    ("LayerNorm", "*"): P.REPLICATED,
    ("FusedLayerNorm", "*"): P.REPLICATED,
    ("WrappedTorchNorm", "*"): P.REPLICATED,
    ("L2Norm", "*"): P.REPLICATED,
    ("Embedding", "weight"): P.REPLICATED,  # learned absolute position embeddings
    # MoE: the router is replicated over TP; expert linears split over expert-TP
    ("TopKRouter", "*"): P.REPLICATED,
    # whole on every rank: TE's TELinear as Megatron's specs use it (parallel_mode "duplicated":
    # MLA down-projections in the TE spec, the DSA indexer) and Megatron's local Linear
    ("TELinear", "*"): P.REPLICATED,
    ("Linear", "*"): P.REPLICATED,
    ("TEColumnParallelGroupedLinear", "*"): P.COLUMN,  # weight{i} per local expert
    ("TERowParallelGroupedLinear", "weight"): P.ROW,
    ("TERowParallelGroupedLinear", "bias"): P.REPLICATED,  # bias{i}: added after the reduction, whole
    # Mamba2 mixer (Nemotron-H): per-head parameters, the depthwise conv and the gated norm, split over TP
    ("MambaMixer", "A_log"): P.COLUMN,
    ("MambaMixer", "D"): P.COLUMN,
    ("MambaMixer", "dt_bias"): P.COLUMN,
    ("Conv1d", "*"): P.COLUMN,
    ("MambaMixer", "conv1d_weight"): P.COLUMN,  # megatron-core 0.19: the conv as plain parameters
    ("MambaMixer", "conv1d_bias"): P.COLUMN,
    ("ExtendedRMSNorm", "weight"): P.COLUMN,
    # gated DeltaNet (Qwen3.5, Qwen3-Next; every verified megatron-core): per value head, split as the heads are
    ("GatedDeltaNet", "A_log"): P.COLUMN,
    ("GatedDeltaNet", "dt_bias"): P.COLUMN,
    ("SharedExpertMLP", "gate_weight"): P.REPLICATED,  # moe_shared_expert_gate: [1, hidden] on every rank
    # Megatron-Bridge 0.6's MiniMax-M2 q / k norms over all heads (FullDimQNorm / FullDimKNorm): by heads
    ("_FullDimRMSNorm", "weight"): P.COLUMN,
    # learned attention-sink logits (softmax_type="learnable", gpt-oss): one per local head
    ("DotProductAttention", "softmax_offset"): P.COLUMN,
    ("TEDotProductAttention", "softmax_offset"): P.COLUMN,
    # legacy GroupedMLP stores its experts transposed: the mode is Megatron's partition_dim
    # (weight1 [h, E_local*2F/etp] dim 1, weight2 [E_local*F/etp, h] dim 0), as the table's roles
    ("GroupedMLP", "weight1"): P.ROW,
    ("GroupedMLP", "weight2"): P.COLUMN,
}


@dataclass(frozen=True)
class ParamClass:
    """Classification of one parameter; ``None`` where a source has no opinion."""

    name: str
    module_class: str
    module_mode: ParallelMode | None
    attr_mode: ParallelMode | None
    role: Role | None
    problem: str | None

    @property
    def ok(self) -> bool:
        return self.problem is None


def _attr_mode(param: torch.Tensor) -> ParallelMode | None:
    if not hasattr(param, "tensor_model_parallel"):
        return None
    if not param.tensor_model_parallel:
        return P.REPLICATED
    return {0: P.COLUMN, 1: P.ROW}.get(getattr(param, "partition_dim", -1))


def module_mode(cls_name: str, attr: str, overrides: Mapping[str, ParallelMode] | None = None,
                name: str | None = None) -> ParallelMode | None:
    """Mode from the class table; ``overrides`` keys are parameter names or module class names."""
    if overrides:
        for key in (name, f"{cls_name}.{attr}", cls_name):
            if key is not None and key in overrides:
                return ParallelMode(overrides[key])
    return MODULE_MODES.get((cls_name, attr), MODULE_MODES.get((cls_name, "*")))


def classify_model(model: torch.nn.Module, dims: ModelDims, *, pp: int = 1, layer_spec: LayerSpec | None = None,
                   family: FamilySpec | None = None,
                   overrides: Mapping[str, ParallelMode] | None = None,
                   megatron: MegatronCore | None = None) -> list[ParamClass]:
    """Classify every parameter of ``model`` (one rank's Megatron-Core module).

    Args:
        model: a GPTModel, possibly wrapped (``module.`` prefixes are stripped).
        dims: model dims; with ``pp`` they decide which table rows exist.
        layer_spec: restrict to one norm spelling (``None`` accepts both).
        family: table to check against (default: ``dims.family``'s).
        overrides: parallel mode for custom modules, keyed by parameter name,
            ``"Class.attr"`` or class name; takes precedence over the class table.
        megatron: the Megatron-Core that built ``model`` (its release names some parameters);
            default: :meth:`MegatronCore.in_process`.

    Returns one :class:`ParamClass` per parameter, in ``named_parameters()`` order.
    """
    fam = family or dims.spec
    conds = dims.conditions(pp, MegatronCore.in_process() if megatron is None else megatron)
    modules = dict(model.named_modules())
    out = []
    for raw, param in model.named_parameters():
        name = canonical_name(raw)
        if name is None:
            continue
        mod_name, _, attr = raw.rpartition(".")
        cls_name = type(modules[mod_name]).__name__
        if (cls_name, attr) not in MODULE_MODES and attr[:1].isalpha() and attr[-1:].isdigit():
            attr = attr.rstrip("0123456789")  # TE grouped linears: weight{i}, one per local expert
        m_mode = module_mode(cls_name, attr, overrides, name)
        a_mode = _attr_mode(param)
        role, problem = None, None
        try:
            role = _table_role(fam, name, conds, layer_spec)
        except MegarefitError as exc:
            problem = str(exc)
        if problem is None:
            want = role.parallel_mode
            if m_mode is None:
                problem = f"module class {cls_name}.{attr} is not in the classifier table (pass overrides=)"
            elif m_mode is not want:
                problem = f"module class {cls_name} says {m_mode.value}, table role {role.value} needs {want.value}"
            elif a_mode is not None and a_mode is not want:
                problem = (f"Megatron attributes (tensor_model_parallel/partition_dim) say {a_mode.value}, "
                           f"table role {role.value} needs {want.value}")
        out.append(ParamClass(name, cls_name, m_mode, a_mode, role, problem))
    return out


def _table_role(fam: FamilySpec, name: str, conds: frozenset, layer_spec: LayerSpec | None) -> Role:
    """The role the tables give ``name``: a Bridge PEFT adapter's from its adapter row
    (:mod:`megarefit.specs.lora`), a wrapped base's (``<linear>.to_wrap.weight``) from the base row."""
    if is_adapter(name):
        return adapter_row(name)[0].role
    return fam.match(base_name(name), conds, layer_spec).spec.role


def check_model(model: torch.nn.Module, dims: ModelDims, **kwargs: object) -> list[ParamClass]:
    """:func:`classify_model`, raising :class:`ClassificationError` listing every disagreement."""
    result = classify_model(model, dims, **kwargs)  # type: ignore[arg-type]
    bad = [c for c in result if not c.ok]
    if bad:
        lines = "\n".join(f"  {c.name}: {c.problem}" for c in bad[:20])
        more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise ClassificationError(f"{len(bad)} of {len(result)} parameters disagree with the spec table:\n"
                                  f"{lines}{more}")
    return result
