"""Worker bodies for the real Megatron-Core tests (module level so spawn can import them)."""

from __future__ import annotations

from typing import Any

import torch

from megarefit.demo.megatron_cpu import bf16_adam_trainer, build_gpt_model, gpt_arch_from_hf, init_parallel
from megarefit.demo.trainer_jobs import TrainerCase, trainer_job


class Wrapper(torch.nn.Module):
    """Stands in for DDP / Float16Module: parameters gain a ``module.`` prefix."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module


def job(rank: int, world_size: int, port: int, cases: list[TrainerCase], classifier_config: dict) -> dict[str, Any]:
    from megarefit.errors import ClassificationError
    from megarefit.layout.classify import check_model, classify_model
    from megarefit.layout.dims import ModelDims

    out = trainer_job(rank, world_size, port, cases)
    init_parallel(rank=rank, world_size=world_size, master_port=port, tp=2, pp=1)
    model = build_gpt_model(gpt_arch_from_hf(classifier_config, tp=2))
    dims = ModelDims.from_hf_config(classifier_config)
    wrapped = classify_model(Wrapper(Wrapper(model)), dims)
    overridden = classify_model(model, dims, overrides={"RowParallelLinear": "column"})
    try:
        check_model(model, dims, overrides={"decoder.layers.0.mlp.linear_fc1.weight": "replicated"})
        raised = None
    except ClassificationError as exc:
        raised = str(exc)
    out["classifier"] = {
        "wrapped": [(c.name, c.module_class, c.module_mode, c.attr_mode, c.role, c.problem) for c in wrapped],
        "overridden_problems": sorted(c.name for c in overridden if not c.ok),
        "raised": raised,
    }
    return out


def mtp_layout_job(rank: int, world_size: int, port: int, configs: dict[str, dict],
                   layouts: list[tuple[int, int]]) -> dict[str, Any]:
    """Build each config with one multi-token-prediction layer at each (tp, pp); return this
    rank's coordinate, parameter shapes, classifier problems (MTP forward needs labels,
    so no logits) and the rank and layout ``Publisher.from_megatron`` reads."""
    from megatron.core import parallel_state as ps

    from megarefit.integrations.megatron import local_named_parameters
    from megarefit.layout.classify import classify_model
    from megarefit.layout.dims import ModelDims
    from megarefit.layout.megatron_model import read_chunks

    out: dict[str, Any] = {}
    for key, cfg in configs.items():
        for tp, pp in layouts:
            init_parallel(rank=rank, world_size=world_size, master_port=port, tp=tp, pp=pp)
            model = build_gpt_model(gpt_arch_from_hf(cfg, tp=tp, mtp_layers=1), seed=0)
            dims = ModelDims.from_hf_config(cfg)
            coord = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), 0)
            out[f"{key}-tp{tp}-pp{pp}"] = {
                "coord": coord,
                "shapes": {n: tuple(t.shape) for n, t in local_named_parameters(model).items()},
                "problems": [f"{c.name}: {c.problem}" for c in classify_model(model, dims, pp=pp, layer_spec="local")
                             if not c.ok],
                "read": [(tuple(c.rank), c.layout.to_dict()) for c in read_chunks(model, dims)]}  # from_megatron's
    return out


def vpp_layout_job(rank: int, world_size: int, port: int, cfg: dict, pp: int, vpp: int) -> dict[str, Any]:
    """Build every virtual-pipeline chunk of this rank; per chunk, each parameter's shape and the
    global layer Megatron itself numbers its owning TransformerLayer (``layer_number - 1``)."""
    from megatron.core import parallel_state as ps

    from megarefit.integrations.megatron import local_named_parameters

    init_parallel(rank=rank, world_size=world_size, master_port=port, tp=1, pp=pp, vpp=vpp)
    out: dict[str, Any] = {}
    for chunk in range(vpp):
        model = build_gpt_model(gpt_arch_from_hf(cfg, tp=1), seed=0, vp_stage=chunk)
        layers = {}
        for name, module in model.named_modules():
            if hasattr(module, "layer_number") and name.startswith("decoder.layers."):
                layers[name] = module.layer_number - 1
        params = {}
        for n, t in local_named_parameters(model).items():
            owner = next((layers[m] for m in layers if n.startswith(m + ".")), None)
            params[n] = (tuple(t.shape), owner)
        out[chunk] = {"pp": ps.get_pipeline_model_parallel_rank(), "params": params}
    return out


def deferred_param_gather_job(rank: int, world_size: int, port: int, rdzv_port: int, job: str,
                              cfg: dict, every_copy: bool = False) -> dict[str, Any]:
    """Data-parallel rank ``rank`` of 2 (tp=1) under real Megatron-Core DDP with the
    distributed optimizer's buffer layout and ``overlap_param_gather``: a real backward and
    gradient sync, then the distributed optimizer's step as Megatron does it (each rank
    writes only its own shard of the parameter buffer: rank r adds r + 1). Rank 0's
    Publisher (``ddp=``) must refuse to publish until ``finish_param_sync`` ran on both
    ranks, and then serve the whole new parameters. ``every_copy``: rank 1 (data-parallel copy 1)
    serves too, and each serving rank reports the bytes at every address its manifest names
    (what a receiver READs) against the buffers the step makes whole."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.param_sync import ParamSyncPendingError, finish_param_sync
    from megarefit.online.trainer.publisher import Publisher

    init_parallel(rank=rank, world_size=world_size, master_port=port, tp=1, pp=1)
    model = build_gpt_model(gpt_arch_from_hf(cfg, tp=1), seed=0)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_param_gather=True, overlap_grad_reduce=True), model)
    tokens = torch.randint(0, cfg["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), diagonal=1)[None, None]
    ddp(tokens, torch.arange(8)[None], attention_mask=mask).float().sum().backward()
    ddp.finish_grad_sync()  # what Megatron's schedule does before the optimizer step
    buffers = [b.param_data for g in ddp.bucket_groups for b in g.buckets]
    expected = []
    for data in buffers:  # the step: each rank updates its own shard; the others' stay stale here
        want = data.clone()
        for r, shard in enumerate(shard_buffer(want, world_size)):
            shard.add_(float(r + 1))
        expected.append(want)
        shard_buffer(data, world_size)[rank].add_(float(rank + 1))
    out: dict[str, Any] = {"rank": rank}
    pub = None
    if rank == 0 or every_copy:
        rdzv = Rendezvous.connect("127.0.0.1", rdzv_port, job=job)
        pub = Publisher.from_megatron(ddp, cfg, rendezvous=rdzv, agent_name=f"{job}-trainer-{rank}")  # finds the DDP wrapper
        out["coord"] = tuple(pub.rank)
        out["stale_before"] = any(not torch.equal(d, e) for d, e in zip(buffers, expected))
        try:
            pub.publish(2)
            out["refused"] = None
        except ParamSyncPendingError as exc:
            out["refused"] = str(exc)
    torch.distributed.barrier()
    finish_param_sync([ddp])  # every data-parallel rank
    out["whole_after"] = all(torch.equal(d, e) for d, e in zip(buffers, expected))
    if pub is not None:
        pub.publish(2)
        out["served_is_buffer"] = all(any(t.data_ptr() >= d.data_ptr() and t.data_ptr() < d.data_ptr()
                                          + d.numel() * d.element_size() for d in buffers)
                                      for t in pub.params.values() if t.requires_grad)
        out["served_bytes"] = _served_against(pub.manifest, buffers, expected)
    return out


def _served_against(manifest: Any, buffers: list[torch.Tensor], expected: list[torch.Tensor]) -> dict[str, Any]:
    """The bytes at each address ``manifest`` names (read from raw memory, as a receiver READs them)
    against the same range of ``expected``: entries inside a parameter buffer, and those that differ."""
    import ctypes

    inside, differ = 0, []
    for e in manifest.tensors:
        raw = torch.frombuffer((ctypes.c_char * e.nbytes).from_address(e.addr), dtype=torch.uint8)
        for data, want in zip(buffers, expected):
            start = e.addr - data.data_ptr()
            if 0 <= start and start + e.nbytes <= data.numel() * data.element_size():
                inside += 1
                if not torch.equal(raw, want.view(-1).view(torch.uint8)[start:start + e.nbytes]):
                    differ.append(e.name)
    return {"entries": len(manifest.tensors), "inside": inside, "differ": differ}


def step_once(ddp: Any, opt: Any, cfg: dict, g: torch.Generator) -> None:
    """One real training step: next-token loss on a random batch, backward, Megatron's gradient
    sync and optimizer step (the optimizer on CPU)."""
    from megarefit.demo.megatron_cpu import optimizer_on_cpu

    tokens = torch.randint(0, cfg["vocab_size"], (2, 9), generator=g)
    mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), diagonal=1)[None, None]
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ddp(tokens[:, :-1], torch.arange(8)[None].expand(2, 8), attention_mask=mask,
        labels=tokens[:, 1:]).float().mean().backward()
    with optimizer_on_cpu():
        ddp.finish_grad_sync()
        opt.step()


