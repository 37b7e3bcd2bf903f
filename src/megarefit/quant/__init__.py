"""Quantized refit targets: block FP8 (the HF / vLLM fine-grained FP8 checkpoint format)."""

from megarefit.quant.fp8 import (
                                 FP8_DTYPE,
                                 Fp8Format,
                                 UnsupportedQuantizationError,
                                 dequantize_fp8,
                                 quantize_fp8,
                                 resolve_quantization,
                                 scale_name,
)
from megarefit.quant.scheme import (
                                 dequantize_state,
                                 quantization_config,
                                 quantize_state,
                                 quantized_weight_names,
                                 unquantized_linear_modules,
)

__all__ = ["FP8_DTYPE", "Fp8Format", "UnsupportedQuantizationError", "dequantize_fp8", "dequantize_state",
           "quantization_config", "quantize_fp8", "quantize_state", "quantized_weight_names", "resolve_quantization",
           "scale_name", "unquantized_linear_modules"]
