"""Gated-DeltaNet decoder layers (Qwen3.5, Qwen3-Next) for the CPU harness, on every verified Megatron-Core (0.16.1+).

Megatron-Core builds these models as Megatron-Bridge configures them: a ``GPTModel`` whose layers
mix ``GatedDeltaNet`` (``experimental_attention_variant="gated_delta_net"``, the layers in
``linear_attention_freq``) and gated full attention (``attention_output_gate=True``), every norm
zero-centered (``layernorm_zero_centered_gamma=True``: the weight stores w - 1), MoE with a gated
shared expert. Megatron-Core's own spec builder for them is Transformer-Engine only; the layer specs
here are the same modules on its local backend (``ColumnParallelLinear`` / ``RowParallelLinear``,
separate input norms: the ``local`` spelling of megarefit's tables).

What makes them run on CPU (nothing about the weights' layout changes):

* ``fla`` (flash-linear-attention) is absent: the GDN's module flag says it is there, its ``l2norm``
  is torch's (what fla computes), and the forward takes the deterministic torch path
  (``deterministic_mode``: ``F.conv1d`` and Megatron's ``torch_chunk_gated_delta_rule``);
* norms: :class:`ZeroCenteredRMSNorm` computes ``(1 + w) * rmsnorm(x)`` as Transformer Engine's
  ``TENorm`` with ``zero_centered_gamma`` does (Megatron's local ``WrappedTorchNorm`` refuses it);
* the CUDA RNG tracker's ``fork`` is a no-op (no dropout runs);
* the methods Megatron decorates with ``jit_fuser`` (``torch.compile``) run uncompiled: the same
  functions, without a minute of C++ compilation on CPU.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch


class ZeroCenteredRMSNorm(torch.nn.Module):
    """``(1 + weight) * x / rms(x)`` in fp32 (the weight stores w - 1), for Megatron's norm slots
    (``build_module(norm, config=, hidden_size=, eps=)``); as HF Qwen3.5's ``Qwen3_5RMSNorm``."""

    def __init__(self, config: Any = None, hidden_size: int = 0, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        dtype = getattr(config, "params_dtype", torch.float32)
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def patch_gdn_cpu() -> None:
    """Let Megatron-Core's ``GatedDeltaNet`` build and run on CPU without fla (module docstring)."""
    from megatron.core.ssm import gated_delta_net
    from megatron.core.tensor_parallel import random as mrandom

    common = gated_delta_net.common if hasattr(gated_delta_net, "common") else gated_delta_net
    common.HAVE_FLA = True
    common.l2norm = lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    for cls in {getattr(common, "_GDNBase", None), gated_delta_net.GatedDeltaNet} - {None}:
        for name, fn in list(vars(cls).items()):  # Megatron's jit_fuser (torch.compile): the plain function,
            if hasattr(fn, "_torchdynamo_orig_callable"):  # as compiling it with a C++ toolchain takes a minute
                setattr(cls, name, fn._torchdynamo_orig_callable)


def gdn_config_kwargs(linear: tuple[bool, ...], dims: dict[str, int]) -> dict[str, Any]:
    """``TransformerConfig`` options of a gated-DeltaNet hybrid: ``linear`` per layer (True: GDN),
    ``dims``: ``linear_num_key_heads``, ``linear_num_value_heads``, ``linear_key_head_dim``,
    ``linear_value_head_dim``, ``linear_conv_kernel_dim`` (HF's names, Megatron's too)."""
    return dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=[int(x) for x in linear],
                attention_output_gate=True, layernorm_zero_centered_gamma=True, deterministic_mode=True,
                **dims)


def gdn_layer_specs(base: Any, linear: tuple[bool, ...]) -> list[Any]:
    """One layer spec per layer from ``base`` (Megatron-Core's local GPT layer spec, MoE or dense):
    GDN layers' attention swapped for ``GatedDeltaNet`` and every norm zero-centered."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    out = []
    for is_gdn in linear:
        spec = copy.deepcopy(base)
        sub = spec.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
        if is_gdn:
            sub.self_attention = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
                in_proj=ColumnParallelLinear, out_norm=ZeroCenteredRMSNorm, out_proj=RowParallelLinear))
        else:
            sub.self_attention.submodules.q_layernorm = ZeroCenteredRMSNorm
            sub.self_attention.submodules.k_layernorm = ZeroCenteredRMSNorm
        out.append(spec)
    return out


__all__ = ["ZeroCenteredRMSNorm", "gdn_config_kwargs", "gdn_layer_specs", "patch_gdn_cpu"]
