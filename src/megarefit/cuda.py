"""CUDA device helpers shared by the Triton kernels (:mod:`megarefit.quant.kernel`,
:mod:`megarefit.transport.boxcopy`)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch


def kernel_device(device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.cuda.device(device)`` for a CUDA device, else a no-op. Every Triton launch runs
    inside it: Triton launches on the *current* device, so a launch on tensors of another
    device fails ("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class KernelCheck:
    """Whether a Triton kernel is used on a CUDA device: checked once per device on a known
    answer (``check(device)`` returns whether it came out right); a wrong answer, or any
    exception (Triton imports but cannot compile or run there), warns once naming ``what`` and
    ``instead`` (what runs in its place) and is remembered, as a pass is."""

    def __init__(self, what: str, instead: str):
        self.what, self.instead = what, instead
        self.passed: set[torch.device] = set()
        self.failed: dict[torch.device, str] = {}

    def __call__(self, device: torch.device, check: Callable[[torch.device], bool]) -> bool:
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        if device in self.passed or device in self.failed:
            return device in self.passed
        try:
            if not check(device):
                raise RuntimeError("a known answer came out wrong")
        except Exception as exc:  # noqa: BLE001 - any failure means: not on this device, said once
            self.failed[device] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"megarefit: the {self.what} is not used on {device} ({self.failed[device][:200]}); "
                          f"{self.instead}", stacklevel=3)
            return False
        self.passed.add(device)
        return True


__all__ = ["KernelCheck", "kernel_device"]
