"""Changes found where the optimizer writes them (``megarefit.online.delta.track``): no mirror.

Oracles, none of them the tracker: the bits of every parameter before and after real steps
(what changed), and a ``delta=False`` receiver's full pull (what a delta receiver must hold).
The real case is Megatron-Core's ``DistributedOptimizer`` over 2 data-parallel processes (gloo),
where each rank finds the changes of its own shard only and the tracker sums them.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

from megarefit.online.delta.track import ChangeTracker, DeltaTrackError, or_mask, set_indices, track_changes


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(1, 200), start=st.integers(0, 199), length=st.integers(0, 200),
       density=st.floats(0.0, 1.0), seed=st.integers(0, 2 ** 16))
def test_bits_set_anywhere_read_back_exactly(numel, start, length, density, seed):
    """A mask OR-ed at any (unaligned) start reads back as exactly its set elements, and the
    bits already set stay set."""
    start, length = min(start, numel), min(length, numel - min(start, numel))
    g = torch.Generator().manual_seed(seed)
    before = torch.rand(numel, generator=g) < 0.1
    mask = torch.rand(length, generator=g) < density
    bitmap = torch.zeros((numel + 7) // 8, dtype=torch.uint8)
    or_mask(bitmap, 0, before)
    or_mask(bitmap, start, mask)
    want = before.clone()
    want[start:start + length] |= mask
    assert torch.equal(set_indices(bitmap, numel), want.nonzero().view(-1))


def _bits_changed(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    return before.reshape(-1).view(torch.int16) != after.reshape(-1).view(torch.int16)


def test_tracked_copies_mark_exactly_the_bits_that_change():
    """``copy_`` of fp32 values into bf16 parameters (whole and at an offset, over two steps):
    the elements marked are those whose bf16 bits changed in some step (an element that changed
    and changed back stays marked: its value is sent again), including -0.0 vs 0.0; values that
    round to the old bf16 are not marked, and writes around the tracker are not seen. ``clear``
    forgets a parameter's marks."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(37, 5, generator=g).to(torch.bfloat16), torch.randn(1000, generator=g).to(torch.bfloat16)]
    tracker = ChangeTracker()
    tracker.watch(params)
    union = [torch.zeros(p.numel(), dtype=torch.bool) for p in params]
    for step in range(2):
        before = [p.clone() for p in params]
        main = [p.float() for p in params]
        main[0].view(-1)[::7] += 1e-4  # below half a bf16 step at these magnitudes: mostly unchanged
        main[0].view(-1)[3::11] *= 1.5
        main[1][100:400] += torch.randn(300, generator=g) * 0.01
        main[1][104] = -0.0 if params[1][104].item() == 0.0 else 0.0
        tracker.copy_(params[0], main[0])
        tracker.copy_(params[1], main[1][100:], start=100)
        union[0] |= _bits_changed(before[0], params[0])
        union[1][100:] |= _bits_changed(before[1][100:], params[1][100:])
        params[1][5] += 1  # written around the tracker: not seen
    assert torch.equal(tracker.changed(params[0]), union[0].nonzero().view(-1))
    assert 0 < union[0].sum() < params[0].numel() and union[1][104] and not union[1][5]
    assert torch.equal(tracker.changed(params[1]), union[1].nonzero().view(-1))
    tracker.clear(params[0])
    assert tracker.changed(params[0]).numel() == 0 and tracker.changed(params[1]).numel() > 0
    with pytest.raises(DeltaTrackError, match="not tracked"):
        tracker.changed(torch.zeros(3))


def test_optimizers_that_write_parameters_themselves_are_refused():
    class Precision:
        config = type("C", (), {"use_precision_aware_optimizer_no_fp8_or_ds_fp8": True})()

        def _copy_main_params_to_model_params(self):
            pass

    with pytest.raises(DeltaTrackError, match="use_precision_aware_optimizer_no_fp8_or_ds_fp8.*host mirror"):
        track_changes(Precision())
    with pytest.raises(DeltaTrackError, match=r"megatron-core \d.*no _copy_main_params_to_model_params"):
        track_changes(torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))]))


