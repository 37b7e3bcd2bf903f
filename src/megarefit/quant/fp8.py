"""Block-FP8 weights: the HF / vLLM fine-grained FP8 checkpoint convention.

``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [128, 128]}`` (DeepSeek-V3, Kimi-K2, Qwen3 / GLM FP8
checkpoints). A linear weight ``W [N, K]`` (elements) is stored as::

    weight            float8_e4m3fn [N, K]
    weight_scale_inv  float32       [ceil(N/128), ceil(K/128)]     one scale per block

          K ->  128   128   128  (K % 128)
    N   +-----+-----+-----+--+
    |   | s00 | s01 | s02 |s03|      block (i, j) = W[128i : 128i+128, 128j : 128j+128]
    v   +-----+-----+-----+--+       (edge blocks are partial)
        | s10 | s11 | s12 |s13|      s_ij = max(amax(|block|), 1e-4) / 448
        +-----+-----+-----+--+       weight = fp8(W * (1 / s_ij)),  W ~ weight * s_ij

exactly as vLLM's ``per_block_cast_to_fp8`` (and DeepGEMM) compute it, including the
order of operations (``amax / 448``, then ``x * (1 / s)`` in fp32, then a round-to-nearest
cast), so the bytes are identical. ``ue8m0=True`` rounds each scale up to a power of two
(vLLM's ``use_ue8m0``). Quantized: every attention, MLP, expert and shared-expert linear
weight (spec rows' ``is_linear_weight``); never embeddings, ``lm_head``, norms, the
router gate, biases, ``e_score_correction_bias``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megarefit.errors import MegarefitError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
SCALE_FLOOR = 1e-4  # amax clamp: an all-zero block gets scale 1e-4 / 448
SCALE_SUFFIX = "_scale_inv"  # weight -> weight_scale_inv


class UnsupportedQuantizationError(MegarefitError):
    """A quantization method or setting megarefit does not produce (names it)."""


@dataclass(frozen=True)
class Fp8Format:
    """Block-FP8 settings: block ``(rows, cols)`` in elements, power-of-two scales or not."""

    block: tuple[int, int] = (128, 128)
    ue8m0: bool = False

    def __post_init__(self) -> None:
        if len(self.block) != 2 or any(not isinstance(b, int) or b < 1 for b in self.block):
            raise UnsupportedQuantizationError(f"FP8 weight_block_size {list(self.block)} must be two positive ints")
        object.__setattr__(self, "block", tuple(self.block))

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any] | Any) -> Fp8Format | None:
        """The config's ``quantization_config`` as an :class:`Fp8Format`; ``None`` without one.

        Raises:
            UnsupportedQuantizationError: a method other than block FP8 (mxfp4,
                compressed-tensors, per-tensor fp8, static activations, e5m2, ...), or routed
                experts in another format (DeepSeek-V4's ``expert_dtype`` ``fp4``).
        """
        get = hf_config.get if isinstance(hf_config, Mapping) else lambda k, d=None: getattr(hf_config, k, d)
        qc = get("quantization_config")
        if not qc:
            return None
        if not isinstance(qc, Mapping):
            qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
        method = qc.get("quant_method")
        if method != "fp8":
            raise UnsupportedQuantizationError(
                f"quantization method {method!r} (the config's quantization_config) is not produced; megarefit "
                "refits the model dtype (quantization='none', CLI --quantization none: bf16) or block FP8 "
                "(quant_method 'fp8' with weight_block_size)")
        if get("expert_dtype") not in (None, "fp8"):  # DeepSeek-V4-Flash: routed experts in MXFP4
            raise UnsupportedQuantizationError(
                f"expert_dtype {get('expert_dtype')!r} (the config's routed experts) is not produced; megarefit "
                "refits the model dtype (quantization='none', CLI --quantization none: bf16) or block FP8 "
                "(expert_dtype 'fp8')")
        block = qc.get("weight_block_size")
        if not block:
            raise UnsupportedQuantizationError("fp8 without weight_block_size (per-tensor scales) is not produced; "
                                               "use block FP8 (weight_block_size [128, 128])")
        if qc.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):  # MiniMax-M2 spells torch's dtype name
            raise UnsupportedQuantizationError(f"fp8 fmt {qc.get('fmt')!r}: only e4m3 (float8_e4m3fn) is produced")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise UnsupportedQuantizationError(f"fp8 activation_scheme {qc.get('activation_scheme')!r}: only "
                                               "'dynamic' (no activation scales in the checkpoint) is produced")
        return cls(tuple(int(b) for b in block), bool(qc.get("scale_fmt") == "ue8m0"))  # type: ignore[arg-type]

    def to_hf(self) -> dict[str, Any]:
        """The ``quantization_config`` entry of an HF ``config.json``."""
        out: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": list(self.block)}
        if self.ue8m0:
            out["scale_fmt"] = "ue8m0"
        return out

    def on_grid(self, dim: int, offset: int, length: int, size: int) -> bool:
        """Whether elements ``[offset, offset+length)`` of a tensor dim of ``size`` (``dim`` 0:
        rows, 1: columns) cover whole blocks of its grid -- an edge block counts when the run
        reaches the end of the dim. Only such runs quantize the same on their own."""
        b = self.block[dim]
        return offset % b == 0 and (length % b == 0 or offset + length == size)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """``[ceil(N/block_rows), ceil(K/block_cols)]`` for a weight of ``shape`` ``[N, K]``."""
        if len(shape) != 2:
            raise UnsupportedQuantizationError(f"block FP8 quantizes 2-D weights, got shape {tuple(shape)}")
        return (math.ceil(shape[0] / self.block[0]), math.ceil(shape[1] / self.block[1]))


def resolve_quantization(quantization: str | Fp8Format | None, hf_config: Mapping[str, Any] | Any
                         ) -> Fp8Format | None:
    """``"auto"`` / ``None``: the config's ``quantization_config``; ``"fp8"``: block FP8 (the
    config's block size if it has one, else 128x128); ``"none"``: no quantization.

    Raises:
        UnsupportedQuantizationError: an unknown name, a config method megarefit does not produce, or
            block FP8 for a config its family cannot serve so (DeepSeek-V4 without ``expert_dtype: fp8``).
    """
    if isinstance(quantization, Fp8Format):
        fmt: Fp8Format | None = quantization
    elif quantization in (None, "auto"):
        fmt = Fp8Format.from_hf_config(hf_config)
    elif quantization == "none":
        return None
    elif quantization == "fp8":
        try:
            fmt = Fp8Format.from_hf_config(hf_config) or Fp8Format()
        except UnsupportedQuantizationError:
            fmt = Fp8Format()
    else:
        raise UnsupportedQuantizationError(f"quantization {quantization!r}: expected 'fp8', 'none' or 'auto'")
    if fmt is not None:
        _check_family_fp8(hf_config)
    return fmt


def _check_family_fp8(hf_config: Mapping[str, Any] | Any) -> None:
    """Raise :class:`UnsupportedQuantizationError` where the config's family needs other config values for
    block FP8 (``FamilySpec.fp8_config_requires``); a config of no known family is left to the planner,
    which refuses it by name."""
    from megarefit.errors import UnsupportedModelError
    from megarefit.specs import family_for_config

    get = hf_config.get if isinstance(hf_config, Mapping) else lambda k, d=None: getattr(hf_config, k, d)
    try:
        family = family_for_config(hf_config)
    except UnsupportedModelError:
        return
    for key, value in family.fp8_config_requires:
        if get(key) != value:
            raise UnsupportedQuantizationError(
                f"{family.name}: block FP8 needs {key}={value!r} in the config vLLM serves, got {get(key)!r} (vLLM "
                f"reads the routed experts as another format then); set it, or refit the model dtype "
                "(quantization='none', CLI --quantization none)")


def _ceil_pow2(x: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, torch.ceil(torch.log2(x.abs())))


@torch.no_grad()
def quantize_fp8(w: torch.Tensor, fmt: Fp8Format = Fp8Format(), *, out: torch.Tensor | None = None,
                 scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize ``w`` ``[N, K]`` (bf16 / fp16 / fp32) into ``(weight, weight_scale_inv)``.

    ``weight`` is float8_e4m3fn ``[N, K]``, ``weight_scale_inv`` float32
    ``fmt.scale_shape((N, K))``; written into ``out`` / ``scale_out`` when given
    (contiguous, those dtypes and shapes; nothing is allocated for the results then).
    Bit-identical to vLLM's ``per_block_cast_to_fp8(w, fmt.block, fmt.ue8m0)``.

    Raises:
        UnsupportedQuantizationError: ``w`` is not a 2-D floating-point tensor, or an
            output buffer has the wrong dtype / shape.
    """
    if w.dim() != 2 or not w.dtype.is_floating_point or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise UnsupportedQuantizationError(f"block FP8 quantizes 2-D bf16/fp16/fp32 weights, got {w.dtype} "
                                           f"{tuple(w.shape)}")
    n, k = w.shape
    (bm, bn), (sm, sk) = fmt.block, fmt.scale_shape(tuple(w.shape))
    if out is None:
        out = torch.empty((n, k), dtype=FP8_DTYPE, device=w.device)
    if scale_out is None:
        scale_out = torch.empty((sm, sk), dtype=torch.float32, device=w.device)
    if out.dtype != FP8_DTYPE or tuple(out.shape) != (n, k) or scale_out.dtype != torch.float32 or (
            tuple(scale_out.shape) != (sm, sk)):
        raise UnsupportedQuantizationError(f"FP8 output buffers must be float8_e4m3fn {(n, k)} and float32 "
                                           f"{(sm, sk)}, got {out.dtype} {tuple(out.shape)} and "
                                           f"{scale_out.dtype} {tuple(scale_out.shape)}")
    if n % bm or k % bn:  # edge blocks: pad with zeros (they do not change a block's amax)
        padded = w.new_zeros((sm * bm, sk * bn))
        padded[:n, :k] = w
    else:
        padded = w
    blocks = padded.reshape(sm, bm, sk, bn)
    amax = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(SCALE_FLOOR)
    # correctly rounded divisions on every device (CUDA turns a division by a Python scalar
    # into a multiplication by its reciprocal, which is not always the same float)
    scale = amax / torch.full_like(amax, FP8_MAX)
    if fmt.ue8m0:
        scale = _ceil_pow2(scale)
    q = (blocks * torch.reciprocal(scale)).to(FP8_DTYPE).view(sm * bm, sk * bn)
    out.copy_(q[:n, :k])
    scale_out.copy_(scale.view(sm, sk))
    return out, scale_out


@torch.no_grad()
def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, fmt: Fp8Format = Fp8Format(),
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``weight * scale_inv`` per block, in fp32, cast to ``dtype`` (transformers' and vLLM's
    dequantization: one fp32 product per element, so any implementation agrees)."""
    bm, bn = fmt.block
    s = scale_inv.float().repeat_interleave(bm, 0)[:weight.shape[0]].repeat_interleave(bn, 1)[:, :weight.shape[1]]
    return (weight.float() * s).to(dtype)


def scale_name(weight_name: str) -> str:
    """``...proj.weight`` -> ``...proj.weight_scale_inv`` (the HF / vLLM checkpoint spelling)."""
    return weight_name + SCALE_SUFFIX


__all__ = ["FP8_DTYPE", "FP8_MAX", "Fp8Format", "UnsupportedQuantizationError", "dequantize_fp8", "quantize_fp8",
           "resolve_quantization", "scale_name"]
