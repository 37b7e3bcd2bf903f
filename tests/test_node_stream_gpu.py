"""Node groups on a GPU (issue 60; skipped without CUDA): two receivers of one node, their memory in
device memory, trainers' shards there too; streamed (rings and node arenas) and staged (arenas).
Each serves its (node) arena while it fills and READs its mate's over NIXL (VRAM to VRAM) by layer
group; every byte must equal the HF state the shards came from (the independent reference
sharder), streamed within the budget."""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("nixl")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from conftest import tiny_config  # noqa: E402
from reference import reference_hf_state, reference_shards  # noqa: E402

from megarefit.layout.megatron_model import source_layout  # noqa: E402
from megarefit.online import RefitReceiver  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous  # noqa: E402
from megarefit.online.trainer.publisher import Publisher  # noqa: E402

CFG = tiny_config("Qwen3-0.6B", tie_word_embeddings=False)
BUDGET = 720_000  # bytes (the model: 819,456): half of it in the node arena, two layers of ring, scratch


@pytest.mark.parametrize("budget", [BUDGET, None], ids=["streamed", "staged"])
def test_mates_on_one_gpu_get_every_byte(monkeypatch, budget):
    job = f"node-gpu-{'streamed' if budget else 'staged'}"
    monkeypatch.setenv("MEGAREFIT_NODE", job)
    rdzv = Rendezvous.serve(job=job)
    hf = reference_hf_state(CFG, "qwen3")
    shards = {r: {n: t.to("cuda") for n, t in s.items()} for r, s in reference_shards(hf, CFG, tp=2, pp=1).items()}
    pubs = [Publisher(s, CFG, rank=r, layout=source_layout(CFG, tp=2, pp=1), rendezvous=rdzv,
                      agent_name=f"{job}-t{r[0]}") for r, s in shards.items()]
    rx = [RefitReceiver(rdzv, name=f"{job}-r{i}", timeout=60, node=2, memory_budget=budget, device="cuda")
          for i in range(2)]
    total = sum(t.numel() * t.element_size() for t in hf.values())
    for v in (1, 2):
        for p in pubs:
            p.publish(v)
        got: list = [None, None]

        def run(i, v=v):
            try:
                got[i] = {n: t.cpu() for n, t in rx[i].run_refit_cycle(v)}
            except Exception as exc:  # noqa: BLE001 (handed to the test)
                got[i] = exc

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for g in got:
            assert not isinstance(g, Exception), g
            assert g.keys() == hf.keys() and [n for n in hf if not torch.equal(g[n], hf[n])] == []
        stats = [r.stats for r in rx]
        assert all(s.node_fallbacks == () for s in stats)
        assert budget is None or all(s.groups > 1 and s.peak_extra_bytes <= budget for s in stats)
        assert sum(s.node_bytes for s in stats) == total  # every shared byte copied once between the mates
        # staged READs take gathered runs whole (strided pulls): at least the rest, streamed exactly the rest
        assert all(s.node_bytes + s.wire_bytes == total if budget else s.node_bytes + s.wire_bytes >= total
                   for s in stats)
    for r in rx:
        r.close()
    rdzv.store.close()
