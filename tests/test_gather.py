"""Gathered pulls (transport/gather.py) and batched box copies (transport/boxcopy.py).

The wave planner is checked as data (every piece inside exactly one run, runs inside
one region, slots aligned like their source, waves within the cap); the box
decomposition by replaying its byte boxes with plain slicing against ``copy_``; the
Triton kernel under Triton's CPU interpreter against ``copy_`` of the same pairs.
(End to end over NIXL: tests/test_online_faults.py::test_gathered_waves_over_nixl.)
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarefit.transport.boxcopy import box_entries
from megarefit.transport.gather import ALIGN, Piece, plan_waves


@st.composite
def _pieces(draw):
    pieces, key = [], 0
    for region in range(draw(st.integers(1, 3))):
        base = region * 10**9 + draw(st.integers(0, 64)) * 2
        addr = base
        for _ in range(draw(st.integers(0, 12))):
            addr += draw(st.integers(0, 3000)) * 2
            n = draw(st.integers(1, 4000)) * 2
            pieces.append(Piece(draw(st.sampled_from([region, region, -1])), addr, n, key))
            key += 1
            if draw(st.booleans()):
                addr += n  # touching; otherwise the next piece may overlap this one
    return pieces


@settings(max_examples=300, deadline=None)
@given(pieces=_pieces(), cap=st.integers(64, 20000), gap=st.integers(0, 5000))
def test_waves_cover_every_piece_once(pieces, cap, gap):
    waves = plan_waves(pieces, cap=cap, gap=gap)
    seen = {}
    for w, wave in enumerate(waves):
        spans = sorted((run.slot, run.slot + run.nbytes) for run in wave.runs)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "slots of one wave overlap"
        assert wave.nbytes == max(end for _, end in spans)
        assert wave.nbytes <= cap or len(wave.runs) == 1
        for run in wave.runs:
            assert run.slot % ALIGN == run.addr % ALIGN
            big = max(p.nbytes for p in pieces if p.key in {k for k, _ in run.pieces})
            assert run.nbytes <= max(cap, big + gap + cap)
            for key, off in run.pieces:
                p = next(p for p in pieces if p.key == key)
                assert key not in seen
                seen[key] = w
                assert p.region == run.region and (p.region >= 0 or len(run.pieces) == 1)
                assert run.addr + off == p.addr and off + p.nbytes <= run.nbytes
    assert seen.keys() == {p.key for p in pieces}
    order = [w for p in sorted(pieces, key=lambda p: (p.region, p.addr, p.key)) for w in [seen[p.key]]]
    assert order == sorted(order), "waves follow the trainer's memory order"


def test_wave_planner_refuses_a_zero_cap():
    with pytest.raises(ValueError, match="cap > 0"):
        plan_waves([Piece(0, 0, 8, 0)], cap=0, gap=0)


def _replay(entries, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Apply byte boxes with plain slicing of two whole contiguous tensors."""
    d_bytes, s_bytes = dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
    d0, s0 = dst.data_ptr(), src.data_ptr()
    for d, s, rows, cols, dr, sr in entries:
        for r in range(rows):
            a, b = d - d0 + r * dr, s - s0 + r * sr
            d_bytes[a:a + cols] = s_bytes[b:b + cols]


@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from([torch.uint8, torch.bfloat16, torch.float32, torch.float64]),
       shape=st.lists(st.integers(1, 7), min_size=1, max_size=4), data=st.data())
def test_box_entries_replay_equals_copy(dtype, shape, data):
    """Any box of a contiguous tensor copied into any box of another (each side's box a
    slice of a larger tensor): the entries' bytes equal ``copy_``, nothing else written."""
    outer_s = [n + data.draw(st.integers(0, 3)) for n in shape]
    outer_d = [n + data.draw(st.integers(0, 3)) for n in shape]
    src_full = torch.arange(1, 1 + torch.Size(outer_s).numel(), dtype=torch.int64).to(dtype).reshape(outer_s)
    offs_s = [data.draw(st.integers(0, o - n)) for o, n in zip(outer_s, shape)]
    offs_d = [data.draw(st.integers(0, o - n)) for o, n in zip(outer_d, shape)]
    src = src_full[tuple(slice(o, o + n) for o, n in zip(offs_s, shape))]
    want = torch.zeros(outer_d, dtype=dtype)
    got = torch.zeros(outer_d, dtype=dtype)
    box = tuple(slice(o, o + n) for o, n in zip(offs_d, shape))
    want[box].copy_(src)
    entries = box_entries(got[box], src)
    _replay(entries, got, src_full)
    assert torch.equal(got, want)


