"""Delta refits with trainer parameters and receiver arena in GPU memory (skipped without CUDA).

Trainer shards on ``cuda:0`` publish deltas (mirror and slots in pinned host memory, then on the
GPU, then no mirror: a ChangeTracker marks the changes in the trainer's copy); a staged receiver on the last GPU patches its arena with them (the changed-element search,
the packing and the scatter run on the GPUs). Oracle: a second receiver pulling every version in
full (``delta=False``), bit for bit, and the trainers' checksums.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nixl")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from reference import reference_hf_state, reference_shards  # noqa: E402

from megarefit.layout.megatron_model import source_layout  # noqa: E402
from megarefit.online import RefitReceiver  # noqa: E402
from megarefit.online.delta.log import DeltaOptions  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous  # noqa: E402
from megarefit.online.trainer.publisher import Publisher  # noqa: E402


@pytest.mark.parametrize("changes", ["host", "device", "tracker"])
def test_gpu_delta_equals_full_pull(config, changes):
    """``changes``: how the trainers find what changed; ``host`` / ``device``: a mirror of the
    last version there (DeltaOptions.mirror, slots on the same side); ``tracker``: no mirror, the
    changes marked by a ChangeTracker in the main-to-model copy (slots on the device)."""
    from megarefit.online.delta.track import ChangeTracker

    cfg = config("Llama-3.1-8B", num_hidden_layers=4, hidden_size=256, intermediate_size=512)
    hf = {k: v.to(torch.bfloat16) for k, v in reference_hf_state(cfg, "llama").items()}
    params = {r: {n: t.to("cuda:0") for n, t in s.items()} for r, s in reference_shards(hf, cfg, tp=2, pp=1).items()}
    tracker = None
    if changes == "tracker":
        tracker = ChangeTracker()
        tracker.watch([t for shard in params.values() for t in shard.values()])
    where = "device" if changes == "tracker" else changes
    rdzv = Rendezvous.serve(job=f"delta-gpu-{changes}")
    pubs = [Publisher(s, cfg, rank=r, layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv, checksums=True,
                      agent_name=f"delta-gpu-{changes}-{r[0]}", tracker=tracker,
                      delta=DeltaOptions(slots=where, mirror=where, capacity=1.0))
            for r, s in params.items()]
    if tracker is not None:  # every served tensor tracked: the trainer holds its slots only
        assert all(p.delta.tracked == len(p.delta.served) and p.delta.nbytes == sum(x.numel() for x in p.delta.slots)
                   for p in pubs)
    device = f"cuda:{torch.cuda.device_count() - 1}"
    rx = RefitReceiver(rdzv, name=f"delta-gpu-{changes}-rx", device=device, verify_checksums=True)
    rx.delta_model.rates.update(wire=8e9, delta_wire=8e9, scatter=1e9, tensor=0.0)  # patch whatever changed sparsely
    rx.delta_model.learn = False
    full = RefitReceiver(rdzv, name=f"delta-gpu-{changes}-full", device=device, delta=False)
    from megarefit.online.delta.kernel import fused
    assert fused(torch.device(device))  # the receiver's warm_up checked the fused placing there
    g = torch.Generator(device="cuda:0").manual_seed(0)
    for v in range(1, 5):
        if v > 1:
            for shard in params.values():
                for t in shard.values():
                    m = torch.rand(t.shape, generator=g, device="cuda:0") < 0.01
                    main = t.float()
                    main[m] = main[m] * (1 + 2 ** -5)
                    if tracker is None:
                        t.copy_(main)
                    else:  # the trainer's main-to-model copy, tracked
                        tracker.copy_(t, main)
        for p in pubs:
            p.publish(v)
        got = {n: t.clone() for n, t in rx.run_refit_cycle(v)}
        want = dict(full.run_refit_cycle(v))
        assert rx.stats.refit == ("full" if v == 1 else "delta"), rx.stats.delta_reason
        assert rx.stats.checked_bytes == rx.plan.nbytes
        assert got.keys() == want.keys()
        for name, w in want.items():
            assert got[name].device == w.device == torch.device(device)
            assert torch.equal(got[name].view(torch.uint8), w.view(torch.uint8)), (v, name)
    assert rx.stats.bytes_moved < 0.1 * full.stats.bytes_moved
    rx.close()
    full.close()


@pytest.mark.parametrize("paged", [False, True], ids=["indices", "paged"])
def test_fused_place_equals_torch_scatter(paged):
    """The fused launch writes exactly what an independent PyTorch scatter writes: runs with gaps
    between them (elements outside every run are left alone), pages with and without changes.
    The runs' targets are disjoint, as a plan's are (an earlier version of this test let two
    overlap, so which write won differed between the GPU and the oracle: 2 of 3904 elements)."""
    from megarefit.online.delta.kernel import place
    from megarefit.online.delta.log import pack_paged
    from megarefit.online.delta.records import PAGE

    g = torch.Generator().manual_seed(3)
    numel = 5 * PAGE + 123
    idx = (torch.rand(numel, generator=g) < 0.02).nonzero().view(-1)
    idx = idx[(idx < PAGE) | (idx >= 3 * PAGE)]  # pages 1 and 2 hold no change
    values = torch.randint(-2 ** 15, 2 ** 15, (idx.numel(),), generator=g, dtype=torch.int16)
    starts = torch.tensor([0, 1000, 3 * PAGE, 4 * PAGE + 7])  # runs: [0, 900) [1000, 2 PAGE) [3 PAGE, 4 PAGE) [...]
    ends = torch.tensor([900, 2 * PAGE, 4 * PAGE, numel])
    dst = torch.tensor([300_000, 0, 10 * PAGE, 2 * PAGE])
    spans = sorted(zip(dst.tolist(), (dst + ends - starts).tolist()))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    root = torch.zeros(12 * PAGE, dtype=torch.int16)
    k = torch.searchsorted(starts, idx, right=True) - 1
    inside = idx < ends[k]
    want = root.clone()
    want[(idx - starts[k] + dst[k])[inside]] = values[inside]
    if paged:
        raw = pack_paged(idx, numel)
        pages = (numel + PAGE - 1) // PAGE
        names, counts = raw[4 * pages:].view(torch.int16), raw[:4 * pages].view(torch.int32)
    else:
        names, counts = idx.to(torch.int32), None
    cuda = [t.cuda() if t is not None else None for t in (names, counts, values, starts, ends, dst, root)]
    place(*cuda)
    torch.cuda.synchronize(cuda[-1].device)  # asynchronous, as the receiver's pipeline waits for it
    assert torch.equal(cuda[-1].cpu(), want)


def test_fused_marking_agrees_with_pytorch_on_the_gpu():
    """The tracker's fused mark (delta_mark) against an independent PyTorch computation, for
    every parameter / source dtype pair it takes, on each GPU; a tracked copy_ uses it."""
    from megarefit.online.delta import mark as delta_mark

    pairs = [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.float32),
             (torch.bfloat16, torch.bfloat16)]
    for k in range(torch.cuda.device_count()):
        assert all(delta_mark.check(torch.device("cuda", k), d, s) for d, s in pairs)
    p, src = torch.zeros(10, dtype=torch.bfloat16, device="cuda:0"), torch.ones(10, device="cuda:0")
    assert delta_mark.usable(p, src)


def test_gpu_streamed_receiver_patches_its_direct_targets(config):
    """A streamed receiver on the last GPU whose MLP weights are direct (the consumer's own GPU
    tensors): after a whole cycle, sparse versions patch them in place (ranges landed in the
    ring) and stream the rest; the consumer equals a full pull after each, checksums verified."""
    cfg = config("Llama-3.1-8B", num_hidden_layers=4, hidden_size=256, intermediate_size=512)
    hf = {k: v.to(torch.bfloat16) for k, v in reference_hf_state(cfg, "llama").items()}
    params = {r: {n: t.to("cuda:0") for n, t in s.items()} for r, s in reference_shards(hf, cfg, tp=2, pp=1).items()}
    rdzv = Rendezvous.serve(job="delta-gpu-streamed")
    pubs = [Publisher(s, cfg, rank=r, layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv, checksums=True,
                      agent_name=f"delta-gpu-streamed-{r[0]}", delta=DeltaOptions(slots="device", mirror="device",
                                                                                  capacity=1.0))
            for r, s in params.items()]
    device = f"cuda:{torch.cuda.device_count() - 1}"
    for p in pubs:
        p.publish(1)
    full = RefitReceiver(rdzv, name="delta-gpu-streamed-full", device=device, delta=False)
    want = {n: t.clone() for n, t in full.run_refit_cycle(1)}
    model = {n: torch.zeros_like(t) for n, t in want.items()}
    direct = {n: t for n, t in model.items() if ".mlp." in n}
    rx = RefitReceiver(rdzv, name="delta-gpu-streamed-rx", device=device, verify_checksums=True, direct=direct,
                       memory_budget=int(0.5 * sum(t.numel() * t.element_size() for t in want.values())))
    rx.delta_model.rates.update(wire=8e9, delta_wire=8e9, scatter=1e9, tensor=0.0)
    rx.delta_model.learn = False
    g = torch.Generator(device="cuda:0").manual_seed(0)

    def install(weights):
        for name, t in weights:
            model[name].copy_(t)

    for v in range(1, 5):
        if v > 1:
            for p, shard in zip(pubs, params.values()):
                with p.updating(v):
                    for t in shard.values():
                        m = torch.rand(t.shape, generator=g, device="cuda:0") < 0.01
                        t[m] = t[m] * (1 + 2 ** -5)
            want = {n: t.clone() for n, t in full.run_refit_cycle(v)}
        rx.refit(install, v)
        assert rx.stats.refit == ("full" if v == 1 else "delta"), rx.stats.delta_reason
        assert rx.stats.checked_bytes == full.stats.bytes_moved
        for name, w in want.items():
            assert torch.equal(model[name].view(torch.uint8), w.view(torch.uint8)), (v, name)
    rx.close()
    full.close()


def test_the_fused_fingerprint_on_the_gpu_equals_the_cpus():
    """On the GPU the held arena's fingerprint is the fused kernel (it passed its check: no
    warning), and equals the CPU's matrix-vector product on the same bytes, a partial last chunk
    and word included; so does the GPU's PyTorch path (blocks)."""
    import warnings

    from megarefit.online.delta import held, held_kernel

    raw = torch.randint(0, 256, (8 * held.CHUNK * 5 + 8 * 77 + 5,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert held_kernel.usable(torch.device("cuda:0"), held.weighted_sums)
    want = held.fingerprint(raw)
    on_gpu = raw.to("cuda:0")
    assert torch.equal(held.fingerprint(on_gpu).cpu(), want)
    assert torch.equal(held.fingerprint(on_gpu, fused=False).cpu(), want)
