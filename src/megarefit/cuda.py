"""CUDA device helpers shared by the Triton kernels (:mod:`megarefit.quant.kernel`,
:mod:`megarefit.transport.boxcopy`)."""

from __future__ import annotations

import contextlib

import torch


def kernel_device(device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.cuda.device(device)`` for a CUDA device, else a no-op. Every Triton launch runs
    inside it: Triton launches on the *current* device, so a launch on tensors of another
    device fails ("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


__all__ = ["kernel_device"]
