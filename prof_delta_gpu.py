"""Temporary: profile one delta apply on GPU (not committed)."""
import cProfile, pstats, time, sys, torch
sys.path.insert(0, "benchmarks")
from megarefit.demo.bench import bench_config
from megarefit.layout.dims import ModelDims
from megarefit.layout.geometry import source_tensors
from megarefit.layout.megatron_model import source_layout
from megarefit.online import RefitReceiver
from megarefit.online.delta_log import DeltaOptions
from megarefit.online.publisher import Publisher
from megarefit.online.rendezvous import Rendezvous

cfg = bench_config("tests/data/configs/Qwen3-8B.json", 8)
layout = source_layout(cfg, tp=2, pp=1)
dims = ModelDims.from_hf_config(cfg)
rdzv = Rendezvous.serve(job="prof")
params, pubs = {}, []
for r in layout.ranks():
    g = torch.Generator(device="cuda:0").manual_seed(r.tp)
    params[r] = {n: (torch.randn(t.shape, generator=g, device="cuda:0") * 0.02).to(torch.bfloat16) for n, t in source_tensors(dims, layout)[r].items()}
    pubs.append(Publisher(params[r], cfg, rank=r, layout=layout, rendezvous=rdzv, agent_name=f"prof-{r.tp}", delta=DeltaOptions(slots="device", mirror="device")))
rx = RefitReceiver(rdzv, name="prof-rx", device="cuda:1")
rx.delta_model.rates.update(delta_wire=1e30, scatter=1e30, tensor=0.0, full=1e30); rx.delta_model.learn = False
def step(v):
    for ps in params.values():
        for t in ps.values():
            m = torch.rand(t.shape, device="cuda:0") < 0.011
            t[m] = t[m] * (1 + 2 ** -5)
    for p in pubs: p.publish(v)
for p in pubs: p.publish(1)
dict(rx.run_refit_cycle(1))
for v in range(2, 5):
    step(v); torch.cuda.synchronize("cuda:1"); t0 = time.perf_counter()
    if v == 4:
        pr = cProfile.Profile(); pr.enable()
    dict(rx.run_refit_cycle(v)); torch.cuda.synchronize("cuda:1")
    if v == 4:
        pr.disable()
    print(v, rx.stats.refit, f"{(time.perf_counter()-t0)*1e3:.1f} ms", {k: round(x*1e3, 2) for k, x in rx.stats.seconds.items()}, rx.stats.delta_tensors, rx.stats.changed_elements)
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(25)
from torch.profiler import profile, ProfilerActivity
step(5)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    dict(rx.run_refit_cycle(5)); torch.cuda.synchronize("cuda:1")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
