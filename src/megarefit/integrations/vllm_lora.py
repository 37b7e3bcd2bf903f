"""Adapter-only LoRA refit: install a PEFT adapter into a running vLLM under one name, in memory.

vLLM 0.32 / 0.33 load a LoRA adapter from a *path* only (``LoRARequest.lora_path``,
``/v1/load_lora_adapter``): the worker's ``WorkerLoRAManager._load_adapter`` reads
``adapter_config.json`` and ``adapter_model.safetensors`` from disk the first time a request
names the adapter. An RL trainer holds its adapter in memory and changes it every step. This
module builds vLLM's own adapter object from the tensors (``LoRAModel.from_lora_tensors``, the
function ``_load_adapter`` ends in) and registers it in the worker's adapter manager under a
fixed integer id, pinned, so no request ever makes the worker look for it on disk::

    trainer:  {PEFT name: tensor} + peft_config (r, lora_alpha, target_modules)
        │  install_lora(llm, name, tensors, peft_config, version)   (driver side)
        ▼  llm.collective_rpc("megarefit_install_lora", safetensors blob, ...)   (every worker)
    worker:   check_adapter (names, shapes, config)            nothing touched on a refusal
              PEFTHelper.from_dict + validate_legal(lora_config)   vLLM's own adapter checks
              LoRAModel.from_lora_tensors(id, tensors, helper)     vLLM's own name parsing
              every module served by one of vLLM's LoRA layers?    else refused, named
              adapter manager: remove old id, add new, pin (CPU cache)   the new version serves
        ▼
    LoRARequest(name, id, "/megarefit-in-memory-lora/<name>/v<version>")   for generate()

PEFT names: ``base_model.model.model.layers.{L}.self_attn.q_proj.lora_A.weight`` (``A``:
``[r, in_features]``) and ``....lora_B.weight`` (``B``: ``[out_features, r]``); the adapter adds
``(lora_alpha / r) · B @ A`` to the module's weight (``lora_alpha / sqrt(r)`` with
``use_rslora``). Each worker receives the full (unsharded) factors and vLLM's LoRA layers slice
them for its tensor-parallel rank, as they do for an adapter read from disk.

The install runs in the worker (``collective_rpc``, through :class:`MegarefitLoraExtension`,
which :class:`~megarefit.integrations.vllm.MegarefitWorkerExtension` includes), so it works
where the engine runs its workers in other processes: the tensors travel with the call, as one
safetensors blob (:func:`adapter_blob`; vLLM's multiprocess RPC turns tensors nested in its
untyped arguments into lists, and bytes arrive as sent). vLLM
runs a ``collective_rpc`` between engine steps: requests *started after* the install use the
new version; a request in flight under the same name switches at its next step.

The version is in the returned request's path, which vLLM's prefix cache hashes with the
name (``_gen_lora_extra_hash_keys``): KV blocks computed under version v are never reused by a
request of version v+1. A request built for an older version still runs the newest weights
(one adapter per name in the worker) but may reuse that version's cached blocks: use the
request each install returns.

From the trainer, the tensors never ride on the RPC: :func:`refit_lora` has every worker pull the
adapter from the trainers' ``LoraPublisher`` s (one ``LoraReceiver`` per worker and adapter,
:func:`lora_receiver`), then install it as above and acknowledge it; and over HTTP, with
:func:`enable_lora_pulls` (the megarefit engine's ``init_info`` ``lora=True``), vLLM's own loader
pulls ``lora_path(name, version)`` from them when ``/v1/load_lora_adapter`` names that path
(``LRUCacheWorkerLoRAManager._load_adapter`` replaced; every other path loads as vLLM does).

Every vLLM internal touched is named in :data:`LORA_API` / :data:`LORA_ATTRS` and checked
before anything changes (:class:`~megarefit.integrations.vllm_install.VllmVersionError`,
naming the vLLM version). Refused: DoRA, LoRA biases and embedding LoRA tensors (names other
than ``lora_A.weight`` / ``lora_B.weight``), modules that none of this worker's vLLM LoRA
layers serves (named), pipeline parallelism (not proven yet), an engine without LoRA.
"""

from __future__ import annotations

import enum
import math
import os
import re
import uuid
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from megarefit.errors import MegarefitError
from megarefit.integrations.vllm_install import vllm_api, vllm_internal
from megarefit.online.receiver.lora_receiver import LoraReceiver
from megarefit.online.store.rendezvous import Rendezvous

