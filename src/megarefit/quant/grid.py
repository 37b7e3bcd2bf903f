"""The block-FP8 grid against a plan's boxes: where a shard can be quantized on its own grid.

A trainer quantizes its shard on the shard's *local* 128x128 grid; that equals the HF
tensor's *global* grid exactly when every op's boxes start on block boundaries in both
tensors and span whole blocks (or end where both tensors end). :func:`misaligned` says
why an op fails that, :func:`scale_box` maps a weight box to its scale entries.
"""

from __future__ import annotations

from megarefit.layout.parallel import Box
from megarefit.plan.ops import CopyOp
from megarefit.quant.fp8 import Fp8Format


def misaligned(op: CopyOp, src_shape: tuple[int, ...], dst_shape: tuple[int, ...], fmt: Fp8Format) -> str | None:
    """Why ``op``'s bytes cannot be quantized on its source's local block grid, or ``None``."""
    where = f"{op.src.name} on rank {op.src.rank}"
    if op.transpose or op.src_view is not None:
        return f"{where}: legacy GroupedMLP blocks are stored transposed"
    if len(src_shape) != 2 or len(dst_shape) != 2:
        return f"{where}: not a 2-D shard"
    for d, b in enumerate(fmt.block):
        so, do, n = op.src_box.offsets[d], op.dst_box.offsets[d], op.src_box.lengths[d]
        ends = so + n == src_shape[d] and do + n == dst_shape[d]  # an edge block must be one in both
        if not (fmt.on_grid(d, so, n, src_shape[d]) and fmt.on_grid(d, do, n, dst_shape[d])) or (n % b and not ends):
            what = "rows" if d == 0 else "columns"
            return (f"{where}: {what} [{so}, {so + n}) land at {op.dst.name} {what} [{do}, {do + n}), off the "
                    f"{b}-{what[:-1]} block grid")
    return None


def scale_box(box: Box, fmt: Fp8Format) -> Box:
    """The box of scale entries covering ``box`` of a weight (block indices, edge blocks included)."""
    if len(box.offsets) == 2:  # the common case, spelled out (called once per op of a 671B plan)
        (o0, o1), (n0, n1), (b0, b1) = box.offsets, box.lengths, fmt.block
        return Box((o0 // b0, o1 // b1), (-(-n0 // b0), -(-n1 // b1)))
    return Box(tuple(o // b for o, b in zip(box.offsets, fmt.block)),
               tuple(-(-n // b) for n, b in zip(box.lengths, fmt.block)))


__all__ = ["misaligned", "scale_box"]
