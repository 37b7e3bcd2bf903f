"""Block-FP8 quantization of many tensors in one pass: one Triton launch on a GPU.

A trainer (Publisher) re-quantizes the same shards into the same registered buffers on
every ``publish``; a receiver re-quantizes the same staging tensors every cycle. So the
work is compiled once into a :class:`Fp8Quantizer`: a table with one entry per 128x128
block of every tensor (which tensor, which block row and column) and per-tensor
addresses, shapes and strides. Each call is then one kernel launch per source dtype,
each program quantizing one block::

    program p:  t, i, j = table[p]             tensor t, block (i, j)
                x   = src_t[128i:128i+128, 128j:128j+128]     (masked at the edges; read 16 rows
                                                              at a time, twice: amax, then quantize)
                s   = max(amax(|x|), 1e-4) / 448             (IEEE division, as torch)
                q_t[block] = fp8(x * (1 / s))                 (round to nearest even)
                scale_t[i, j] = s

Bit-identical to :func:`~megarefit.quant.fp8.quantize_fp8` (vLLM's formula in IEEE
arithmetic): divisions are correctly rounded (``div_rn``), the product is one fp32
multiply, and the fp32 -> e4m3 rounding is to nearest even -- the hardware conversion on
a GPU (checked bit-exact on an H200 for every finite bf16 value), integer steps under
Triton's CPU interpreter (whose fp8 cast emulation rounds some values wrongly; that path
is what the CPU test checks). Power-of-two (UE8M0) scales, CPU tensors and machines
without Triton take the torch path, tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megarefit.cuda import kernel_device
from megarefit.errors import ShapeMismatchError
from megarefit.quant.fp8 import FP8_DTYPE, FP8_MAX, SCALE_FLOOR, Fp8Format, quantize_fp8

try:  # Triton ships with CUDA builds of torch; CPU builds run the torch path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None


if triton is not None:
    @triton.jit
    def _fp8_blocks(table, src_ptrs, q_ptrs, s_ptrs, rows_a, cols_a, src_strides, q_strides, s_strides,
                    BM: tl.constexpr, BN: tl.constexpr, SRC_DTYPE: tl.constexpr, FLOOR: tl.constexpr,
                    FMAX: tl.constexpr, HW_CAST: tl.constexpr, CHUNK: tl.constexpr):
        p = tl.program_id(0)
        t = tl.load(table + 3 * p)
        bi = tl.load(table + 3 * p + 1)
        bj = tl.load(table + 3 * p + 2)
        src = tl.load(src_ptrs + t).to(tl.pointer_type(SRC_DTYPE))
        q = tl.load(q_ptrs + t).to(tl.pointer_type(tl.uint8))
        s = tl.load(s_ptrs + t).to(tl.pointer_type(tl.float32))
        n = tl.load(rows_a + t)
        k = tl.load(cols_a + t)
        src_stride = tl.load(src_strides + t)
        q_stride = tl.load(q_strides + t)
        cols = bj * BN + tl.arange(0, BN)
        # pass 1: the block's amax, CHUNK rows at a time (few registers: many blocks in flight)
        amax = tl.zeros([CHUNK, BN], dtype=tl.float32)
        for r0 in range(0, BM, CHUNK):
            rows = bi * BM + r0 + tl.arange(0, CHUNK)
            mask = (rows[:, None] < n) & (cols[None, :] < k)
            x = tl.load(src + rows[:, None] * src_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        amax = tl.maximum(tl.max(tl.max(amax, axis=1), axis=0), FLOOR)
        scale = tl.math.div_rn(amax, FMAX)
        inv = tl.math.div_rn(1.0, scale)
        # pass 2: quantize (the second read mostly hits L2)
        for r0 in range(0, BM, CHUNK):
            rows = bi * BM + r0 + tl.arange(0, CHUNK)
            mask = (rows[:, None] < n) & (cols[None, :] < k)
            x = tl.load(src + rows[:, None] * src_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HW_CAST:  # sm_89+: one conversion instruction, round to nearest even from fp32
                code = (x * inv).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            else:
                code = _e4m3_rne(x * inv)
            tl.store(q + rows[:, None] * q_stride + cols[None, :], code, mask=mask)
        tl.store(s + bi * tl.load(s_strides + t) + bj, scale)

    @triton.jit
    def _e4m3_rne(y):
        """fp32 (|y| <= 448) -> float8_e4m3fn bits, round to nearest even, in integer steps
        (a conversion instruction may round through fp16 first: two roundings)."""
        a = tl.abs(y)
        bits = a.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127  # a = 1.m * 2^e
        normal = e >= -6
        # scale a so that one e4m3 step is 1.0: 2^(3-e) for normals, 2^9 for subnormals (exact powers of two)
        shift = tl.where(normal, 3 - e, 9)
        step = ((shift + 127) << 23).to(tl.float32, bitcast=True)
        v = a * step  # < 17: adding 2^23 leaves no fraction bits, so the fp32 add rounds half to even
        m = ((v + 8388608.0) - 8388608.0).to(tl.int32)
        # normals: m in [8, 16]; 16 carries into the next binade
        carry = normal & (m == 16)
        e = tl.where(carry, e + 1, e)
        m = tl.where(carry, 8, m)
        code = tl.where(normal, ((e + 7) << 3) | (m - 8), m)  # subnormal m == 8 is the smallest normal: same bits
        code = tl.where(y.to(tl.int32, bitcast=True) < 0, code | 0x80, code)  # the sign bit: -0.0 stays -0.0
        return code.to(tl.uint8)

    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


class Fp8Quantizer:
    """Quantize ``items`` -- ``(source [N, K], fp8 out [N, K], float32 scale out)`` triples
    whose memory stays put -- on every call, into the given outputs.

    On a GPU with Triton (and ``fmt.ue8m0`` off) one launch per source dtype covers every
    block of every tensor; otherwise each tensor goes through
    :func:`~megarefit.quant.fp8.quantize_fp8`. ``items`` must be contiguous in their last
    dim; shapes are checked once, here. ``num_warps`` (Triton warps per 128x128 block) and
    ``chunk`` (rows per step): measured best on an H200 at 2 and 16 (1.13 TB/s of bf16 read
    on one 8192x8192 tensor; 4 warps / 32 rows: 0.79, 128 rows: 0.71).
    """

    def __init__(self, items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], fmt: Fp8Format,
                 num_warps: int = 2, fused: bool | None = None, chunk: int = 16):
        self.items = list(items)
        self.fmt = fmt
        self.num_warps = num_warps
        self.chunk = chunk
        for i, (src, out, scale) in enumerate(self.items):
            want = (tuple(src.shape), fmt.scale_shape(tuple(src.shape)))
            if (tuple(out.shape), tuple(scale.shape)) != want or out.dtype != FP8_DTYPE or scale.dtype != torch.float32:
                raise ShapeMismatchError(f"FP8 buffers of item {i}: expected float8_e4m3fn {want[0]} and float32 "
                                         f"{want[1]} for a source of shape {tuple(src.shape)}, got {out.dtype} "
                                         f"{tuple(out.shape)} and {scale.dtype} {tuple(scale.shape)}")
        self._launches: list[tuple] = []
        if fused is None:  # ``fused=True`` forces the kernel (CPU tensors under TRITON_INTERPRET=1, for tests)
            fused = bool(triton is not None and not fmt.ue8m0 and self.items
                         and all(t.is_cuda and t.stride(-1) == 1 for item in self.items for t in item)
                         and all(src.dtype in _TL_DTYPES for src, _, _ in self.items))
        if fused:
            by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
            for item in self.items:
                by_dtype.setdefault(item[0].dtype, []).append(item)
            for dtype, group in by_dtype.items():
                self._launches.append(self._build(dtype, group))

    @property
    def fused(self) -> bool:
        return bool(self._launches)

    def _build(self, dtype: torch.dtype, group: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple:
        device = group[0][0].device
        bm, bn = self.fmt.block
        table = []
        for t, (src, _, _) in enumerate(group):
            sm, sk = self.fmt.scale_shape(tuple(src.shape))
            table += [(t, i, j) for i in range(sm) for j in range(sk)]

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        meta = (longs([s.data_ptr() for s, _, _ in group]), longs([q.data_ptr() for _, q, _ in group]),
                longs([c.data_ptr() for _, _, c in group]), longs([s.shape[0] for s, _, _ in group]),
                longs([s.shape[1] for s, _, _ in group]), longs([s.stride(0) for s, _, _ in group]),
                longs([q.stride(0) for _, q, _ in group]), longs([c.stride(0) for _, _, c in group]))
        return (longs([v for row in table for v in row]), meta, len(table), bm, bn, _TL_DTYPES[dtype])

    def __call__(self) -> None:
        if not self._launches:
            for src, out, scale in self.items:
                quantize_fp8(src, self.fmt, out=out, scale_out=scale)
            return
        hw_cast = bool(self.items[0][0].is_cuda)  # Triton's CPU interpreter rounds fp8 casts wrongly
        with kernel_device(self.items[0][0].device):  # launches go to the current device: make it the items'
            for table, meta, programs, bm, bn, dtype in self._launches:
                _fp8_blocks[(programs,)](table, *meta, BM=bm, BN=bn, SRC_DTYPE=dtype, FLOOR=SCALE_FLOOR,
                                         FMAX=FP8_MAX, HW_CAST=hw_cast, CHUNK=min(self.chunk, bm),
                                         num_warps=self.num_warps)


__all__ = ["Fp8Quantizer"]