# vLLM modules and the names megarefit reads from them
LORA_API = {
    "vllm.lora.lora_model": ("LoRAModel",),
    "vllm.lora.peft_helper": ("PEFTHelper",),
    "vllm.lora.request": ("LoRARequest",),
    "vllm.lora.worker_manager": ("LRUCacheWorkerLoRAManager",),
}
# attributes of live vLLM objects megarefit reads or calls: owner -> names
LORA_ATTRS = {
    "LoRAModel": ("from_lora_tensors",),
    "PEFTHelper": ("from_dict", "validate_legal"),
    "GPUModelRunner": ("lora_config", "parallel_config", "lora_manager"),  # the worker's (LoRAModelRunnerMixin)
    "LRUCacheWorkerLoRAManager": ("_adapter_manager", "lora_config", "vocab_size", "max_position_embeddings",
                                  "_load_adapter"),  # the last: hooked for adapters pulled from trainers
    "LRUCacheLoRAModelManager": ("model", "modules", "packed_modules", "capacity", "list_adapters", "add_adapter",
                                 "remove_adapter", "remove_oldest_adapter", "_pin_lora_in_cpu_cache"),
}
_WHY = "to install an in-memory LoRA adapter"
PEFT_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<factor>lora_A|lora_B)\.weight$")
PATH_ROOT = "/megarefit-in-memory-lora"  # absolute: vLLM never looks it up on the Hub, and no file is there
PEFT_REQUIRED = ("r", "lora_alpha", "target_modules")
# peft_config entries that change what the adapter computes and that this path has not proved
PEFT_REFUSED = {"use_dora": "DoRA (a magnitude vector per module) is not proved through vLLM's LoRA layers",
                "lora_bias": "LoRA biases are not served by vLLM's LoRA layers",
                "modules_to_save": "full-module copies (modules_to_save) are not adapter factors"}


@dataclass(frozen=True)
class AdapterModule:
    """One adapted module of a PEFT adapter: ``A [rank, in_features]``, ``B [out_features, rank]``."""

    module: str  # HF module name, e.g. "model.layers.0.self_attn.q_proj"
    rank: int
    in_features: int
    out_features: int


def check_adapter(tensors: Mapping[str, torch.Tensor], peft_config: Mapping[str, Any]) -> list[AdapterModule]:
    """Check an in-memory PEFT LoRA adapter before any of it reaches vLLM: every name a PEFT
    ``lora_A`` / ``lora_B`` weight, both factors of every module present with matching rank,
    each module's leaf among ``target_modules`` (where that is a list), the config plain LoRA.

    Returns:
        The adapted modules, sorted by name.

    Raises:
        MegarefitError: names the tensor or config entry and what was expected."""
    missing = [k for k in PEFT_REQUIRED if k not in peft_config]
    if missing:
        raise MegarefitError(f"peft_config lacks {missing}: an adapter needs r, lora_alpha and target_modules")
    for key, why in PEFT_REFUSED.items():
        if peft_config.get(key):
            raise MegarefitError(f"peft_config {key}={peft_config[key]!r} refused: {why}")
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = PEFT_NAME.match(name)
        if match is None:
            raise MegarefitError(f"adapter tensor {name!r} is not a PEFT LoRA factor "
                                 "(base_model.model.<module>.lora_A.weight / .lora_B.weight)")
        if tensor.dim() != 2:
            raise MegarefitError(f"adapter tensor {name!r}: 2 dims expected, shape {tuple(tensor.shape)}")
        factors.setdefault(match["module"], {})[match["factor"]] = tensor
    targets = peft_config["target_modules"]
    return [_module(module, pair, targets) for module, pair in sorted(factors.items())]


def _module(module: str, pair: dict[str, torch.Tensor], targets: Any) -> AdapterModule:
    if set(pair) != {"lora_A", "lora_B"}:
        raise MegarefitError(f"adapter module {module!r} has {sorted(pair)} only: lora_A and lora_B are both needed")
    a, b = pair["lora_A"], pair["lora_B"]
    if a.shape[0] != b.shape[1]:
        raise MegarefitError(f"adapter module {module!r}: lora_A {tuple(a.shape)} [r, in] and lora_B "
                             f"{tuple(b.shape)} [out, r] disagree on r")
    if isinstance(targets, (list, tuple, set)) and module.rsplit(".", 1)[-1] not in targets:
        raise MegarefitError(f"adapter module {module!r} is not among peft_config target_modules {sorted(targets)}")
    return AdapterModule(module, int(a.shape[0]), int(a.shape[1]), int(b.shape[0]))


