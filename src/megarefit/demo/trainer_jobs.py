"""Trainer jobs run in :mod:`~megarefit.demo.workers` processes: build a real Megatron-Core
model per :class:`TrainerCase`, then return its shards and logits (:func:`trainer_job`) or
serve them through a :class:`~megarefit.online.trainer.publisher.Publisher` (:func:`serving_trainer_job`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from megarefit.demo.megatron_cpu import (
    HARNESS_MODULE_MODES,
    apply_cpu_patches,
    build_gpt_model,
    fake_grouped_gemm,
    forward_logits,
    gpt_arch_from_hf,
    init_parallel,
    perturb_parameters_,
)
from megarefit.integrations.megatron import local_named_parameters, megatron_core_of


@dataclass(frozen=True)
class TrainerCase:
    """One model to build in :func:`trainer_job`: HF config, layout, tokens for the forward pass."""

    key: str
    hf_config: dict
    tp: int
    pp: int
    tokens: torch.Tensor  # [batch, seq] int64
    seed: int = 1234
    ep: int = 1
    etp: int | None = None  # expert tensor-parallel size (None: tp)
    expert_layout: str = "sequential"  # or "legacy_grouped" (GroupedMLP through a looped grouped GEMM)
    dtype: str = "float32"  # the model's parameters and forward pass: "float32" or "bfloat16"


def _first_copy(ep: int) -> bool:
    """Whether this rank holds the first copy of its (tp, pp, ep) shard: data-parallel ranks
    ``0 .. ep-1`` carry the ep ranks' distinct experts (``expert_tensor_parallel_size == tp``);
    later ones repeat them."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank() // max(1, ep) == 0


def is_hybrid(hf_config: dict) -> bool:
    """A hybrid Mamba2 config (Nemotron-H), built as Megatron-Core's ``MambaModel``."""
    return hf_config.get("model_type") == "nemotron_h"


def check_buildable(hf_config: dict, tp: int) -> None:
    """Raise :class:`~megarefit.errors.MegarefitError` for a config the CPU harnesses cannot build
    exactly (before any process starts)."""
    if is_hybrid(hf_config):
        from megarefit.demo.megatron_mamba import mamba_arch_from_hf

        mamba_arch_from_hf(hf_config, tp=tp)
    else:
        gpt_arch_from_hf(hf_config, tp=tp)


def _build(case: TrainerCase) -> torch.nn.Module:
    """The case's GPTModel. ``legacy_grouped`` experts are Megatron's ``GroupedMLP`` run through
    :func:`~megarefit.demo.megatron_cpu.fake_grouped_gemm` (a looped fp32 ``gmm``); its forward
    asserts ``config.bf16``, which is set after the build so no other module sees it."""
    if is_hybrid(case.hf_config):  # Nemotron-H: Megatron-Core's MambaModel
        from megarefit.demo.megatron_mamba import apply_mamba_cpu_patches, build_mamba_model, mamba_arch_from_hf

        apply_mamba_cpu_patches()
        if case.expert_layout != "sequential":
            raise ValueError(f"expert_layout {case.expert_layout!r}: the CPU MambaModel builds sequential experts")
        return build_mamba_model(dataclasses.replace(mamba_arch_from_hf(case.hf_config, tp=case.tp),
                                                     dtype=case.dtype), seed=case.seed)
    arch = dataclasses.replace(gpt_arch_from_hf(case.hf_config, tp=case.tp), dtype=case.dtype)
    if case.expert_layout == "legacy_grouped":
        fake_grouped_gemm()
        arch = dataclasses.replace(arch, moe_grouped_gemm=True)
    elif case.expert_layout != "sequential":
        raise ValueError(f"expert_layout {case.expert_layout!r}: the CPU harness builds sequential or legacy_grouped")
    model = build_gpt_model(arch, seed=case.seed)
    if case.expert_layout == "legacy_grouped":
        model.config.bf16 = True
    return model


