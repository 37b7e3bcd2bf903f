"""Which HF tensors a block-FP8 checkpoint stores quantized, and whole-state conversion.

The rule is the spec table's: a row's HF tensors are quantized when the row is a linear
layer's weight (``ParamSpec.is_linear_weight``: attention q/k/v/o and MLA projections,
dense and shared-expert MLPs, routed experts, MTP ``eh_proj``); embeddings, ``lm_head``,
norms, router gates, biases and ``e_score_correction_bias`` stay in the model dtype, as
in the published FP8 checkpoints (DeepSeek-V3, Kimi-K2, Qwen3-FP8) and vLLM's FP8
linear methods.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

import torch

from megarefit.layout.dims import ModelDims
from megarefit.quant.fp8 import SCALE_SUFFIX, Fp8Format, dequantize_fp8, quantize_fp8, scale_name
from megarefit.specs.table import Stage


@lru_cache(maxsize=32)
def quantized_weight_templates(dims: ModelDims) -> frozenset[str]:
    """The HF name templates (``model.layers.{layer}.self_attn.q_proj.weight``) of the rows
    :func:`quantized_weight_names` expands: a row's instances are all quantized or none."""
    return frozenset(t for row in dims.spec.rows(dims.conditions(1)) if not row.duplicate for t in row.quantized_hf)


@lru_cache(maxsize=32)
def quantized_weight_names(dims: ModelDims) -> frozenset[str]:
    """HF names (on-disk checkpoint names) of every weight a block-FP8 checkpoint quantizes."""
    rows = dims.spec.rows(dims.conditions(1))
    out: set[str] = set()
    for row in rows:
        if not row.quantized_hf or row.duplicate:
            continue
        if row.stage in (Stage.LAYER, Stage.MTP):  # MTP layer i is HF layer num_layers + i
            first = 0 if row.stage is Stage.LAYER else dims.num_layers
            count = dims.num_layers if row.stage is Stage.LAYER else dims.mtp_layers
            layers: list[int | None] = [i for i in range(first, first + count) if dims.has_row(row, i)]
        else:
            layers = [None]
        experts = range(dims.num_experts) if row.per_expert or row.role.is_grouped else [None]
        for layer in layers:
            for expert in experts:
                out.update(n for k, n in enumerate(row.hf_names(layer, expert)) if k not in row.unquantized)
    return frozenset(out)


@lru_cache(maxsize=32)
def unquantized_linear_modules(dims: ModelDims) -> tuple[str, ...]:
    """Modules with a 2-D weight that block-FP8 checkpoints keep unquantized: the router
    gates (vLLM builds some, e.g. Qwen3-MoE's, with the FP8 method unless the config lists
    them in ``modules_to_not_convert``), ``lm_head`` and a linear's ``unquantized`` HF tensors
    (gated DeltaNet's ``in_proj_b`` / ``in_proj_a`` / ``in_proj_ba``)."""
    out: list[str] = []
    for row in dims.spec.rows(dims.conditions(1)):
        kept = [k for k, t in enumerate(row.hf) if t not in row.quantized_hf]
        if not kept or row.duplicate or len(row.shape) != 2 or not row.hf[0].endswith(".weight"):
            continue
        if row.stage is Stage.LAYER:
            layers = [i for i in range(dims.num_layers) if dims.has_row(row, i)]
            out += [row.hf_names(i)[k].removesuffix(".weight") for i in layers for k in kept]
        elif row.stage is Stage.LAST:
            out += [row.hf_names()[k].removesuffix(".weight") for k in kept]
    return tuple(n for n in out if not n.endswith("embed_tokens"))


def quantization_config(dims: ModelDims, fmt: Fp8Format) -> dict:
    """The ``quantization_config`` of the block-FP8 checkpoint megarefit writes for ``dims``:
    ``fmt.to_hf()`` plus ``modules_to_not_convert`` (:func:`unquantized_linear_modules`),
    which both transformers and vLLM (as ``ignored_layers``) honour."""
    return fmt.to_hf() | {"modules_to_not_convert": list(unquantized_linear_modules(dims))}


def quantize_state(hf: Mapping[str, torch.Tensor], dims: ModelDims, fmt: Fp8Format) -> dict[str, torch.Tensor]:
    """Full HF tensors -> the block-FP8 checkpoint: each quantized weight becomes ``weight``
    (float8_e4m3fn) and ``weight_scale_inv`` (float32), in place in the dict order; the
    rest pass through unchanged."""
    names = quantized_weight_names(dims)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf.items():
        if name in names:
            out[name], out[scale_name(name)] = quantize_fp8(tensor, fmt)
        else:
            out[name] = tensor
    return out


def dequantize_state(state: Mapping[str, torch.Tensor], fmt: Fp8Format,
                     dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The inverse direction for reading: every ``weight`` with a ``weight_scale_inv``
    beside it, dequantized to ``dtype``; other tensors unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = state.get(scale_name(name))
        out[name] = tensor if scale is None else dequantize_fp8(tensor, scale, fmt, dtype)
    return out


__all__ = ["dequantize_state", "quantization_config", "quantize_state", "quantized_weight_names",
           "unquantized_linear_modules"]