KERNEL_CHECK = """
import os
import torch
from megarefit.transport.boxcopy import BoxCopies
g = torch.Generator().manual_seed(0)
src = torch.randint(0, 255, (1 << 18,), dtype=torch.uint8, generator=g).to(os.environ.get("DEV", "cpu"))
pairs_for = {}
bad = []
for dtype in (torch.uint8, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int64):
    s = src.view(dtype)
    item = s.element_size()
    dst = torch.zeros_like(s)
    ref = torch.zeros_like(s)
    pairs = []
    # row-parallel columns into a wider row, a 3-D box with gaps, odd-offset runs, one element
    pairs.append((dst[100:100 + 37 * 64].view(37, 64)[:, 8:32], s[:37 * 24].view(37, 24)))
    pairs.append((dst[3000:3000 + 4 * 8 * 10].view(4, 8, 10), s[5000:5000 + 640].view(4, 10, 16)[:, 1:9, 3:13]))
    pairs.append((dst[8001:8001 + 5003], s[13003:13003 + 5003]))
    pairs.append((dst[3:4], s[9:10]))
    pairs.append((dst[20000:20000 + 7 * 3].view(7, 3), s[15000:15000 + 7 * 5].view(7, 5)[:, 2:5]))
    for d, x in pairs:
        ref[d.storage_offset():].as_strided(d.shape, d.stride()).copy_(x)
    BoxCopies(pairs, fused=True)()
    torch.cuda.synchronize() if dst.is_cuda else None
    if not torch.equal(dst.view(torch.uint8), ref.view(torch.uint8)):
        bad.append(str(dtype))
from megarefit.transport.boxcopy import warm_up_pairs
buf = torch.randint(0, 255, (1 << 16,), dtype=torch.uint8, generator=g).to(src.device)
ref = buf.clone()
pairs = warm_up_pairs(buf)
for d, x in warm_up_pairs(ref):
    d.copy_(x)
copies = BoxCopies(pairs, fused=True)
if len(copies._launches) != 12:
    bad.append(f"warm-up variants: {len(copies._launches)}")
copies()
torch.cuda.synchronize() if buf.is_cuda else None
if not torch.equal(buf, ref):
    bad.append("warm-up pairs")
print("MISMATCHES", bad)
"""


def test_box_copy_kernel_in_the_triton_interpreter():
    """The GPU kernel (one launch per word size and column block) run by Triton's CPU
    interpreter writes exactly what ``copy_`` writes, for 1- to 8-byte dtypes, strided
    columns, 3-D boxes with gaps, odd offsets and single elements, and for the pairs a
    GPU receiver compiles every kernel variant with at construction (``warm_up``). (On a GPU:
    tests/test_nixl_gpu.py and the benchmarks.)"""
    pytest.importorskip("triton")
    if torch.cuda.is_available():  # there the compiled kernel is checked instead (Triton 3.6's interpreter,
        pytest.skip("GPU machine: test_box_copy_kernel_on_a_gpu")  # shipped with CUDA torch 2.11, rejects it)
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert "MISMATCHES []" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_box_copy_kernel_on_a_gpu():
    """The same pairs through the compiled kernel on a GPU."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DEV": "cuda"})
    assert "MISMATCHES []" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stacked_pairs_copy_what_each_pair_copies(data):
    """Runs of like pairs merged into one strided pair (``stacked``: legacy GroupedMLP's
    per-expert transposed copies) write exactly what the pairs write one by one: evenly
    spaced runs, gaps, a broken stride, transposed sources, sources running backwards,
    reordered input."""
    from megarefit.transport.boxcopy import stacked

    rows, cols = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5))
    n = data.draw(st.integers(1, 7))
    gap = data.draw(st.integers(0, 3))
    src = torch.arange(4000, dtype=torch.float32)
    dst_want, dst_got = torch.zeros(4000), torch.zeros(4000)
    pairs_want, pairs_got, at_d, at_s = [], [], 0, 0
    transposed = data.draw(st.booleans())
    backwards = data.draw(st.booleans())  # sources in the opposite order of the destinations
    if backwards:
        at_s = 3000
    for i in range(n):
        step = rows * cols + gap + (data.draw(st.integers(0, 2)) if data.draw(st.booleans()) else 0)
        s = src[at_s:at_s + rows * cols].view(cols, rows).T if transposed else src[at_s:at_s + rows * cols].view(rows, cols)
        pairs_want.append((dst_want[at_d:at_d + rows * cols].view(rows, cols), s))
        pairs_got.append((dst_got[at_d:at_d + rows * cols].view(rows, cols), s))
        at_d += step
        at_s += (-1 if backwards else 1) * (rows * cols + data.draw(st.integers(0, 2)))
    for d, s in pairs_want:
        d.copy_(s)
    order = data.draw(st.permutations(range(n)))
    merged = stacked([pairs_got[i] for i in order])
    assert len(merged) <= n
    for d, s in merged:
        d.copy_(s)
    assert torch.equal(dst_got, dst_want)


def test_stacked_merges_evenly_spaced_experts():
    """128 evenly spaced transposed expert copies become one copy."""
    from megarefit.transport.boxcopy import stacked

    block = torch.arange(128 * 6 * 8, dtype=torch.float32).view(128, 6, 8)  # [experts, h, 2F]
    out = torch.zeros(128, 2, 4, 6)  # per expert: gate, up [F, h]
    pairs = [(out[e, 0], block[e, :, :4].T) for e in range(128)]
    merged = stacked(pairs)
    assert len(merged) == 1
    merged[0][0].copy_(merged[0][1])
    assert torch.equal(out[:, 0], block[:, :, :4].transpose(1, 2))
