"""Trainer processes for tests/test_moved_params.py and benchmarks/bench_moved.py: real
Megatron-Core GPT shards (tp 2, gloo, CPU) behind Megatron-Core DDP, served by
``Publisher.from_megatron``, whose parameter buffers move between versions the way RL trainers
move them (:mod:`megarefit.demo.offload`)."""

from __future__ import annotations

import time
import zlib
from typing import Any

import torch

STEPS = ("offload", "remap", "undeclared", "offload-rank0", "none")


def _step(params: dict[str, torch.Tensor], version: int) -> None:
    """A stand-in optimizer step: every parameter changes in place, seeded by its name and the
    version (so the TP ranks' copies of a replicated parameter stay equal, as Megatron keeps them)."""
    with torch.no_grad():
        for name, p in params.items():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + version)
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.01)


def _move(how: str, ddp: Any, pub: Any, rank: int, out: dict[str, Any]) -> None:
    """Move this rank's parameter buffers ``how`` (one of :data:`STEPS`), declared or not."""
    from megarefit.demo.offload import offload_like_verl, remap_like_memory_saver

    if how == "none" or (how == "offload-rank0" and rank != 0):
        return
    if how == "undeclared":
        with offload_like_verl(ddp) as moves:
            pass
        out["addresses"].append(moves)
        return
    move = remap_like_memory_saver if how == "remap" else offload_like_verl
    with pub.moving(remapped=how == "remap"), move(ddp) as moves:
        pass
    out["addresses"].append(moves)
    stats = pub.last_move
    out["moves"].append({"moved": len(stats.moved), "served": len(pub.manifest.tensors),
                         "dropped": stats.dropped_bytes, "registered": stats.registered_bytes,
                         "republished": stats.republished, "seconds": stats.seconds})


def moved_trainer_job(rank: int, world_size: int, port: int, rdzv_port: int, job: str, cfg: dict,
                      steps: list[str], keep: bool = True) -> dict[str, Any]:
    """TP rank ``rank`` of 2: version 1 as built, then per entry of ``steps`` a move (``offload``:
    verl's, declared; ``remap``: torch_memory_saver's, declared ``remapped=True``; ``undeclared``:
    verl's with no declaration, whose publish must be refused, then declared after;
    ``offload-rank0``: only rank 0 moves; ``none``: no move), a step and the next version's
    publish. Waits for ``pulled/<v>`` (set by the test's receiver) before each move. Returns each
    version's parameters (``keep``), the buffers' (old, new) addresses per move, what each
    declared move did and the refusal's message."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megarefit.demo.megatron_cpu import build_gpt_model, gpt_arch_from_hf, init_parallel
    from megarefit.errors import ShapeMismatchError
    from megarefit.layout.megatron_model import refit_tensors
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.publisher import Publisher

    torch.set_num_threads(1)
    init_parallel(rank=rank, world_size=world_size, master_port=port, tp=2, pp=1)
    model = build_gpt_model(gpt_arch_from_hf(cfg, tp=2), seed=0)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)  # verl: param buffers
    params = refit_tensors(model)
    rdzv = Rendezvous.connect("127.0.0.1", rdzv_port, job=job)
    pub = Publisher.from_megatron(ddp, cfg, rendezvous=rdzv, agent_name=f"{job}-trainer-{rank}")
    out: dict[str, Any] = {"rank": tuple(pub.rank), "params": {}, "addresses": [], "moves": [], "refused": None}
    pub.publish(1)
    for version, how in enumerate(steps, start=2):
        if keep:
            out["params"][version - 1] = {n: p.detach().clone() for n, p in params.items()}
        rdzv.store.wait([f"{rdzv.prefix}pulled/{version - 1}"], 120.0)
        _move(how, ddp, pub, rank, out)
        _step(params, version)
        try:
            pub.publish(version)
        except ShapeMismatchError as exc:
            out["refused"] = str(exc)
            pub.params_moved()
            pub.publish(version)
    if keep:
        out["params"][len(steps) + 1] = {n: p.detach().clone() for n, p in params.items()}
    rdzv.store.wait([f"{rdzv.prefix}pulled/{len(steps) + 1}"], 120.0)
    torch.distributed.barrier()
    time.sleep(0.1)
    return out



def moved_delta_job(rank: int, world_size: int, port: int, rdzv_port: int, job: str, cfg: dict,
                    moves: list[bool]) -> dict[str, Any]:
    """Data-parallel rank ``rank`` of 2 (tp 1) trains the demo GPT in bf16 with Megatron's
    ``DistributedOptimizer``, its changes tracked by ``track_changes`` on both ranks; rank 0
    serves it with ``delta=`` and the tracker (no mirror). Version 1 as built; then per entry of
    ``moves`` (``True``: verl's offload of every DDP parameter buffer, declared with
    ``pub.moving()``, on both ranks as verl offloads them) a real step and the next version's
    publish, after the test's ``pulled/<v>``. Returns rank 0's parameters per version, each
    publish's ``last_delta``, each move's (old, new) buffer addresses and ``MoveStats``, and how
    many served tensors the tracker covers."""
    from megatron_jobs import step_once

    from megarefit.demo.megatron_cpu import bf16_adam_trainer, init_parallel
    from megarefit.demo.offload import offload_like_verl
    from megarefit.integrations.megatron import refit_tensors
    from megarefit.online.delta.log import DeltaOptions
    from megarefit.online.delta.track import track_changes
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.publisher import Publisher

    torch.set_num_threads(1)
    init_parallel(rank=rank, world_size=world_size, master_port=port, tp=1, pp=1)
    g = torch.Generator().manual_seed(rank)
    model, ddp, opt = bf16_adam_trainer(cfg, lr=1e-6)
    tracker = track_changes(opt)
    params = refit_tensors(model)
    rdzv = Rendezvous.connect("127.0.0.1", rdzv_port, job=job)
    group = Publisher.from_megatron(ddp, cfg, rendezvous=rdzv, agent_name=f"{job}-trainer", serve_copies=False,
                                    delta=DeltaOptions(keep=2, capacity=1.0), tracker=tracker)
    pub = group if isinstance(group, Publisher) else next(iter(group), None)
    out: dict[str, Any] = {"rank": rank, "params": {}, "deltas": [], "addresses": [], "moves": [],
                           "tracked": None if pub is None else (pub.delta.tracked, len(pub.delta.served))}
    group.publish(1)
    for version, move in enumerate(moves, start=2):
        out["params"][version - 1] = {n: p.detach().clone() for n, p in params.items()}
        rdzv.store.wait([f"{rdzv.prefix}pulled/{version - 1}"], 120.0)
        if move:
            with group.moving(), offload_like_verl(ddp) as addresses:
                pass
            out["addresses"].append(addresses)
            if pub is not None:
                out["moves"].append((len(pub.last_move.moved), len(pub.manifest.tensors), pub.last_move.republished))
        step_once(ddp, opt, cfg, g)
        group.publish(version)
        if pub is not None:
            out["deltas"].append((pub.last_delta.recorded, pub.last_delta.changed, pub.last_delta.elements))
    out["params"][len(moves) + 1] = {n: p.detach().clone() for n, p in params.items()}
    rdzv.store.wait([f"{rdzv.prefix}pulled/{len(moves) + 1}"], 120.0)
    torch.distributed.barrier()
    return out
