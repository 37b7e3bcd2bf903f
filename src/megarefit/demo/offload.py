"""Parameter moves as RL trainers make them, on CPU, for tests and benchmarks of declared moves.

* :func:`offload_like_verl`: what verl's ``offload_megatron_model_to_cpu`` / ``load_megatron_model_to_gpu``
  do to each Megatron-Core DDP parameter buffer -- keep a host copy, ``storage().resize_(0)`` (the
  memory is freed), later ``resize_`` back and copy the values in. Here other allocations take
  the freed memory meanwhile (as the rollout's would), so the parameters come back at new addresses.
* :func:`remap_like_memory_saver`: what ``torch_memory_saver``'s pause / resume does -- the physical
  pages behind the buffer are released and fresh ones mapped at the same virtual addresses (here
  ``mmap(MAP_FIXED)`` over every whole page inside the buffer; the values are then copied back).
  Addresses stay; what was registered for them is gone.

Both act on every parameter buffer of ``ddp`` (``buffers`` and ``expert_parallel_buffers``), or
on those of the indexes in ``only``; they return each buffer's (address before, address after).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from megarefit.errors import MegarefitError


def param_buffers(ddp: Any) -> list[Any]:
    """The Megatron-Core DDP parameter-and-gradient buffers of ``ddp``, dense first, then expert."""
    return list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))


@contextlib.contextmanager
def offload_like_verl(ddp: Any, only: Sequence[int] | None = None) -> Iterator[list[tuple[int, int]]]:
    """Inside the block the chosen parameter buffers are offloaded (storage resized to 0, their
    memory taken by another allocation); at its end they are re-allocated and refilled. Yields
    the (old, new) address list, filled at the end."""
    chosen = [b for i, b in enumerate(param_buffers(ddp)) if only is None or i in only]
    saved = []
    for buf in chosen:
        data = buf.param_data
        saved.append((data.data_ptr(), data.detach().clone(), data.untyped_storage().nbytes()))
        data.untyped_storage().resize_(0)
    squatters = [_squat(old, nbytes) for old, _, nbytes in saved]  # the rollout's memory, over the freed
    moves: list[tuple[int, int]] = []
    yield moves
    for buf, (old, host, nbytes) in zip(chosen, saved):
        storage = buf.param_data.untyped_storage()
        storage.resize_(nbytes)
        for _ in range(4):  # no squatter landed on it and the freed block came back: hold it, allocate again
            if buf.param_data.data_ptr() != old:
                break
            storage.resize_(0)
            squatters.append([torch.empty(nbytes, dtype=torch.uint8)])
            storage.resize_(nbytes)
        buf.param_data.copy_(host)
        moves.append((old, buf.param_data.data_ptr()))
    for held in squatters:
        if isinstance(held, tuple):
            _LIBC.munmap(*held)
    del squatters


def _squat(addr: int, nbytes: int, tries: int = 8) -> object:
    """Take the memory at ``addr`` freed by a resize, so the buffer comes back elsewhere: where it
    was unmapped (glibc serves large blocks by mmap), a reservation of its pages (``(start,
    length)`` to unmap later); else allocations of ``nbytes`` until one lands on it (at most ``tries``)."""
    page = mmap.PAGESIZE
    lo, hi = addr // page * page, -(-(addr + nbytes) // page) * page
    got = _LIBC.mmap(lo, hi - lo, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x100000, -1, 0)
    if got == lo:  # 0x100000: MAP_FIXED_NOREPLACE, refused where anything is mapped there
        return (lo, hi - lo)
    if got not in (None, ctypes.c_void_p(-1).value):
        _LIBC.munmap(got, hi - lo)  # an old kernel took the flag as a hint: not ours
    held = []
    for _ in range(tries):
        held.append(torch.empty(nbytes, dtype=torch.uint8))
        if held[-1].data_ptr() == addr:
            break
    return held


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _remap(addr: int, nbytes: int) -> tuple[int, int]:
    """Map fresh zero pages over every whole page inside ``[addr, addr + nbytes)``; the byte
    range remapped, relative to ``addr``.

    Raises:
        MegarefitError: the kernel refused, or mapped elsewhere (names the range and errno)."""
    page = mmap.PAGESIZE
    lo, hi = -(-addr // page) * page, (addr + nbytes) // page * page
    if hi <= lo:
        return 0, 0
    got = _LIBC.mmap(lo, hi - lo, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10, -1, 0)  # 0x10: MAP_FIXED
    if got != lo:
        raise MegarefitError(f"mmap(MAP_FIXED) over [{lo:#x}, {hi:#x}) returned {got}, errno {ctypes.get_errno()}")
    return lo - addr, hi - addr


@contextlib.contextmanager
def remap_like_memory_saver(ddp: Any, only: Sequence[int] | None = None) -> Iterator[list[tuple[int, int]]]:
    """Inside the block the chosen parameter buffers' pages are replaced by fresh zero pages at
    the same addresses (their values held on the host); at its end the values are copied back.
    Yields the (old, new) address list (equal pairs), filled at the end, and raises
    ``MegarefitError`` where the pages were not replaced (a buffer reads other than zero inside)."""
    chosen = [b for i, b in enumerate(param_buffers(ddp)) if only is None or i in only]
    saved = []
    for buf in chosen:
        data = buf.param_data
        host = data.detach().clone()
        lo, hi = _remap(data.data_ptr(), data.numel() * data.element_size())
        if bool(data.view(-1).view(torch.uint8)[lo:hi].any()):
            raise MegarefitError("the remapped pages still hold the old values: the mapping was not replaced")
        if hi <= lo:
            raise MegarefitError(f"a parameter buffer of {data.numel() * data.element_size()} bytes holds no whole page")
        saved.append((data.data_ptr(), host))
    moves: list[tuple[int, int]] = []
    yield moves
    for buf, (old, host) in zip(chosen, saved):
        buf.param_data.copy_(host)
        moves.append((old, buf.param_data.data_ptr()))


__all__ = ["offload_like_verl", "param_buffers", "remap_like_memory_saver"]
