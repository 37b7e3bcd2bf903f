"""Per-tensor checksums (``Publisher(checksums=True)``, ``RefitReceiver(verify_checksums=True)``).

The sums are checked against a plain-Python reference over each element's raw bits (an
independent implementation: no torch reductions, no chunking), and end to end with real
NIXL agents: every box of a refit is checked (``checked_boxes`` equals the plan's op count),
bytes changed behind the trainer's back are a named error before anything is handed over.
Fused and grouped experts, and plans refused up front: tests/test_checksums_fused.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarefit.layout import Box
from megarefit.plan import CopyOp, TensorRef
from megarefit.transport.checksum import MODULUS, box_sums, tensor_checksum

_BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float8_e4m3fn: torch.uint8}


def _reference(t: torch.Tensor) -> list[int]:
    """Row then column sums of ``t`` as ``[R, C]``, in Python integers modulo 2**64 (signed)."""
    x = t.reshape(-1, t.shape[-1] if t.dim() else 1).view(_BITS[t.dtype]).tolist()
    rows, cols = len(x), len(x[0])
    w = [n % MODULUS + 1 for n in range(max(rows, cols))]
    sums = [sum(w[j] * x[i][j] for j in range(cols)) for i in range(rows)]
    sums += [sum(w[i] * x[i][j] for i in range(rows)) for j in range(cols)]
    return [((s + 2**63) % 2**64) - 2**63 for s in sums]


def _tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 100).to(dtype)


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), dtype=st.sampled_from(list(_BITS)),
       seed=st.integers(0, 1000), data=st.data())
def test_box_sums_equal_the_published_slice_and_a_python_reference(shape, dtype, seed, data):
    t = _tensor(tuple(shape), dtype, seed)
    published = tensor_checksum(t)
    assert published.tolist() == _reference(t)
    rows_box = data.draw(st.booleans())
    if rows_box:  # whole rows: one index of each dim before k, a range of dim k, every later dim whole
        k = data.draw(st.integers(0, max(0, len(shape) - 2)))
        lead = [data.draw(st.integers(0, n - 1)) for n in shape[:k]]
        a = data.draw(st.integers(0, shape[k] - 1))
        b = data.draw(st.integers(a + 1, shape[k]))
        box = Box(tuple(lead) + (a,) + (0,) * (len(shape) - k - 1), (1,) * k + (b - a,) + tuple(shape[k + 1:]))
    else:  # every row, a range of columns
        a = data.draw(st.integers(0, shape[-1] - 1))
        b = data.draw(st.integers(a + 1, shape[-1]))
        box = Box((0,) * (len(shape) - 1) + (a,), tuple(shape[:-1]) + (b - a,))
    ref = TensorRef(None, "w")
    op = CopyOp(ref, box, ref, box, "scratch", 0, 0, t.element_size())
    got = box_sums(op, tuple(shape), t[box.slices()].contiguous())
    assert got is not None
    kind, first, sums = got
    assert sums.tolist() == published[first:first + sums.numel()].tolist()
    flipped = t[box.slices()].contiguous().view(torch.uint8).clone()
    flipped.view(-1)[data.draw(st.integers(0, flipped.numel() - 1))] ^= 1 << data.draw(st.integers(0, 7))
    _, _, bad = box_sums(op, tuple(shape), flipped.view(t.dtype))
    assert bad.tolist() != published[first:first + sums.numel()].tolist()  # one flipped bit is seen


def test_a_box_of_some_rows_and_some_columns_is_not_checked():
    t = _tensor((4, 6), torch.bfloat16, 0)
    ref = TensorRef(None, "w")
    box = Box((1, 2), (2, 3))
    assert box_sums(CopyOp(ref, box, ref, box, "scratch", 0, 0, 2), (4, 6), t[box.slices()]) is None


KERNEL_CHECK = r"""
import os, torch
from megarefit.transport.checksum_kernel import BoxSums
dev = os.environ.get("DEV", "cpu")
g = torch.Generator().manual_seed(0)
base = {dt: (torch.randn(64, 40, generator=g) * 50).to(dt).to(dev) for dt in (torch.bfloat16, torch.float32)}
base[torch.float8_e4m3fn] = torch.randn(64, 40, generator=g).to(torch.float8_e4m3fn).to(dev)
base[torch.float64] = torch.randn(64, 40, generator=g, dtype=torch.float64).to(dev)
entries, at = [], 0
for t in base.values():
    for x, first in [(t, 0), (t[3:17], 0), (t[:, 5:9], 7), (t[:, 5:6], 0), (t.t()[2:30], 3), (t[1:2, :1], 0),
                     (t.reshape(-1, 20)[::3], 70000)]:
        entries.append((x, at, at + x.shape[0], first))
        at += x.shape[0] + x.shape[1]
