"""Spec tables per model family, and the family lookup from an HF config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megarefit.errors import UnsupportedModelError
from megarefit.specs.deepseek import DEEPSEEK_V3, GLM4_MOE, GLM_MOE_DSA
from megarefit.specs.deepseek_v4 import DEEPSEEK_V4
from megarefit.specs.gpt_oss import GPT_OSS
from megarefit.specs.llama import LLAMA
from megarefit.specs.minimax import MINIMAX_M2
from megarefit.specs.mixtral import MIXTRAL
from megarefit.specs.nemotron_h import NEMOTRON_H
from megarefit.specs.pending import pending_for
from megarefit.specs.qwen import QWEN2, QWEN3, QWEN3_MOE
from megarefit.specs.qwen35 import QWEN3_5, QWEN3_5_MOE, QWEN3_5_MOE_VL, QWEN3_5_VL, QWEN3_NEXT
from megarefit.specs.table import (
    LAYER_SPECS,
    Condition,
    FamilySpec,
    LayerSpec,
    Match,
    ParallelMode,
    ParamSpec,
    Role,
    Stage,
)

FAMILIES: tuple[FamilySpec, ...] = (LLAMA, QWEN2, QWEN3, QWEN3_MOE, MIXTRAL, DEEPSEEK_V3, GLM4_MOE, GLM_MOE_DSA,
                                   GPT_OSS, NEMOTRON_H, QWEN3_5, QWEN3_5_MOE, QWEN3_5_VL, QWEN3_5_MOE_VL,
                                   QWEN3_NEXT, MINIMAX_M2, DEEPSEEK_V4)

__all__ = [
    "FAMILIES", "LAYER_SPECS", "Condition", "FamilySpec", "LayerSpec", "Match", "ParallelMode", "ParamSpec",
    "Role", "Stage", "family_for_config", "get_family",
]


def get_family(name: str) -> FamilySpec:
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise UnsupportedModelError(f"unknown family {name!r}; known: {[f.name for f in FAMILIES]}")


def family_for_config(hf_config: Mapping[str, Any] | Any) -> FamilySpec:
    """Pick the spec table for an HF config (dict or ``PretrainedConfig``).

    ``architectures[0]`` decides when present (a ``...ForSequenceClassification`` of a
    supported ``model_type`` is refused, not read as its causal LM); otherwise ``model_type``.

    Raises:
        UnsupportedModelError: neither names a supported family, or ``architectures[0]`` is
            not a supported causal-LM architecture; for a family megarefit knows and cannot yet
            translate exactly (:data:`~megarefit.specs.pending.PENDING`), what is missing.
    """
    get = hf_config.get if isinstance(hf_config, Mapping) else lambda k, d=None: getattr(hf_config, k, d)
    archs = tuple(get("architectures") or ())
    model_type = get("model_type")
    for fam in FAMILIES:
        if archs and archs[0] in fam.architectures:
            return fam
    pending = pending_for(archs[0] if archs else None, model_type)
    if pending is not None:
        raise UnsupportedModelError(f"{pending.name} ({archs[0] if archs else model_type}) is refused: "
                                    f"{pending.missing}")
    if archs:
        supported = sorted(a for f in FAMILIES for a in f.architectures)
        why = ("megarefit has no spec table for it" if archs[0].endswith("ForCausalLM") else
               "only causal LMs are translated: another head (e.g. a sequence-classification score head instead of "
               "lm_head) would be translated wrongly")
        raise UnsupportedModelError(f"architecture {archs[0]!r} (model_type {model_type!r}) is refused: {why}; "
                                    f"supported: {supported}")
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    supported = sorted(a for f in FAMILIES for a in f.architectures)
    raise UnsupportedModelError(
        f"no spec table for architectures={list(archs)} model_type={model_type!r}; supported: {supported}"
    )
