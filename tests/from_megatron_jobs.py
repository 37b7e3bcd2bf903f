"""Worker body for tests/test_from_megatron.py (module level so spawn can import it): real
Megatron-Core models on CPU, their layout read back by ``Publisher.from_megatron``'s reader."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from megarefit.demo.megatron_cpu import build_gpt_model, fake_grouped_gemm, gpt_arch_from_hf, init_parallel


@dataclasses.dataclass(frozen=True)
class Case:
    """One model: the HF config, Megatron's sizes, and what the arch adds (uneven stages, MTP)."""

    key: str
    cfg: dict
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int = 1
    arch: tuple[tuple[str, Any], ...] = ()  # GPTArch fields to replace


def _chunks(case: Case) -> list[torch.nn.Module]:
    arch = dataclasses.replace(gpt_arch_from_hf(case.cfg, tp=case.tp), **dict(case.arch))
    if arch.moe_grouped_gemm:  # Megatron's GroupedMLP (0.16) on CPU; built, never run here
        fake_grouped_gemm()
    if case.vpp == 1:
        return [build_gpt_model(arch, seed=0)]
    return [build_gpt_model(arch, seed=0, vp_stage=c) for c in range(case.vpp)]


def _read(model: Any, cfg: dict) -> dict[str, Any]:
    from megarefit.layout.dims import ModelDims
    from megarefit.layout.megatron_model import read_chunks

    try:
        chunks = read_chunks(model, ModelDims.from_hf_config(cfg))
    except Exception as exc:  # noqa: BLE001 - the test asserts on the message
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"ranks": [tuple(c.rank) for c in chunks], "layouts": [c.layout.to_dict() for c in chunks],
            "ddp": [c.ddp is not None for c in chunks], "replica": [c.replica for c in chunks],
            "dtypes": sorted({str(t.dtype) for c in chunks for t in c.params.values()}),
            "shapes": [{n: tuple(t.shape) for n, t in c.params.items()} for c in chunks]}


def _first_holder() -> bool:
    """Whether this process has the lowest global rank of those holding its ``(tp, pp, ep)``
    coordinate: the oracle of ``replica``, from the coordinates every process reports (not from
    megarefit's rank-order formula)."""
    from megatron.core import parallel_state as ps

    me = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
          ps.get_expert_model_parallel_rank())
    return _copy_index(me) == 0


def _copy_index(me: tuple[int, int, int]) -> int:
    """How many processes of lower global rank hold this one's ``(tp, pp, ep)`` coordinate: the
    oracle of ``RankCoord.copy``, from the coordinates every process reports."""
    coords: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(coords, me)
    return coords[:torch.distributed.get_rank()].count(me)


def _check_replica(key: str, read: dict[str, Any], rank: int) -> None:
    """Fail this worker at once (the test's receiver is waiting on it) where the read ``replica``
    disagrees with :func:`_first_holder`, naming both."""
    from megatron.core import parallel_state as ps

    me = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
          ps.get_expert_model_parallel_rank())
    copy = _copy_index(me)
    if "ranks" in read and any((r[3] if len(r) > 3 else 0) != copy for r in read["ranks"]):
        raise AssertionError(f"{key}: process {rank} read ranks {read['ranks']}, but it is copy {copy} of its "
                             "(tp, pp, ep) coordinate in Megatron's grid")
    serves = copy == 0
    if "replica" in read and read["replica"] != [not serves] * len(read["replica"]):
        raise AssertionError(f"{key}: process {rank} read replica={read['replica']}, but it is "
                             f"{'the first' if serves else 'not the first'} process holding its (tp, pp, ep) "
                             "coordinate in Megatron's grid")


def read_job(rank: int, world_size: int, port: int, cases: list[Case], rdzv: tuple[str, int, str]) -> dict[str, Any]:
    """Per case: build every chunk of this rank under Megatron's parallel state and read its layout.
    Also: the same model behind wrappers, with a wrong hf_config, with a missing chunk, under a
    process grid it was not built for, and a PublisherGroup serving the VPP case's chunks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from megarefit.layout.megatron_model import refit_tensors
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.publisher import Publisher

    out: dict[str, Any] = {}
    for case in cases:
        init_parallel(rank=rank, world_size=world_size, master_port=port, tp=case.tp, pp=case.pp, ep=case.ep,
                      etp=case.etp, vpp=case.vpp)
        chunks = _chunks(case)
        out[case.key] = _read(chunks if case.vpp > 1 else chunks[0], case.cfg)
        _check_replica(case.key, out[case.key], rank)
        out[case.key]["params"] = [{n: t.detach().clone() for n, t in refit_tensors(c).items()} for c in chunks]
        if case.key == "dense-tp2":
            model = chunks[0]
            model.config.bf16 = True  # Float16Module casts the model to bf16 (Megatron: DDP(Float16Module(model)))
            ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(),
                                          Float16Module(model.config, model))
            out["wrapped-ddp"] = _read(ddp, case.cfg)
            with warnings.catch_warnings(record=True) as caught:  # the same model, its DDP wrapper left out
                warnings.simplefilter("always")
                _read(model, case.cfg)
            out["unwrapped-warning"] = [str(w.message) for w in caught]
            out["wrong-hf-config"] = _read(model, {**case.cfg, "num_hidden_layers": case.cfg["num_hidden_layers"] + 2})
            from megarefit.layout.dims import ModelDims
            from megarefit.layout.megatron_model import check_stated, read_chunks, source_layout

            read = read_chunks(model, ModelDims.from_hf_config(case.cfg))[0].layout
            for key, stated in (("stated-right", source_layout(case.cfg, tp=2)),  # no megatron=: the version
                                ("stated-wrong", source_layout(case.cfg, tp=1))):
                try:
                    check_stated(read, stated)  # what from_megatron(layout=...) does before serving
                    out[key] = None
                except Exception as exc:  # noqa: BLE001 - the test asserts on the message
                    out[key] = f"{type(exc).__name__}: {exc}"
            init_parallel(rank=rank, world_size=world_size, master_port=port, tp=1, pp=1)  # dp=2
            out["wrong-grid"] = _read(model, case.cfg)
            single = build_gpt_model(gpt_arch_from_hf(case.cfg, tp=1), seed=0)
            out["dp2"] = _read(single, case.cfg)
            _check_replica("dp2", out["dp2"], rank)
            if rank == 1:  # the data-parallel copy: serves as copy 1, or (serve_copies=False) publishes nothing
                host, port_, job = rdzv
                rdzv_ = Rendezvous.connect(host, port_, job=job)
                empty = Publisher.from_megatron(single, case.cfg, rendezvous=rdzv_, serve_copies=False)
                out["dp2"]["publisher"] = (type(empty).__name__, empty.serving, len(empty))
                pub = Publisher.from_megatron(single, case.cfg, rendezvous=rdzv_)
                out["dp2"]["copy"] = (type(pub).__name__, pub.serving, tuple(pub.rank), pub.layout.copies,
                                      rdzv_.manifests([pub.rank])[0][pub.rank].agent)
        if case.vpp > 1:
            out["one-chunk-of-two"] = _read(chunks[0], case.cfg)
            out["one-stage-refuses"] = _read(chunks if rank == 0 else chunks[0], case.cfg)  # no stage is left waiting
            host, port_, job = rdzv
            group = Publisher.from_megatron(chunks, case.cfg, rendezvous=Rendezvous.connect(host, port_, job=job),
                                            agent_name=None)
            out["group"] = {"type": type(group).__name__, "ranks": [tuple(p.rank) for p in group]}
            group.publish(1)
            group.publishers[0].rendezvous.wait_consumed(1)
    return out