def _no_changes(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(p.numel(), dtype=torch.bool) for n, p in params.items()}


def _add_changes(union: dict[str, torch.Tensor], before: dict[str, torch.Tensor],
                 after: dict[str, torch.Tensor]) -> None:
    """The oracle: mark, per tensor, the flat elements whose bits a step changed."""
    for n, u in union.items():
        u |= before[n].view(-1).view(torch.int16) != after[n].detach().view(-1).view(torch.int16)


def _compare(tracker: Any, params: dict[str, torch.Tensor], union: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """Per tensor: (elements the steps changed, whether the tracker found exactly those)."""
    return {n: (int(u.sum()), torch.equal(tracker.changed(params[n]), u.nonzero().view(-1))) for n, u in union.items()}


def delta_track_job(rank: int, world_size: int, port: int, rdzv_port: int, job: str, cfg: dict,
                    publish_after: list[int]) -> dict[str, Any]:
    """Data-parallel rank ``rank`` of 2 (tp=1) trains the demo GPT with Megatron's
    ``DistributedOptimizer`` (each rank steps its shard; the all-gather makes them whole), its
    changes tracked by ``track_changes`` on both ranks. Rank 0 serves it with
    ``Publisher.from_megatron(..., delta=..., tracker=...)`` and publishes version ``k + 2`` after
    step ``publish_after[k]`` (version 1: before any step), waiting for the test's receivers.
    Before each publish, every rank compares what the tracker found with the bits that changed
    since the last publish (rank 1 never publishes: since the start). Then the same with
    Megatron's non-distributed mixed-precision optimizer (the tracker against the oracle only)."""
    from megarefit.integrations.megatron import refit_tensors
    from megarefit.online.delta.log import DeltaOptions
    from megarefit.online.delta.track import track_changes
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.publisher import Publisher

    init_parallel(rank=rank, world_size=world_size, master_port=port, tp=1, pp=1)
    out: dict[str, Any] = {"rank": rank, "distributed": [], "float16": []}
    g = torch.Generator().manual_seed(rank)
    model, ddp, opt = bf16_adam_trainer(cfg, lr=1e-6)
    tracker = track_changes(opt)
    params = refit_tensors(model)
    rdzv = Rendezvous.connect("127.0.0.1", rdzv_port, job=job)
    pub = Publisher.from_megatron(ddp, cfg, rendezvous=rdzv, agent_name=f"{job}-trainer", serve_copies=False,
                                  delta=DeltaOptions(keep=2, capacity=1.0), tracker=tracker, checksums=True)
    version = 1
    if pub.serving:
        pub.publish(version)
        pub.wait_receivers(version, timeout=120)
        out["tracked"], out["served"] = pub.delta.tracked, len(pub.delta.served)
    union = _no_changes(params)
    for step in range(1, max(publish_after) + 1):
        before = {n: p.detach().clone() for n, p in params.items()}
        step_once(ddp, opt, cfg, g)
        _add_changes(union, before, params)
        if step not in publish_after:
            continue
        out["distributed"].append(_compare(tracker, params, union))
        if rank == 0:
            union = _no_changes(params)
        if pub.serving:
            version += 1
            pub.publish(version)
            pub.wait_receivers(version, timeout=120)
            out.setdefault("recorded", []).append(pub.last_delta.recorded)
    torch.distributed.barrier()
    model, ddp, opt = bf16_adam_trainer(cfg, lr=1e-5, distributed=False)
    tracker, params = track_changes(opt), refit_tensors(model)
    union = _no_changes(params)
    for _ in range(2):
        before = {n: p.detach().clone() for n, p in params.items()}
        step_once(ddp, opt, cfg, g)
        _add_changes(union, before, params)
    out["float16"] = _compare(tracker, params, union)
    return out