out = torch.zeros(at, dtype=torch.int64, device=dev)
ref = torch.zeros(at, dtype=torch.int64, device=dev)
k = BoxSums(entries, out, fused=True)
assert k.fused
k()
k()  # twice: out is zeroed on each call
BoxSums(entries, ref, fused=False)()
print("MISMATCHES", [] if torch.equal(out, ref) else (out != ref).nonzero().flatten().tolist()[:10])
"""


def test_box_sums_kernel_in_the_triton_interpreter():
    """The fused kernel (row and column sums of many strided boxes, 1- to 8-byte elements,
    transposed and strided views, row weights past the modulus) run by Triton's CPU
    interpreter gives exactly the torch path's sums."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("GPU machine: test_box_sums_kernel_on_a_gpu")
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert "MISMATCHES []" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_box_sums_kernel_on_a_gpu():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DEV": "cuda"})
    assert "MISMATCHES []" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


# ---- end to end, real NIXL (UCX loopback) ----------------------------------------------------
_JOBS = iter(range(10**6))


def _job(config, target_name):
    pytest.importorskip("nixl")
    from reference import reference_hf_state, reference_shards

    from megarefit.layout.megatron_model import source_layout
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.publisher import Publisher

    cfg = config("Llama-3.1-8B", num_hidden_layers=4)
    shards = reference_shards(reference_hf_state(cfg, "llama"), cfg, tp=2, pp=1)
    job = f"sums-{target_name}-{next(_JOBS)}"
    rdzv = Rendezvous.serve(job=job)
    pubs = [Publisher({n: t.clone() for n, t in s.items()}, cfg, rank=r, layout=source_layout(cfg, tp=2, pp=1),
                      rendezvous=rdzv, agent_name=f"{job}-t{r[0]}", checksums=True) for r, s in shards.items()]
    for p in pubs:
        p.publish(1)
    return job, rdzv, pubs


def _plan_ops(config, target) -> int:
    """How many boxes a receiver of ``target`` pulls from the tp=2 trainers of ``_job``."""
    from megarefit import ModelDims, SourceLayout
    from megarefit.planner import plan_megatron_to_hf
    from megarefit.targets import plan_megatron_to_vllm

    dims = ModelDims.from_hf_config(config("Llama-3.1-8B", num_hidden_layers=4))
    layout = SourceLayout.build(tp=2, pp=1, padded_vocab_size=dims.padded_vocab_size(2), num_layers=dims.num_layers)
    plan = plan_megatron_to_hf(dims, layout) if target is None else plan_megatron_to_vllm(dims, layout, "bfloat16",
                                                                                           target)
    return len(plan.ops)


@pytest.mark.parametrize("target_name", ["hf", "vllm-tp4"])
@pytest.mark.parametrize("budget", [None, 200_000])
def test_every_box_is_checked_and_a_changed_byte_is_named(config, target_name, budget):
    from megarefit.online import RefitReceiver
    from megarefit.online.receiver.receiver import TornUpdateError
    from megarefit.targets import VllmTarget
    from megarefit.transport.checksum import ChecksumMismatchError

    job, rdzv, pubs = _job(config, target_name)
    target = VllmTarget(4, 1) if target_name == "vllm-tp4" else None
    plain = RefitReceiver(rdzv, name=f"{job}-plain", timeout=30, target=target)
    want = [(n, t.clone()) for n, t in plain.run_refit_cycle(1)]
    rx = RefitReceiver(rdzv, name=f"{job}-rx", timeout=30, target=target, memory_budget=budget,
                       verify_checksums=True)
    got = [(n, t.clone()) for n, t in rx.run_refit_cycle(1)]
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want))
    assert rx.stats.checked_bytes == rx.stats.bytes_moved and rx.stats.unchecked_bytes == 0
    assert rx.stats.checked_boxes == _plan_ops(config, target) > 0
    # row 0 of each rank's served o_proj shard changes behind the trainers' backs (no publish)
    for p in pubs:
        p.params["decoder.layers.0.self_attention.linear_proj.weight"].view(torch.uint8)[0] ^= 4
    handed = []
    # nothing handed over (ChecksumMismatchError), or, streamed, earlier groups were (TornUpdateError: a mix)
    with pytest.raises((ChecksumMismatchError, TornUpdateError),
                       match=r"linear_proj\.weight of rank \([01], 0, 0\).*pulled into .*o_proj") as err:
        for name, _ in rx.run_refit_cycle(1):
            handed.append(name)
    assert not any(".layers.0." in n for n in handed)  # the changed layer never reached the consumer
    assert (handed == []) == isinstance(err.value, ChecksumMismatchError)
    assert budget is not None or handed == []
    plain.close()
    rx.close()
