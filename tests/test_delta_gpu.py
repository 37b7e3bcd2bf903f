"""Delta refits with trainer parameters and receiver arena in GPU memory (skipped without CUDA).

Trainer shards on ``cuda:0`` publish deltas (mirror and slots in pinned host memory, then on the
GPU); a staged receiver on the last GPU patches its arena with them (the changed-element search,
the packing and the scatter run on the GPUs). Oracle: a second receiver pulling every version in
full (``delta=False``), bit for bit, and the trainers' checksums.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nixl")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from megarefit.layout.megatron_model import source_layout  # noqa: E402
from megarefit.online import RefitReceiver  # noqa: E402
from megarefit.online.delta_log import DeltaOptions  # noqa: E402
from megarefit.online.publisher import Publisher  # noqa: E402
from megarefit.online.rendezvous import Rendezvous  # noqa: E402
from reference import reference_hf_state, reference_shards  # noqa: E402

_IN_CHILD = __import__("os").environ.get("MEGAREFIT_DELTA_GPU_CHILD") == "1"


@pytest.mark.parametrize("slots", ["host", "device"])
def test_gpu_delta_equals_full_pull(config, slots):
    """``slots``: where the deltas are packed and the last version mirrored (DeltaOptions)."""
    cfg = config("Llama-3.1-8B", num_hidden_layers=4, hidden_size=256, intermediate_size=512)
    hf = {k: v.to(torch.bfloat16) for k, v in reference_hf_state(cfg, "llama").items()}
    params = {r: {n: t.to("cuda:0") for n, t in s.items()} for r, s in reference_shards(hf, cfg, tp=2, pp=1).items()}
    rdzv = Rendezvous.serve(job=f"delta-gpu-{slots}")
    pubs = [Publisher(s, cfg, rank=r, layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv, checksums=True,
                      agent_name=f"delta-gpu-{slots}-{r[0]}", delta=DeltaOptions(slots=slots, mirror=slots, capacity=1.0))
            for r, s in params.items()]
    device = f"cuda:{torch.cuda.device_count() - 1}"
    rx = RefitReceiver(rdzv, name=f"delta-gpu-{slots}-rx", device=device, verify_checksums=True)
    rx.delta_model.rates.update(wire=8e9, delta_wire=8e9, scatter=1e9, tensor=0.0)  # patch whatever changed sparsely
    rx.delta_model.learn = False
    full = RefitReceiver(rdzv, name=f"delta-gpu-{slots}-full", device=device, delta=False)
    from megarefit.online.delta_kernel import fused
    assert fused(torch.device(device))  # the receiver's warm_up checked the fused placing there
    g = torch.Generator(device="cuda:0").manual_seed(0)
    for v in range(1, 5):
        if v > 1:
            for shard in params.values():
                for t in shard.values():
                    m = torch.rand(t.shape, generator=g, device="cuda:0") < 0.01
                    t[m] = t[m] * (1 + 2 ** -5)
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
    Run in a fresh process, on the first GPU it uses (in one process that used the fused placing
    on the last GPU first, a later direct launch on GPU 0 wrote nothing here; receivers check the
    kernel per device in ``warm_up`` and place with PyTorch ops where it fails)."""
    import subprocess
    import sys

    if not _IN_CHILD:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                               f"{__file__}::test_fused_place_equals_torch_scatter[{'paged' if paged else 'indices'}]"],
                              env={**__import__("os").environ, "MEGAREFIT_DELTA_GPU_CHILD": "1"}, capture_output=True,
                              text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        return
    from megarefit.online.delta_kernel import place
    from megarefit.online.delta_log import pack_paged
    from megarefit.online.delta_records import PAGE

    g = torch.Generator().manual_seed(3)
    numel = 5 * PAGE + 123
    idx = (torch.rand(numel, generator=g) < 0.02).nonzero().view(-1)
    idx = idx[(idx < PAGE) | (idx >= 3 * PAGE)]  # pages 1 and 2 hold no change
    values = torch.randint(-2 ** 15, 2 ** 15, (idx.numel(),), generator=g, dtype=torch.int16)
    starts = torch.tensor([0, 1000, 3 * PAGE, 4 * PAGE + 7])  # runs: [0, 900) [1000, 2 PAGE) [3 PAGE, 4 PAGE) [...]
    ends = torch.tensor([900, 2 * PAGE, 4 * PAGE, numel])
    dst = torch.tensor([50_000, 0, 10 * PAGE, 2 * PAGE])
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
