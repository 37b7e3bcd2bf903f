"""A prefetch into GPU memory while the GPU keeps computing (skipped without CUDA).

The receiver lives on the last GPU (the second one on a two-GPU host, while this thread's
current device is GPU 0: the prefetch thread must use the receiver's device). While its thread
pulls, this thread keeps queueing matmuls on the receiver's GPU (a stand-in for vLLM
generating). Once the prefetch is fenced, the trainers overwrite their shards; the handed-over
tensors must still equal the reference weights of the prefetched version, bit for bit, and
the next version (pulled, not prefetched) the overwritten ones.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("nixl")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from reference import reference_hf_state, reference_shards  # noqa: E402

from megarefit.layout.megatron_model import source_layout  # noqa: E402
from megarefit.online import RefitReceiver  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous  # noqa: E402
from megarefit.online.trainer.publisher import Publisher  # noqa: E402


def test_a_gpu_prefetch_lands_whole_beside_compute(config):
    cfg = config("Llama-3.1-8B", num_hidden_layers=4, hidden_size=512, intermediate_size=1024)
    want = reference_hf_state(cfg, "llama")
    shards = {r: {n: t.to("cuda:0") for n, t in s.items()} for r, s in reference_shards(want, cfg, tp=2, pp=1).items()}
    rdzv = Rendezvous.serve(job="prefetch-gpu")
    pubs = {r: Publisher(s, cfg, rank=r, layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv,
                         agent_name=f"prefetch-gpu-{r[0]}") for r, s in shards.items()}
    for p in pubs.values():
        p.publish(1)
    device = torch.device(f"cuda:{torch.cuda.device_count() - 1}")
    receiver = RefitReceiver(rdzv, name="prefetch-gpu-rx", device=device, timeout=60)
    dict(receiver.run_refit_cycle(1))  # cold: plan, registration
    for p in pubs.values():
        p.publish(2)
    torch.cuda.set_device(0)
    x = torch.randn(2048, 2048, device=device)
    x = torch.tanh(x @ x)  # cuBLAS set up before the prefetch starts
    torch.cuda.synchronize(device)
    receiver.prefetch(2)
    launched = 0
    while receiver.prefetched.phase == "pulling":
        x = torch.tanh(x @ x)  # generation goes on, queued on the receiver's GPU
        launched += 1
        time.sleep(0.001)
    torch.cuda.synchronize(device)
    state = receiver.prefetched
    assert (state.phase, state.pulled) == ("ready", 2), state
    for rank, pub in pubs.items():
        with pub.updating(3):
            for t in shards[rank].values():
                t.add_(1.0)
    got = dict(receiver.run_refit_cycle(2))
    assert receiver.stats.prefetched and receiver.stats.version == 2
    assert all(t.device == device for t in got.values())
    assert got.keys() == want.keys() and all(torch.equal(got[k].cpu(), v) for k, v in want.items())
    got = dict(receiver.run_refit_cycle(3))
    assert not receiver.stats.prefetched
    assert all(torch.equal(got[k].cpu(), v + 1.0) for k, v in want.items())
    print(f"prefetch {state.seconds * 1e3:.1f} ms beside {launched} matmuls")
    receiver.close()
