"""GPU memory on either side of a NIXL refit (skipped without CUDA; run on a GPU machine).

Publishers serve shards from GPU or host memory (registered as NIXL VRAM / DRAM, the
memory type and device travel in the manifest); ``RefitReceiver(device=...)`` pulls
into GPU or host memory. Every combination must equal ``megatron_to_hf`` of the same
shards bit for bit. (Verified on an H200: see docs/benchmarks.md.)
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("nixl")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from reference import reference_hf_state, reference_shards  # noqa: E402

from megarefit.layout.megatron_model import source_layout
from megarefit.online import RefitReceiver  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous  # noqa: E402
from megarefit.online.trainer.publisher import Publisher  # noqa: E402


@pytest.mark.parametrize("src,dst", list(itertools.product(("cuda", "cpu"), ("cuda:0", "cpu"))))
def test_gpu_memory_over_nixl(config, src, dst):
    cfg = config("Qwen3-0.6B")
    hf = reference_hf_state(cfg, "qwen3")
    shards = {r: {n: t.to(src).contiguous() for n, t in s.items()}
              for r, s in reference_shards(hf, cfg, tp=2, pp=1).items()}
    job = f"gpu-{src}-{dst}".replace(":", "")
    rdzv = Rendezvous.serve(job=job)
    pubs = [Publisher(s, cfg, rank=r, layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv,
                      agent_name=f"{job}-{r[0]}")
            for r, s in shards.items()]
    assert {e.mem for e in pubs[0].manifest.tensors} == {"VRAM" if src == "cuda" else "DRAM"}
    for p in pubs:
        p.publish(1)
    got = dict(RefitReceiver(rdzv, name=f"{job}-recv", timeout=30, device=dst).run_refit_cycle(1))
    assert got.keys() == hf.keys()
    assert all(t.device.type == torch.device(dst).type and torch.equal(t.cpu(), hf[k]) for k, t in got.items())