def trainer_job(rank: int, world_size: int, master_port: int, cases: list[TrainerCase]) -> dict[str, Any]:
    """Worker body for :func:`run_workers`: build each case's GPTModel, perturb it, run the
    classifier against the spec table, run the forward pass.

    Returns ``{case.key: {"coord": (tp, pp, ep), "params": {...}, "logits": tensor | None,
    "problems": [classifier disagreements], "build_s": s, "forward_s": s, "megatron": MegatronCore
    record (dict), "read": {"rank", "layout"}: what ``Publisher.from_megatron`` reads}}`` for ranks of
    the first data-parallel replica; other ranks return ``{}`` entries.
    """
    apply_cpu_patches()  # before the first megatron import, so its import-time warnings are filtered
    from megatron.core import parallel_state as ps

    from megarefit.layout.classify import classify_model
    from megarefit.layout.dims import ModelDims
    from megarefit.layout.megatron_model import read_chunks

    out: dict[str, Any] = {}
    for case in cases:
        init_parallel(rank=rank, world_size=world_size, master_port=master_port, tp=case.tp, pp=case.pp, ep=case.ep,
                      etp=case.etp)
        t0 = time.perf_counter()
        model = _build(case)
        perturb_parameters_(model, seed=case.seed)
        t1 = time.perf_counter()
        logits = forward_logits(model, case.tokens)
        t2 = time.perf_counter()
        if not _first_copy(case.ep):
            out[case.key] = {}
            continue
        dims = ModelDims.from_hf_config(case.hf_config)
        megatron = megatron_core_of(model)
        problems = [f"{c.name}: {c.problem}" for c in classify_model(model, dims, pp=case.pp, layer_spec="local",
                                                                     overrides=HARNESS_MODULE_MODES, megatron=megatron)
                    if not c.ok]
        coord = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                 ps.get_expert_model_parallel_rank())
        read = read_chunks(model, dims)[0]  # what Publisher.from_megatron reads
        out[case.key] = {"coord": coord, "params": local_named_parameters(model), "logits": logits,
                         "problems": problems, "build_s": t1 - t0, "forward_s": t2 - t1,
                         "megatron": megatron.to_dict(), "read": {"rank": tuple(read.rank),
                                                                  "layout": read.layout.to_dict()}}
    return out


def serving_trainer_job(rank: int, world_size: int, master_port: int, case: TrainerCase,
                        rendezvous: tuple[str, int, str], versions: int, step_scale: float = 0.01,
                        snapshot_dir: str | None = None, serve_copies: bool = True,
                        secret: str | None = None) -> dict[str, Any]:
    """Worker body: a trainer rank that serves its live shards over NIXL for ``versions`` versions.

    Builds the case's GPTModel, serves it through ``Publisher.from_megatron``
    (registered once), then for v = 1..versions: (v > 1) changes every weight in
    place as an optimizer step would, runs the forward pass, snapshots the
    shards, publishes version v, and waits until a receiver marks v consumed.
    Every data-parallel copy serves (``serve_copies=False``: only each coordinate's first; the
    others return at once with nothing served). Returns ``{"coord", "snapshots": {v: params},
    "logits": {v: tensor | None}, "counters"}`` (``coord``: ``(tp, pp, ep)``, ``+ (copy,)`` past
    the first copy);
    with ``snapshot_dir`` each version's shards are also saved there as
    ``v{v}-tp{t}-pp{p}-ep{e}.pt`` before the version is published, and the last stage's
    logits of ``case.tokens`` (fp32 ``[batch, seq, padded_vocab]``) as ``logits-v{v}-tp{t}.pt``.
    ``secret``: the job secret (default ``$MEGAREFIT_JOB_SECRET``).
    """
    apply_cpu_patches()
    from megatron.core import parallel_state as ps

    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.publisher import Publisher

    init_parallel(rank=rank, world_size=world_size, master_port=master_port, tp=case.tp, pp=case.pp, ep=case.ep)
    model = _build(case)
    perturb_parameters_(model, seed=case.seed)
    coord = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
             ps.get_expert_model_parallel_rank())
    if not serve_copies and not _first_copy(case.ep):  # one publisher per (tp, pp, ep) shard
        return {"coord": coord, "snapshots": {}, "logits": {}, "counters": []}
    host, port, job = rendezvous
    rdzv = Rendezvous.connect(host, port, job=job, secret=secret)
    pub = Publisher.from_megatron(model, case.hf_config, rendezvous=rdzv,  # the layout read from Megatron
                                  serve_copies=serve_copies)
    coord = tuple(pub.rank)
    out: dict[str, Any] = {"coord": coord, "snapshots": {}, "logits": {}, "counters": []}
    for v in range(1, versions + 1):
        if v > 1:
            perturb_parameters_(model, seed=case.seed + v, scale=step_scale)  # stands in for optimizer.step()
        out["logits"][v] = forward_logits(model, case.tokens)
        out["snapshots"][v] = local_named_parameters(model)
        if snapshot_dir is not None:
            copy = f"-copy{coord[3]}" if len(coord) > 3 else ""
            torch.save(out["snapshots"][v], os.path.join(snapshot_dir, "v{}-tp{}-pp{}-ep{}{}.pt".format(v, *coord[:3], copy)))
            if out["logits"][v] is not None:
                torch.save(out["logits"][v], os.path.join(snapshot_dir, f"logits-v{v}-tp{coord[0]}.pt"))
        pub.publish(v)
        rdzv.wait_consumed(v)
        out["counters"].append(dict(pub.counters))
    return out


__all__ = ["TrainerCase", "serving_trainer_job", "trainer_job"]