def plain_peft_config(peft_config: Mapping[str, Any]) -> dict[str, Any]:
    """``peft_config`` with plain values, as ``collective_rpc`` can carry them: sets (PEFT's
    ``LoraConfig.target_modules``) as sorted lists, enums (``peft_type``, ``task_type``) as their values.
    ``LoraConfig(...).to_dict()`` may be passed as it is."""
    def plain(value: Any) -> Any:
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        return value.value if isinstance(value, enum.Enum) else value

    return {str(k): plain(v) for k, v in peft_config.items()}


def lora_scaling(peft_config: Mapping[str, Any]) -> float:
    """What the adapter multiplies ``B @ A`` by: ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``)."""
    r, alpha = peft_config["r"], peft_config["lora_alpha"]
    return alpha / math.sqrt(r) if peft_config.get("use_rslora") else alpha / r


def adapter_id(name: str) -> int:
    """The integer id an adapter name is installed under (vLLM keys adapters by int ids > 0):
    the same in every process, so a server and a trainer agree on it without a registry."""
    return zlib.crc32(name.encode()) % (2**31 - 2) + 1


def lora_path(name: str, version: int) -> str:
    """The ``lora_path`` of version ``version`` of adapter ``name``: nothing is read from it (the
    adapter is pinned in the workers); vLLM's prefix cache hashes it, so versions never share
    KV blocks. Should a worker have lost the adapter, vLLM fails loudly looking for it there."""
    return f"{PATH_ROOT}/{name}/v{version}"


def lora_request(name: str, version: int, int_id: int | None = None) -> Any:
    """A ``vllm.lora.request.LoRARequest`` for version ``version`` of installed adapter ``name``.

    Raises:
        VllmVersionError: vLLM has no ``LoRARequest`` there."""
    api = vllm_api(LORA_API, _WHY)
    return api.LoRARequest(lora_name=name, lora_int_id=int_id or adapter_id(name), lora_path=lora_path(name, version))


def lora_internals(runner: Any) -> SimpleNamespace:
    """Every vLLM internal the install touches, read from the worker's model runner and checked
    before anything changes.

    Raises:
        MegarefitError: the engine runs without LoRA (``enable_lora=True`` is needed) or with
            pipeline parallelism.
        VllmVersionError: a module, class or attribute of :data:`LORA_API` / :data:`LORA_ATTRS`
            is absent, naming vLLM's version."""
    api = vllm_api(LORA_API, _WHY)
    for owner in ("LoRAModel", "PEFTHelper"):
        for attr in LORA_ATTRS[owner]:
            vllm_internal(getattr(api, owner), attr, _WHY, owner)
    runner_kind = type(runner).__name__
    if vllm_internal(runner, "lora_config", _WHY, runner_kind) is None:
        raise MegarefitError("this vLLM engine runs without LoRA: start it with enable_lora=True (and "
                             "max_lora_rank >= the adapter's r) to install adapters")
    parallel = vllm_internal(runner, "parallel_config", _WHY, runner_kind)
    pp = vllm_internal(parallel, "pipeline_parallel_size", _WHY, "ParallelConfig")
    if pp != 1:
        raise MegarefitError(f"pipeline_parallel_size={pp}: in-memory LoRA installs are proved without pipeline "
                             "parallelism only (each stage serves part of the layers)")
    return manager_internals(vllm_internal(runner, "lora_manager", _WHY, runner_kind), api)


def manager_internals(worker_manager: Any, api: SimpleNamespace | None = None) -> SimpleNamespace:
    """The vLLM internals of one worker's LoRA manager (``LRUCacheWorkerLoRAManager``), checked.

    Raises:
        VllmVersionError: an attribute of :data:`LORA_ATTRS` is absent, naming vLLM's version."""
    api = api or vllm_api(LORA_API, _WHY)
    for attr in LORA_ATTRS["LRUCacheWorkerLoRAManager"]:
        vllm_internal(worker_manager, attr, _WHY, type(worker_manager).__name__)
    manager = worker_manager._adapter_manager
    for attr in LORA_ATTRS["LRUCacheLoRAModelManager"]:
        vllm_internal(manager, attr, _WHY, type(manager).__name__)
    return SimpleNamespace(api=api, worker_manager=worker_manager, manager=manager)


