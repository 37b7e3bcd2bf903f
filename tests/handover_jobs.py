"""Trainer processes for the handover stress test (tests/test_handover.py): two TP ranks
that rewrite every parameter in lockstep, continuously, until told to stop."""

from __future__ import annotations

import random
import time

import torch


def writer_job(index: int, world_size: int, master_port: int, rdzv_port: int, job: str, cfg: dict, mode: str,
               write_s: float, idle_s: float, device: str = "cpu") -> dict:
    """TP rank ``index`` of 2: every parameter holds the value ``v`` (float32, exact) of
    version ``v``. A step rewrites the parameters one by one over ~``write_s`` seconds
    (``mode="seqlock"``: inside ``Publisher.updating(v)``; ``"plain"``: then
    ``publish(v)``; ``"snapshot"``: the same with ``Publisher(snapshot=True)``), both ranks starting each step together (a gloo barrier), then idles
    up to ``idle_s``. Parameters live on ``device``. Returns the last version written."""
    import torch.distributed as dist

    from megarefit.layout import SourceLayout
    from megarefit.layout.dims import ModelDims
    from megarefit.layout.geometry import source_tensors
    from megarefit.layout.megatron_model import source_layout
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.publisher import Publisher

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{master_port}", rank=index, world_size=world_size)
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=2, pp=1, padded_vocab_size=dims.padded_vocab_size(2), num_layers=dims.num_layers)
    coord = layout.ranks()[index]
    params = {n: torch.ones(t.shape, dtype=torch.float32, device=device)
              for n, t in source_tensors(dims, layout)[coord].items()}
    rdzv = Rendezvous.connect("127.0.0.1", rdzv_port, job=job)
    pub = Publisher(params, cfg, rank=coord, layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv,
                    agent_name=f"{job}-trainer-{index}", snapshot=mode == "snapshot")
    pub.publish(1)
    rng = random.Random(index)
    pause = write_s / max(1, len(params))
    v = 1
    stop = rdzv.prefix + "stop"
    while True:
        dist.barrier()
        flag = torch.tensor([int(rdzv.store.check([stop]))])
        dist.all_reduce(flag)  # both ranks stop after the same step
        if flag.item():
            break
        v += 1

        def write(value: float) -> None:
            for t in params.values():
                t.fill_(value)
                time.sleep(pause)

        if mode == "seqlock":
            with pub.updating(v):
                write(float(v))
        else:
            write(float(v))
            pub.publish(v)
        time.sleep(rng.uniform(0, idle_s))
    dist.barrier()
    rdzv.store.wait([rdzv.prefix + "done"])  # keep serving until the receiver is finished
    dist.destroy_process_group()
    return {"last": v}


def receiver_job(index: int, world_size: int, master_port: int, rdzv_port: int, job: str) -> dict:
    """A receiver process: registers, pulls and acknowledges version 1, says so, then idles
    (heartbeat running) until killed."""
    from megarefit.online import RefitReceiver
    from megarefit.online.store.rendezvous import Rendezvous

    rdzv = Rendezvous.connect("127.0.0.1", rdzv_port, job=job)
    receiver = RefitReceiver(rdzv, name=f"{job}-receiver-proc", timeout=30, heartbeat_s=0.05)
    dict(receiver.run_refit_cycle(1))
    receiver.acknowledge()
    rdzv.store.set(rdzv.prefix + "receiver-ready", "1")
    time.sleep(600)
    return {}


def replica_parent_job(index: int, world_size: int, master_port: int, rdzv_port: int, job: str, group: str) -> dict:
    """A first-tier receiver process serving replica group ``group``: pulls version 1 from
    the trainers, says so, then idles (serving its arena) until killed."""
    from megarefit.online import RefitReceiver
    from megarefit.online.store.rendezvous import Rendezvous

    rdzv = Rendezvous.connect("127.0.0.1", rdzv_port, job=job)
    receiver = RefitReceiver(rdzv, name=f"{job}-tier1", timeout=30, replica_group=group)
    dict(receiver.run_refit_cycle(1))
    rdzv.store.set(rdzv.prefix + "tier1-ready", "1")
    time.sleep(600)
    return {}


def static_trainer_job(index: int, world_size: int, master_port: int, rdzv_port: int, job: str, cfg: dict,
                       tp_rank: int | None, value: float, version: int, devices: tuple[str, ...] = ("cpu",)) -> dict:
    """TP rank ``tp_rank`` (default: the worker index) of 2 serving parameters that all hold
    ``value`` as ``version``, until ``stop`` is set; worker ``i``'s on ``devices[i % len(devices)]``."""
    from megarefit.layout import SourceLayout
    from megarefit.layout.dims import ModelDims
    from megarefit.layout.geometry import source_tensors
    from megarefit.layout.megatron_model import source_layout
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.publisher import Publisher

    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=2, pp=1, padded_vocab_size=dims.padded_vocab_size(2), num_layers=dims.num_layers)
    tp_rank = index if tp_rank is None else tp_rank
    coord = layout.ranks()[tp_rank]
    device = devices[index % len(devices)]
    params = {n: torch.full(t.shape, value, device=device) for n, t in source_tensors(dims, layout)[coord].items()}
    rdzv = Rendezvous.connect("127.0.0.1", rdzv_port, job=job)
    pub = Publisher(params, cfg, rank=coord, layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv,
                    agent_name=f"{job}-trainer-{tp_rank}")
    pub.publish(version)
    rdzv.store.wait([rdzv.prefix + "stop"])
    return {}