@pytest.mark.megatron
def test_megatron_distributed_optimizer_deltas_equal_full_pulls():
    """Real Megatron-Core (2 data-parallel processes, gloo, Adam at lr 1e-6, real gradients):
    the distributed optimizer's changes, each rank finding its shard's, summed by the tracker,
    equal the changed bits of every parameter, over one step and accumulated over two; the
    non-distributed mixed-precision optimizer's too. Rank 0 serves with no mirror (every
    tensor tracked) and a delta receiver's arena equals a full pull after each version, with
    the trainer's checksums verified."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("nixl")
    from megatron_jobs import delta_track_job

    from megarefit.demo.workers import start_workers
    from megarefit.online.receiver.receiver import RefitReceiver
    from megarefit.online.store.rendezvous import Rendezvous

    job = "delta-track"
    # untied: the output layer's vocab padding rows take real gradients, so they change where no op reads
    cfg = tiny_config("Qwen3-0.6B", num_hidden_layers=2, tie_word_embeddings=False)
    rdzv = Rendezvous.serve(job=job)
    delta = RefitReceiver(rdzv, name=f"{job}-delta", timeout=120, verify_checksums=True)
    delta.delta_model.rates.update(wire=8e9, delta_wire=8e9, scatter=1e9)  # fixed: a delta wherever it is smaller
    delta.delta_model.learn = False
    full = RefitReceiver(rdzv, name=f"{job}-full", timeout=120, delta=False)
    publish_after = [1, 3, 4]  # version 3 accumulates steps 2 and 3
    workers = start_workers(delta_track_job, world_size=2, args=(rdzv.port, job, cfg, publish_after))
    refits = []
    try:
        for version in range(1, len(publish_after) + 2):
            got = {n: t.clone() for n, t in delta.run_refit_cycle(version)}
            want = dict(full.run_refit_cycle(version))
            assert got.keys() == want.keys()
            assert all(torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want), version
            s = delta.stats
            refits.append((s.refit, s.bytes_moved / full.stats.bytes_moved, s.delta_reason, s.retries))
            delta.acknowledge(version)
            full.acknowledge(version)
    except Exception:
        workers.join(timeout=20)  # a trainer's failure, if there is one, is what to report
        raise
    else:
        results = workers.join(timeout=600)
    finally:
        delta.close()
        full.close()
    assert refits[0][0] == "full" and all(kind == "delta" and frac < 0.6 for kind, frac, *_ in refits[1:]), refits
    first = next(r for r in results if r["rank"] == 0)
    assert first["tracked"] == first["served"] and first["recorded"] == [True] * len(publish_after)
    for r in results:
        for found in r["distributed"] + [r["float16"]]:
            assert all(same for _, same in found.values()), {n: v for n, v in found.items() if not v[1]}
            assert sum(n for n, _ in found.values()) > 0


_INTERPRETED = """
import warnings
import torch
from megarefit.online.delta import mark as delta_mark
warnings.simplefilter("error")  # a failed check warns: fail here instead
pairs = [(torch.float16, torch.float32), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]
assert all(delta_mark.check(torch.device("cpu"), d, s) for d, s in pairs)
print("ok")
"""


def test_fused_marking_under_the_triton_interpreter():
    """The fused mark's kernel (cast, bit compare, NaN, byte packing at an unaligned start, OR into
    bits already set, the copy) run by Triton's interpreter on CPU tensors agrees with the
    PyTorch computation in ``delta_mark.check``. (The interpreter rounds fp32 to bf16 its own way,
    so that pair is checked on a GPU: tests/test_delta_gpu.py.)"""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_copies_that_do_not_fit_and_deferred_gathers_are_refused():
    """A tracked copy past the parameter's end raises (the fused kernel would write past it); a
    tracker of a distributed optimizer with ``overlap_param_gather`` is refused by a Publisher
    that cannot wait for the all-gather (no ``ddp=``): its marks would be cleared before the other
    shards' bytes arrived."""
    param = torch.zeros(10, dtype=torch.bfloat16)
    tracker = ChangeTracker()
    tracker.watch([param], names=["decoder.final_layernorm.weight"])
    with pytest.raises(DeltaTrackError, match=r"5 elements at element 8 does not fit parameter "
                                              r"'decoder.final_layernorm.weight' \[10\] torch.bfloat16 on rank 0"):
        tracker.copy_(param, torch.ones(5), start=8)
    with pytest.raises(DeltaTrackError, match=r"tensor \[3\] torch.float32 on rank 0 at .* is not tracked"):
        tracker.changed(torch.zeros(3))
    pytest.importorskip("nixl")
    from megarefit.demo.offline import default_config
    from megarefit.errors import MegarefitError
    from megarefit.layout.dims import ModelDims
    from megarefit.layout.geometry import source_tensors
    from megarefit.layout.megatron_model import source_layout
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.publisher import Publisher

    cfg = default_config()
    layout = source_layout(cfg, tp=1, pp=1)
    rank = layout.ranks()[0]
    params = {n: torch.zeros(t.shape, dtype=torch.bfloat16)
              for n, t in source_tensors(ModelDims.from_hf_config(cfg), layout)[rank].items()}
    deferred = ChangeTracker()
    deferred.watch(list(params.values()))
    deferred.deferred_gather = True
    rdzv = Rendezvous.serve(job="delta-track-deferred")
    with pytest.raises(MegarefitError, match="overlap_param_gather needs ddp="):
        Publisher(params, cfg, rank=rank, layout=layout, rendezvous=rdzv, agent_name="delta-track-deferred",
                  delta=True, tracker=deferred)