def served_modules(manager: Any) -> frozenset[str]:
    """Module names this worker's vLLM LoRA layers apply adapter factors to: every wrapped layer
    (``qkv_proj``, ``o_proj`` ...) and the parts a packed layer stacks (``q_proj``, ``k_proj``,
    ``v_proj`` of ``qkv_proj``)."""
    return frozenset(manager.modules) | frozenset(part for parts in manager.packed_modules.values() for part in parts)


def build_lora_model(internals: SimpleNamespace, name: str, int_id: int, tensors: Mapping[str, torch.Tensor],
                     peft_config: Mapping[str, Any]) -> Any:
    """vLLM's ``LoRAModel`` of the adapter, as ``_load_adapter`` builds it from disk (vLLM's
    adapter checks, its name parsing and renames, CPU tensors in the engine's LoRA dtype).

    Raises:
        MegarefitError: vLLM's checks refuse the config (rank above ``max_lora_rank`` ...), or a
            module is served by no vLLM LoRA layer of this worker (named)."""
    api, worker_manager, manager = internals.api, internals.worker_manager, internals.manager
    helper = api.PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings":
                                       worker_manager.max_position_embeddings})
    try:
        helper.validate_legal(worker_manager.lora_config)
    except ValueError as exc:
        raise MegarefitError(f"LoRA adapter {name!r} refused by vLLM's checks: {exc}") from exc
    model = manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)  # optional in vLLM too (_load_adapter reads it so)
    dtype = worker_manager.lora_config.lora_dtype
    # copies: vLLM folds the scaling into lora_B in place (LoRALayerWeights.optimize), which on
    # the caller's own tensors (an in-process engine) would rescale the trainer's adapter
    owned = {k: t.detach().to("cpu", dtype, copy=True) for k, t in tensors.items()}
    lora = api.LoRAModel.from_lora_tensors(
        lora_model_id=int_id, tensors=owned, peft_helper=helper, device="cpu",
        dtype=dtype, model_vocab_size=worker_manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    unserved = sorted(set(vllm_internal(lora, "loras", _WHY, "LoRAModel")) - served_modules(manager))
    if unserved:
        leaves = sorted({m.rsplit(".", 1)[-1] for m in served_modules(manager)})
        raise MegarefitError(f"LoRA adapter {name!r} adapts modules vLLM's LoRA layers do not serve in "
                             f"{type(model).__name__}: {unserved[:8]}{' ...' if len(unserved) > 8 else ''} "
                             f"({len(unserved)} modules); served module kinds: {leaves}")
    return lora


def swap_adapter(manager: Any, lora: Any) -> None:
    """Replace whatever the adapter manager holds under ``lora.id`` by ``lora``, pinned in its CPU
    cache (never evicted from it, so never looked up on disk). The LoRA slots (``max_loras``) stay
    vLLM's LRU: the next step that asks for the adapter copies it into a slot from that cache.
    Where the CPU cache (``max_cpu_loras``) is full, the least recently used unpinned adapter goes,
    as in vLLM's own add.

    Raises:
        MegarefitError: the CPU cache is full of pinned adapters (nothing changed)."""
    manager.remove_adapter(lora.id)  # deactivates it too: its slot is free for the new version
    if len(manager.list_adapters()) + 1 > manager.capacity:
        try:
            manager.remove_oldest_adapter()
        except RuntimeError as exc:  # vLLM's LRUCache: "All items are pinned, ..."
            raise MegarefitError(f"LoRA adapter id {lora.id}: vLLM's CPU LoRA cache holds max_cpu_loras="
                                 f"{manager.capacity} pinned adapters ({exc}); start the engine with max_cpu_loras "
                                 "at least the number of in-memory adapter names (plus those loaded from paths)"
                                 ) from exc
    manager.add_adapter(lora)
    manager._pin_lora_in_cpu_cache(lora.id)


def install_adapter(runner: Any, name: str, tensors: Mapping[str, torch.Tensor], peft_config: Mapping[str, Any],
                    int_id: int | None = None) -> dict[str, Any]:
    """Install ``tensors`` (PEFT names) as adapter ``name`` into this worker's vLLM model runner,
    replacing the version it held. Everything is checked (:func:`check_adapter`,
    :func:`lora_internals`, :func:`build_lora_model`) before the previous version is taken out:
    a refused install leaves it serving. (Should vLLM's own ``add_adapter`` fail after that, no
    version is left under the name, and its requests fail loudly, naming the path.)

    Returns:
        ``{"name", "lora_int_id", "modules", "tensors", "bytes"}``.

    Raises:
        MegarefitError, VllmVersionError: see the checks."""
    modules = check_adapter(tensors, peft_config)
    internals = lora_internals(runner)
    int_id = int_id or adapter_id(name)
    lora = build_lora_model(internals, name, int_id, tensors, peft_config)
    swap_adapter(internals.manager, lora)
    return {"name": name, "lora_int_id": int_id, "modules": len(modules), "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def adapter_blob(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The adapter's tensors as one safetensors blob (the bytes PEFT writes to
    ``adapter_model.safetensors``, kept in memory): what ``collective_rpc`` carries to the
    workers. vLLM's multiprocess RPC decodes tensors nested in untyped arguments as lists; bytes
    arrive as sent, in the engine's process and in worker processes alike."""
    from safetensors.torch import save

    return save({k: t.detach().cpu().contiguous() for k, t in tensors.items()})


def tensors_of_blob(blob: bytes) -> dict[str, torch.Tensor]:
    """The tensors of an :func:`adapter_blob` (fresh CPU tensors: the caller's are never aliased).

    Raises:
        MegarefitError: ``blob`` is not bytes (an RPC layer that re-encoded it)."""
    from safetensors.torch import load

    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise MegarefitError(f"the adapter reached the worker as {type(blob).__name__}, not the safetensors bytes "
                             "install_lora sends")
    return load(bytes(blob))


# ---- adapters pulled inside vLLM's own add_lora (``/v1/load_lora_adapter`` with a megarefit path) ------------
@dataclass
class LoraPulls:
    """Where this worker process pulls adapters from when vLLM loads a megarefit path
    (``/megarefit-in-memory-lora/<name>/v<version>``): the job's rendezvous, its secret (``None``:
    ``$MEGAREFIT_JOB_SECRET``) and the base version the engine holds (a full refit's, -1 for its checkpoint)."""

    host: str
    port: int
    job: str = "default"
    timeout: float = 60.0
    verify_checksums: bool = False
    secret: str | None = None
    base_version: int = -1

    def receiver(self, name: str) -> LoraReceiver:
        """The receiver of adapter ``name`` (:func:`lora_receiver`), on this engine's base version."""
        receiver = lora_receiver(name, self.host, self.port, self.job, self.timeout, self.verify_checksums,
                                 self.secret)
        receiver.base_version = self.base_version
        return receiver


_PULLS: dict[str, LoraPulls] = {}  # this process's ("pulls": the last init's)
_RECEIVERS: dict[tuple[str, str, int, str], LoraReceiver] = {}  # this process's, per adapter and store


def lora_receiver(name: str, host: str, port: int, job: str, timeout: float = 60.0, verify_checksums: bool = False,
                  secret: str | None = None) -> LoraReceiver:
    """This process's receiver of adapter ``name`` from job ``job``'s store (channel ``lora/<name>``), built once
    and kept warm: one registered receiver per worker and adapter, whichever path pulls (trainers waiting in
    ``wait_receivers`` wait for it). ``timeout``: the last call's; ``verify_checksums``: the first's."""
    key = (name, host, int(port), job)
    if key not in _RECEIVERS:
        channel = Rendezvous.connect(host, int(port), job=job, timeout=timeout, secret=secret).channel(f"lora/{name}")
        rid = f"megarefit-lora-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        _RECEIVERS[key] = LoraReceiver(channel, name=rid, timeout=timeout, verify_checksums=verify_checksums)
    receiver = _RECEIVERS[key]
    receiver.timeout = timeout
    return receiver


def enable_lora_pulls(pulls: LoraPulls) -> None:
    """From now on, when vLLM in this process loads an adapter whose ``lora_path`` is
    :func:`lora_path` ``(name, version)`` (``/v1/load_lora_adapter``, ``add_lora``, a request that names it),
    the worker pulls version ``version`` of adapter ``name`` from the trainers' LoraPublishers
    (:class:`~megarefit.online.receiver.lora_receiver.LoraReceiver`), builds vLLM's ``LoRAModel`` of it
    (:func:`build_lora_model`) and acknowledges it, instead of reading the path. Every other path loads as
    vLLM does. megarefit replaces ``LRUCacheWorkerLoRAManager._load_adapter`` for that (once per process).

    Raises:
        VllmVersionError: the vLLM internals this needs are absent (named, with vLLM's version)."""
    api = vllm_api(LORA_API, _WHY)
    cls = api.LRUCacheWorkerLoRAManager
    original = vllm_internal(cls, "_load_adapter", _WHY, "LRUCacheWorkerLoRAManager")
    if not getattr(original, "megarefit_hook", False):
        def _load_adapter(self: Any, lora_request: Any) -> Any:
            return pull_or_load(self, lora_request, original)

        _load_adapter.megarefit_hook = True  # type: ignore[attr-defined]
        cls._load_adapter = _load_adapter
    _PULLS["pulls"] = pulls


def set_lora_base_version(version: int) -> None:
    """The engine holds base version ``version`` now (a full refit completed): adapters pulled from here on
    must train on it (no-op where pulls are not enabled)."""
    if "pulls" in _PULLS:
        _PULLS["pulls"].base_version = int(version)


def parse_lora_path(path: str) -> tuple[str, int] | None:
    """``(name, version)`` of a :func:`lora_path`, or ``None`` for any other path."""
    m = re.fullmatch(re.escape(PATH_ROOT) + r"/(?P<name>[^/]+)/v(?P<version>0|[1-9][0-9]*)", path or "")
    return None if m is None else (m["name"], int(m["version"]))


def pull_or_load(worker_manager: Any, lora_request: Any, original: Any) -> Any:
    """vLLM's ``_load_adapter`` for a megarefit path: pull, check, build, acknowledge; else ``original``.

    Raises:
        MegarefitError: a megarefit path whose name is not the request's, or one this worker pulls none for
            (no ``enable_lora_pulls``); and what the pull and :func:`build_lora_model` raise (vLLM's add then
            fails, and the version it held keeps serving)."""
    parsed = parse_lora_path(lora_request.lora_path)
    if parsed is None:
        return original(worker_manager, lora_request)
    name, version = parsed
    if name != lora_request.lora_name:
        raise MegarefitError(f"lora_path {lora_request.lora_path!r} names adapter {name!r}, the request "
                             f"{lora_request.lora_name!r}: give lora_path(name, version) of the same name")
    pulls = _PULLS.get("pulls")
    if pulls is None:
        raise MegarefitError(f"{lora_request.lora_path!r} is a megarefit in-memory adapter, and this worker pulls no "
                             "adapters: init the megarefit engine with lora=True (or megarefit_init_lora) first")
    receiver = pulls.receiver(name)
    pulled = receiver.pull_adapter(version)
    check_adapter(pulled.tensors, pulled.peft_config)
    lora = build_lora_model(manager_internals(worker_manager), name, lora_request.lora_int_id, pulled.tensors,
                            pulled.peft_config)
    receiver.acknowledge(pulled.version)
    return lora


class MegarefitLoraExtension:
    """vLLM worker-extension methods for in-memory LoRA adapters (``self`` is the worker);
    :class:`~megarefit.integrations.vllm.MegarefitWorkerExtension` includes them."""

    def megarefit_install_lora(self, name: str, adapter: bytes, peft_config: dict[str, Any], version: int,
                               lora_int_id: int | None = None) -> dict[str, Any]:
        """Install version ``version`` of adapter ``name`` in this worker (:func:`install_adapter`);
        ``adapter``: its tensors as one safetensors blob (:func:`adapter_blob`). The report adds
        ``version`` and this worker's ``rank``."""
        tensors = tensors_of_blob(adapter)
        runner = self.model_runner  # type: ignore[attr-defined]
        report = install_adapter(runner, name, tensors, peft_config, lora_int_id)
        versions = self.__dict__.setdefault("_megarefit_lora_versions", {})
        versions[name] = version
        return {**report, "version": version, "rank": getattr(self, "rank", 0)}

    def megarefit_refit_lora(self, name: str, host: str, port: int, job: str = "default", version: int | None = None,
                             base_version: int = -1, timeout: float = 60.0, verify_checksums: bool = False,
                             lora_int_id: int | None = None) -> dict[str, Any]:
        """Pull adapter ``name`` (``version``, default the trainers' current one) from the trainers'
        :class:`~megarefit.online.trainer.lora_publisher.LoraPublisher` s on channel ``lora/<name>`` of ``job``,
        install it (:func:`install_adapter`) and acknowledge it. The job secret comes from
        ``$MEGAREFIT_JOB_SECRET``. The worker keeps one :class:`~megarefit.online.receiver.lora_receiver.LoraReceiver`
        per adapter and store (its plan and NIXL connections stay warm). The report adds the ``version``, the
        cycle's ``seconds`` and ``bytes_moved``, and this worker's ``rank``.

        Raises:
            BaseChangedError: the adapter trains on another base than ``base_version``; and what
                :meth:`LoraReceiver.pull_adapter` and :func:`install_adapter` raise (nothing is installed then)."""
        rank = getattr(self, "rank", 0)
        receiver = lora_receiver(name, host, port, job, timeout, verify_checksums)
        receiver.base_version = base_version
        pulled = receiver.pull_adapter(version)
        runner = self.model_runner  # type: ignore[attr-defined]
        report = install_adapter(runner, name, pulled.tensors, pulled.peft_config, lora_int_id)
        receiver.acknowledge(pulled.version)
        self.__dict__.setdefault("_megarefit_lora_versions", {})[name] = pulled.version
        stats = receiver.stats
        return {**report, "version": pulled.version, "rank": rank, "bytes_moved": stats.bytes_moved if stats else 0,
                "seconds": dict(stats.seconds) if stats else {}}

    def megarefit_init_lora(self, host: str, port: int, job: str = "default", timeout: float = 60.0,
                            verify_checksums: bool = False, base_version: int = -1) -> None:
        """Pull adapters named by a megarefit ``lora_path`` from this job's trainers (:func:`enable_lora_pulls`);
        the megarefit engine's ``init_info`` ``lora=True`` does the same over HTTP."""
        enable_lora_pulls(LoraPulls(host, int(port), job, timeout, verify_checksums, base_version=base_version))

    def megarefit_lora_versions(self) -> dict[str, int]:
        """``{adapter name: version}`` installed in this worker."""
        return dict(self.__dict__.get("_megarefit_lora_versions", {}))

    def megarefit_remove_lora(self, name: str, lora_int_id: int | None = None) -> bool:
        """Take adapter ``name`` (id ``lora_int_id``, default :func:`adapter_id`) out of this worker's
        LoRA manager; a request that names it later fails loudly (its path is no adapter on disk) or,
        with :func:`enable_lora_pulls`, pulls the version its path names. Returns whether it was there."""
        manager = lora_internals(self.model_runner).manager  # type: ignore[attr-defined]
        self.__dict__.setdefault("_megarefit_lora_versions", {}).pop(name, None)
        return bool(manager.remove_adapter(lora_int_id or adapter_id(name)))


def install_lora(llm: Any, name: str, tensors: Mapping[str, torch.Tensor], peft_config: Mapping[str, Any],
                 version: int, lora_int_id: int | None = None) -> Any:
    """Install version ``version`` of adapter ``name`` into every worker of ``llm`` (a ``vllm.LLM``
    started with ``enable_lora=True`` and ``worker_extension_cls`` including
    :class:`MegarefitLoraExtension`), in memory, replacing the previous version without a restart.

    Returns:
        The ``LoRARequest`` to pass to ``llm.generate(..., lora_request=...)`` for this version.

    Raises:
        MegarefitError: a refusal (see :func:`install_adapter`); the workers disagree on what they installed
            (then, as where a worker fails while others installed, the adapter is taken out of every worker:
            :func:`never_a_mix`).
        VllmVersionError: a vLLM internal is absent (:func:`lora_internals`)."""
    peft_config = plain_peft_config(peft_config)
    check_adapter(tensors, peft_config)  # refused here, before any worker is called
    int_id = lora_int_id or adapter_id(name)
    try:
        reports = llm.collective_rpc("megarefit_install_lora", kwargs={
            "name": name, "adapter": adapter_blob(tensors), "peft_config": peft_config, "version": version,
            "lora_int_id": int_id})
    except Exception as exc:
        _no_mix_after(llm, name, int_id, exc)
        raise
    seen = {(r["name"], r["lora_int_id"], r["version"], r["modules"]) for r in reports}
    if len(seen) != 1:
        never_a_mix(llm, name, int_id, always=True)
        raise MegarefitError(f"LoRA adapter {name!r} version {version}: the workers report {sorted(seen)}; it was "
                             "taken out of every worker, so none serves a mix: install it again")
    return lora_request(name, version, int_id)


def refit_lora(llm: Any, name: str, host: str, port: int, *, job: str = "default", version: int | None = None,
               base_version: int = -1, timeout: float = 60.0, verify_checksums: bool = False,
               lora_int_id: int | None = None) -> Any:
    """An adapter-only refit: every worker of ``llm`` pulls adapter ``name`` from the trainers over megarefit's
    transport (:meth:`MegarefitLoraExtension.megarefit_refit_lora`) and installs it, in memory, under one LoRA
    name. ``version`` ``None``: the trainers' current one; should the workers land on different versions (the
    trainers published in between), all of them pull the newest again, so the engine never serves a mix.
    Should that fail too, or a worker fail while others installed (a checksum, a trainer gone), the adapter is
    taken out of every worker (:func:`never_a_mix`) and the error says so: requests naming it then fail
    loudly instead of running a mix of versions. A failure on every worker alike (a refusal before any
    install) leaves the installed version serving.

    Returns:
        The ``LoRARequest`` to generate with (:func:`lora_request` of the version installed).

    Raises:
        BaseChangedError: the adapter trains on another base than ``base_version`` (refit the base first).
        MegarefitError: the workers still disagree on what they installed; and what the workers raise."""
    int_id = lora_int_id or adapter_id(name)
    kwargs = {"name": name, "host": host, "port": int(port), "job": job, "base_version": base_version,
              "timeout": timeout, "verify_checksums": verify_checksums, "lora_int_id": int_id}
    try:
        reports = llm.collective_rpc("megarefit_refit_lora", kwargs={**kwargs, "version": version})
        if len({r["version"] for r in reports}) > 1:
            reports = llm.collective_rpc("megarefit_refit_lora", kwargs={**kwargs,
                                                                         "version": max(r["version"] for r in reports)})
    except Exception as exc:
        _no_mix_after(llm, name, int_id, exc)
        raise
    seen = {(r["name"], r["lora_int_id"], r["version"], r["modules"]) for r in reports}
    if len(seen) != 1:
        never_a_mix(llm, name, int_id, always=True)
        raise MegarefitError(f"LoRA adapter {name!r}: the workers report {sorted(seen)}; it was taken out of "
                             "every worker, so none serves a mix: refit it again")
    (_, _, installed, _), = seen
    return lora_request(name, installed, int_id)


def _no_mix_after(llm: Any, name: str, int_id: int, exc: Exception) -> None:
    """After ``exc`` in a refit pass: :func:`never_a_mix`, its outcome noted on ``exc``."""
    try:
        removed = never_a_mix(llm, name, int_id)
    except Exception as again:  # noqa: BLE001 - the engine itself failing: say so, the first error raised
        exc.add_note(f"megarefit: could not check which versions of LoRA adapter {name!r} the workers hold "
                     f"({again!r}); they may hold a mix: refit it again or restart the engine")
        return
    if removed:
        exc.add_note(f"megarefit: the workers were left holding versions {removed} of LoRA adapter {name!r}; it "
                     "was taken out of every worker, so none serves a mix: refit it again")


def never_a_mix(llm: Any, name: str, int_id: int, always: bool = False) -> list[int | None]:
    """Where the workers of ``llm`` hold different versions of adapter ``name`` (or ``always``), take it
    out of every one (:meth:`MegarefitLoraExtension.megarefit_remove_lora`). Returns the versions they
    held, sorted (``None``: none), where it was taken out; ``[]`` where they agree."""
    held = {v.get(name) for v in llm.collective_rpc("megarefit_lora_versions")}
    if len(held) < 2 and not always:
        return []
    llm.collective_rpc("megarefit_remove_lora", kwargs={"name": name, "lora_int_id": int_id})
    return sorted(held, key=lambda v: -1 if v is None else v)


__all__ = ["LORA_API", "LORA_ATTRS", "AdapterModule", "LoraPulls", "MegarefitLoraExtension", "adapter_blob",
           "adapter_id", "check_adapter", "enable_lora_pulls", "install_adapter", "install_lora", "lora_internals",
           "lora_path", "lora_receiver", "lora_request", "lora_scaling", "manager_internals", "never_a_mix",
           "parse_lora_path", "plain_peft_config", "pull_or_load", "refit_lora", "served_modules",
           "set_lora_base_version", "tensors_of_blob"]
