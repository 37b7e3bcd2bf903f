"""A streamed refit into GPU memory whose consumer copies asynchronously (skipped without CUDA).

vLLM copies each handed-over tensor into its parameters with device work queued on a CUDA
stream; NIXL's READ of the next group is not ordered with that stream. With a ring where
consecutive groups share bytes (each layer larger than half the ring), a receiver that
pulled the next group before the queued copies ran would overwrite what they still read.
Here every copy waits behind a ~20 ms device sleep: the model must still equal the offline
translation of the same shards, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nixl")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from reference import reference_hf_state, reference_shards  # noqa: E402

from megarefit.layout.megatron_model import source_layout
from megarefit.online import RefitReceiver  # noqa: E402
from megarefit.online.receiver.stream import budget_for  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous  # noqa: E402
from megarefit.online.trainer.publisher import Publisher  # noqa: E402


def test_queued_copies_finish_before_the_ring_is_reused(config):
    cfg = config("Llama-3.1-8B", num_hidden_layers=6, hidden_size=256, intermediate_size=512)
    want = reference_hf_state(cfg, "llama")  # what the independent reference sharder shards below
    shards = {r: {n: t.to("cuda") for n, t in s.items()} for r, s in reference_shards(want, cfg, tp=2, pp=1).items()}
    rdzv = Rendezvous.serve(job="stream-gpu")
    pubs = [Publisher(s, cfg, rank=r, layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv,
                      agent_name=f"stream-gpu-{r[0]}")
            for r, s in shards.items()]
    for p in pubs:
        p.publish(1)
    layer = sum(t.numel() * t.element_size() for n, t in want.items() if ".layers.0." in n)
    outside = sum(t.numel() * t.element_size() for n, t in want.items() if ".layers." not in n)
    ring = max(3 * layer // 2, outside // 2 + layer)  # each layer more than half the ring
    rx = RefitReceiver(rdzv, name="stream-gpu-rx", timeout=60, device="cuda:0", memory_budget=budget_for(ring))
    model: dict[str, torch.Tensor] = {}

    def install(weights):
        for name, t in weights:
            torch.cuda._sleep(20_000_000)  # ~20 ms of device time queued before the copy
            model.setdefault(name, torch.empty_like(t)).copy_(t, non_blocking=True)

    for _ in range(2):
        rx.refit(install, 1)
        torch.cuda.synchronize()
        assert rx.stats.groups > 3
        stream = rx._stream
        assert any(a.overlaps(b) for a, b in zip(stream.groups, stream.groups[1:])), "consecutive groups share bytes"
        assert model.keys() == want.keys()
        for name, t in want.items():
            assert torch.equal(model[name].cpu().view(torch.uint8), t.view(torch.uint8)), name
    rx.close()
