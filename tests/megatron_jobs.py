"""Worker bodies for the real Megatron-Core tests (module level so spawn can import them)."""

from __future__ import annotations

from typing import Any

import torch

from megarefit.integrations.megatron import (
    TrainerCase, build_gpt_model, gpt_arch_from_hf, init_parallel, trainer_job,
)


class Wrapper(torch.nn.Module):
    """Stands in for DDP / Float16Module: parameters gain a ``module.`` prefix."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module


def job(rank: int, world_size: int, port: int, cases: list[TrainerCase], classifier_config: dict) -> dict[str, Any]:
    from megarefit.classify import check_model, classify_model
    from megarefit.dims import ModelDims
    from megarefit.errors import ClassificationError

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
    rank's coordinate, parameter shapes and classifier problems (MTP forward needs labels,
    so no logits)."""
    from megatron.core import parallel_state as ps

    from megarefit.classify import classify_model
    from megarefit.dims import ModelDims
    from megarefit.integrations.megatron import local_named_parameters

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
                             if not c.ok]}
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
