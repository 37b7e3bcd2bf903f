"""verl integration: a ``megarefit`` checkpoint-engine backend and the manager that feeds it.

verl (0.9.1) syncs weights through a ``CheckpointEngine`` picked by name from its registry
(``verl/checkpoint_engine/base.py``). Its ``CheckpointEngineManager`` drives, per sync::

    driver (manager)                 trainer ranks (actor worker group)     rollout ranks (CheckpointEngineWorker)
    prepare() on every rank  ------> prepare(): rank 0 serves the           prepare()
                                     Rendezvous, returns its address
    build_topology(metadata)         (classmethod, in the driver)
    init_process_group(**kw) ------> connect to the Rendezvous              connect; a RefitReceiver (once)
    update_weights(step)     ------> send_weights(): publish(step),  <----  receive_weights(step): pull step
                                     wait_receivers(step)                   (NIXL / CUDA IPC), yield HF tensors
                                                                            to verl's server adapter; acknowledge
    finalize()               ------> nothing: buffers, NIXL registrations and plans stay for the next sync

Configure verl with::

    actor_rollout_ref.rollout.checkpoint_engine.backend=megarefit
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=megarefit.integrations.verl
    actor_rollout_ref.rollout.checkpoint_manager_class=megarefit.integrations.verl.MegarefitCheckpointManager

verl hands a backend's ``send_weights`` the generator of Megatron-Bridge's gathered HF tensors
(``export_hf_weights``); megarefit never iterates it (no gather: it is closed unconsumed) and
serves each trainer rank's own shards instead. The shards come from the Megatron model, which
verl gives only to its ``delta_sharded`` backend. :class:`MegarefitCheckpointManager` hands it
over without a fork: before the first sync it runs :func:`attach_megatron` inside every actor
worker (Ray's ``__ray_call__``, a ``DeveloperAPI`` of Ray 2.60), which finds the worker's
megarefit engine and its Megatron model at ``worker.actor.engine.module`` (verl's
``TrainingWorker`` -> ``MegatronEngine``). ``send_weights`` also accepts the training engine
itself (an object with ``.module`` and ``.model_config.hf_config``): the upstream change in
docs/verl.md hands it over as verl does for ``delta_sharded``, and then no manager is needed.

Importing this module needs verl (and Ray): without it, :class:`~megarefit.errors.DependencyError`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

from megarefit.errors import DependencyError, MegarefitError

try:
    import ray
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineManager, CheckpointEngineRegistry
    from verl.utils.ray_utils import auto_await
except ImportError as exc:  # pragma: no cover - the shared environment has no verl
    raise DependencyError(
        f"megarefit.integrations.verl needs verl (tested: 0.9.1) and ray: {exc}. Install them in the trainer's "
        "and the rollout's environment (pip install verl==0.9.1; docs/verl.md lists what its checkpoint-engine "
        "code imports)") from exc

from megarefit.online import Publisher, RefitReceiver, Rendezvous
from megarefit.online.store.records import SECRET_ENV

__all__ = ["BACKEND", "MegarefitCheckpointEngine", "MegarefitCheckpointManager", "attach_megatron",
           "offload_megatron"]

log = logging.getLogger(__name__)

BACKEND = "megarefit"
TESTED_VERL = "0.9.1"


def _version(global_steps: int | None, last: int | None) -> int:
    """The megarefit version of a sync: verl's ``global_steps``, else one past the last."""
    if global_steps is not None:
        return int(global_steps)
    return 0 if last is None else last + 1


@CheckpointEngineRegistry.register(BACKEND)
class MegarefitCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine over megarefit: trainer ranks publish, rollout ranks pull.

    verl builds one per process: on every trainer rank with ``is_master`` (global rank 0) and
    ``bucket_size``, on every rollout rank with ``bucket_size`` (unused: megarefit pulls each
    tensor whole into buffers kept across syncs). Options come from
    ``checkpoint_engine.engine_kwargs.megarefit``:

    * ``host`` (trainer rank 0): the address the Rendezvous binds, default this node's IP as Ray
      sees it (never 0.0.0.0 unless given); ``port`` (default 0: a free one); ``job``.
    * ``timeout``: seconds a rollout rank waits for a version and trainers wait for receivers.
    * ``device`` (rollout ranks): where pulled tensors land, default ``cuda`` where available.
    * ``publisher`` (dict): passed to ``Publisher.from_megatron`` (``snapshot``, ``checksums``...).
    * ``pull`` (standalone mode): ``checkpoint_worker`` (default: verl's ``CheckpointEngineWorker``
      pulls full HF tensors) or ``vllm`` (the vLLM workers pull; hybrid mode always does).
    * ``vllm`` (dict): where the vLLM workers pull, more ``init_info`` of their megarefit
      ``WeightTransferEngine`` (``sharded``, ``memory_budget``, ``transport``...), which
      :class:`MegarefitCheckpointManager` sends.

    The job secret: ``$MEGAREFIT_JOB_SECRET`` where set in every process, else trainer rank 0
    draws one and it travels with the Rendezvous address through verl's actor calls
    (``prepare`` -> ``build_topology`` -> ``init_process_group``), never through ``runtime_env``.

    ``consumes_engine``: the flag of the upstream change in docs/verl.md (verl then hands
    ``send_weights`` the training engine); verl 0.9.1 does not read it.
    """

    consumes_engine = True

    def __init__(self, bucket_size: int, is_master: bool = False, host: str | None = None, port: int = 0,
                 job: str = "verl", timeout: float = 300.0, device: str | None = None,
                 publisher: dict[str, Any] | None = None, vllm: dict[str, Any] | None = None,
                 pull: str = "checkpoint_worker") -> None:
        self.bucket_size, self.is_master = bucket_size, is_master
        self.vllm_options = dict(vllm or {})  # read by the manager (hybrid): init_info of vLLM's megarefit engine
        self.host, self.port, self.job, self.timeout = host, int(port), job, float(timeout)
        self.device = device
        self.publisher_options = dict(publisher or {})
        self.rendezvous: Rendezvous | None = None
        self._served: Rendezvous | None = None  # trainer rank 0's store, served for the job's life
        self._address: tuple[str, int] | None = None
        self.publisher: Any = None
        self.receiver: RefitReceiver | None = None
        self.model: Any = None
        self.hf_config: Any = None
        self.version: int | None = None
        self.offload = False  # verl's param_offload: parameters come back at new addresses each sync
        self._drawn = False  # the job secret was drawn here (none in the environment)

    # -- topology (verl calls these on every sync; megarefit sets up once) ------------------------
    def prepare(self) -> dict[str, Any] | None:
        """Trainer rank 0: serve the Rendezvous (first call) and return ``{host, port, job, secret}``.
        Every other rank: ``None``."""
        if not self.is_master:
            return None
        if self._served is None:
            bind = self.host or ray.util.get_node_ip_address()
            self._drawn = not os.environ.get(SECRET_ENV)  # drawn here: it travels through verl's calls
            secret = os.environ.get(SECRET_ENV) or secrets.token_hex(32)
            self._served = Rendezvous.serve(bind, self.port, job=self.job, secret=secret, timeout=self.timeout)
            # a wildcard bind is advertised as the node's address: clients elsewhere cannot reach 0.0.0.0
            self.host = ray.util.get_node_ip_address() if bind in ("0.0.0.0", "::", "") else bind
        info = {"host": self.host, "port": self._served.port, "job": self.job}
        return {**info, "secret": self._served.secret} if self._drawn else info

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict | None]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Every rank gets trainer rank 0's Rendezvous (``metadata[0]``); rollout ranks also their rank.

        Raises:
            MegarefitError: ``metadata[0]`` is not a megarefit trainer rank 0's (verl lists the actor
                worker group first; its global rank 0 has ``is_master``)."""
        master = metadata[0] if metadata else None
        if not isinstance(master, dict) or "port" not in master:
            raise MegarefitError(f"megarefit checkpoint engine: the first prepare() result is {master!r}, expected "
                                 "trainer rank 0's Rendezvous address; is the actor worker group built with "
                                 "checkpoint_engine.backend=megarefit on every rank?")
        return ({"rendezvous": [master] * actor_wg_world_size},
                {"rendezvous": [master] * rollout_world_size, "rank": list(range(rollout_world_size))})

    def init_process_group(self, rendezvous: dict[str, Any], rank: int | None = None) -> None:
        """Join the job's Rendezvous (once per address); a rollout rank (``rank`` given) also builds
        its :class:`RefitReceiver`, which registers with the trainers and is kept across syncs."""
        address = (rendezvous["host"], int(rendezvous["port"]))
        if self._address != address:
            self.rendezvous = (self._served if self._served is not None else
                               Rendezvous.connect(*address, job=rendezvous["job"], secret=rendezvous.get("secret"),
                                                  timeout=self.timeout))
            self._address, self.publisher, self.receiver = address, None, None
        if rank is not None and self.receiver is None:
            device = self.device or ("cuda" if _cuda() else "cpu")
            self.receiver = RefitReceiver(self.rendezvous, name=f"verl-rollout-{rank}-{uuid.uuid4().hex[:8]}",
                                          timeout=self.timeout, device=device, part="model")

    def finalize(self) -> None:
        """Nothing: the Publisher's registrations, the receiver's buffers and plans stay warm."""

    # -- trainer side ------------------------------------------------------------------------------
    def attach(self, model: Any, hf_config: Any, offload: bool = False) -> None:
        """The rank's Megatron-Core model (chunk list or module) and its HF config, served from the
        next sync on. ``offload``: verl moves the parameters between syncs (Megatron
        ``param_offload``): every sync then declares the move before it publishes."""
        self.model, self.hf_config, self.publisher = model, hf_config, None
        self.offload = bool(offload)

    def _publisher(self) -> Any:
        if self.publisher is None:
            if self.rendezvous is None:
                raise MegarefitError("megarefit checkpoint engine: send_weights before init_process_group "
                                     "(verl's CheckpointEngineManager.build_process_group runs it)")
            self.publisher = Publisher.from_megatron(self.model, self.hf_config, rendezvous=self.rendezvous,
                                                     **self.publisher_options)
        return self.publisher

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Publish this rank's shards as version ``global_steps`` and wait until every registered
        rollout rank acknowledged it. ``weights``: verl's HF-tensor generator (closed unread; the
        model must be attached, :class:`MegarefitCheckpointManager`) or verl's training engine
        (``.module``, ``.model_config.hf_config``; the upstream change of docs/verl.md).

        Returns ``{"megarefit/publish_s", "megarefit/wait_s"}`` (seconds), merged into verl's metrics,
        and ``"megarefit/moved"`` (1.0 where this sync declared a move) with ``param_offload``.

        Raises:
            MegarefitError: no model (name the manager to set); what ``Publisher.publish`` raises
                (parameters moved: verl's Megatron ``param_offload``, see docs/verl.md).
            RendezvousTimeout: a rollout rank did not acknowledge within ``timeout``."""
        if hasattr(weights, "module") and hasattr(weights, "model_config"):
            if self.model is not weights.module:
                self.attach(weights.module, weights.model_config.hf_config, _offloads(weights))
        else:
            _close(weights)
        if self.model is None:
            raise MegarefitError(
                "megarefit checkpoint engine: no Megatron model on this trainer rank. verl 0.9.1 hands backends "
                "only gathered HF tensors; set actor_rollout_ref.rollout.checkpoint_manager_class="
                "megarefit.integrations.verl.MegarefitCheckpointManager (it attaches the model), or apply "
                "the upstream change in docs/verl.md")
        version = _version(global_steps, self.version)
        t0 = time.perf_counter()
        moved = self.offload and self.publisher is not None
        if moved:  # verl brought the parameters back from the CPU: new pages, at new addresses or not
            self.publisher.params_moved(remapped=True)
        self._publisher().publish(version)
        t1 = time.perf_counter()
        await asyncio.to_thread(self.publisher.wait_receivers, version, timeout=self.timeout)
        self.version = version
        metrics = {"megarefit/publish_s": t1 - t0, "megarefit/wait_s": time.perf_counter() - t1}
        return {**metrics, "megarefit/moved": float(moved)} if self.offload else metrics

    # -- rollout side ------------------------------------------------------------------------------
    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, Any]]:
        """Pull version ``global_steps`` (staged: every byte pulled and version-fenced first), yield
        full HF tensors ``(hf_name, tensor)`` (views of buffers reused next sync: copy to keep), then
        acknowledge the version to the trainers once verl's adapter has taken the last one.

        Raises:
            MegarefitError: before ``init_process_group``; what ``RefitReceiver.run_refit_cycle``
                raises (StaleVersionError, VersionMismatchError, a timeout naming the ranks)."""
        if self.receiver is None:
            raise MegarefitError("megarefit checkpoint engine: receive_weights before init_process_group")
        version = _version(global_steps, self.version)
        tensors = await asyncio.to_thread(lambda: list(self.receiver.run_refit_cycle(version)))
        for item in tensors:
            yield item
        self.receiver.acknowledge(version)
        self.version = version


def _close(weights: Any) -> None:
    close = getattr(weights, "close", None)
    if callable(close):
        close()  # a generator not yet started gathers nothing


def _offloads(train: Any) -> bool:
    """Whether verl's training engine offloads its parameters between syncs (``MegatronEngine``)."""
    return bool(getattr(train, "is_param_offload_enabled", False))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _workers_of(actor: Any) -> Iterable[Any]:
    """The verl workers inside a Ray actor: itself, or those a colocated ``WorkerDict`` /
    ``FusedWorker`` holds."""
    yield actor
    for attr in ("worker_dict", "fused_worker_dict"):
        yield from (getattr(actor, attr, None) or {}).values()


def attach_megatron(actor: Any) -> int:
    """Run inside an actor worker (``handle.__ray_call__.remote(attach_megatron)``): give each
    megarefit engine there its worker's Megatron model, ``worker.actor.engine.module``, and HF
    config, ``worker.actor.engine.model_config.hf_config``. Returns how many engines were attached.

    Raises:
        MegarefitError: no worker there has a megarefit ``checkpoint_engine``, or its training
            engine has no ``module`` (not verl's Megatron engine: megarefit serves Megatron-Core only)."""
    attached = 0
    for worker in _workers_of(actor):
        engine = getattr(worker, "checkpoint_engine", None)
        if not isinstance(engine, MegarefitCheckpointEngine):
            continue
        train = getattr(getattr(worker, "actor", None), "engine", None)
        if train is None or not hasattr(train, "module"):
            raise MegarefitError(f"megarefit: {type(worker).__name__} has no actor.engine.module (verl's "
                                 f"MegatronEngine); got {type(train).__name__}. megarefit serves Megatron-Core "
                                 "trainers only (actor_rollout_ref.actor.strategy=megatron)")
        engine.attach(train.module, train.model_config.hf_config, _offloads(train))
        attached += 1
    if not attached:
        raise MegarefitError(f"megarefit: no megarefit checkpoint engine in {type(actor).__name__}; set "
                             "actor_rollout_ref.rollout.checkpoint_engine.backend=megarefit")
    return attached


class MegarefitCheckpointManager(CheckpointEngineManager):
    """verl's ``CheckpointEngineManager`` for the ``megarefit`` backend.
    ``rollout.checkpoint_manager_class=megarefit.integrations.verl.MegarefitCheckpointManager``.

    Before the first sync it hands each trainer rank's Megatron model to its megarefit engine
    (:func:`attach_megatron`, once). Then, by the replicas' ``rollout_mode``:

    * standalone: exactly verl's sync (abort, release KV cache, build topology, update, finalize,
      resume); verl's ``CheckpointEngineWorker`` pulls full HF tensors. With
      ``engine_kwargs.megarefit.pull: vllm``, the vLLM workers pull instead, each only what it
      needs (``vllm: {sharded: true}``: its own shards), in verl's order (abort, release KV cache,
      pull, resume KV cache, resume generation).
    * hybrid (trainer and vLLM share each GPU; verl's ``init_hybrid``): the vLLM workers pull, as
      :meth:`_update_in_vllm` says.

    Where the vLLM workers pull, megarefit's ``WeightTransferEngine`` runs in each replica's vLLM
    workers, driven through the replica's server ``collective_rpc`` (verl's own path to its vLLM
    workers). vLLM needs ``engine_kwargs.vllm.weight_transfer_config: {backend: megarefit}``
    (vLLM >= 0.32).

    Raises (``update_weights``): MegarefitError: ``checkpoint_engine.backend`` is not ``megarefit``;
    hybrid and other replicas mixed; a replica's vLLM call failed (names the replica and call)."""

    def __init__(self, config: Any, actor_wg: Any, replicas: list[Any]) -> None:
        super().__init__(config, actor_wg, replicas)
        self._attached = False
        self._joined: dict[int, dict[str, Any]] = {}  # id(replica) -> the init_info its vLLM engine got
        self._version: int | None = None

    def attach(self) -> None:
        """Attach every actor worker's Megatron model to its megarefit engine (idempotent)."""
        if self.backend != BACKEND:
            raise MegarefitError(f"MegarefitCheckpointManager needs checkpoint_engine.backend={BACKEND!r}, "
                                 f"got {self.backend!r}")
        ray.get([w.__ray_call__.remote(attach_megatron) for w in self.actor_wg.workers])
        self._attached = True

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict:
        if not self._attached:
            await asyncio.to_thread(self.attach)
        modes = {_mode(r) for r in self.replicas}
        if HYBRID in modes and modes != {HYBRID}:
            raise MegarefitError(f"megarefit: replicas of modes {sorted(modes)} in one manager; hybrid replicas "
                                 "(trainer and vLLM on the same GPUs) and standalone ones need separate syncs")
        if modes == {HYBRID} or _pull_option(self.config) == "vllm":
            return await self._update_in_vllm(global_steps, hybrid=modes == {HYBRID})
        return await super().update_weights(global_steps=global_steps)

    async def _update_in_vllm(self, global_steps: int | None, hybrid: bool) -> dict:
        """One sync pulled by the vLLM workers. Hybrid, in verl's naive order
        (``engine_workers.update_weights``): wake vLLM's weights, pull, offload the trainers'
        parameters where ``param_offload`` is on, wake the KV cache. Standalone, in the order of
        verl's manager: abort requests, release the KV cache, pull, resume the KV cache and
        generation. The pull: every trainer rank publishes while every replica's vLLM workers
        run ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` (trainer
        ranks on their GPU through CUDA IPC, the rest over NIXL); the trainers return once every
        worker acknowledged. Returns the trainers' metrics (:meth:`MegarefitCheckpointEngine.send_weights`)."""
        await self._join_vllm()
        version = _version(global_steps, self._version)
        if hybrid:
            await self._wake(["weights"])
        else:
            await self.abort_replicas()
            await self.release_kv_cache_replicas()
        results = await self._send_and_pull(version)
        if hybrid:
            await asyncio.to_thread(ray.get, [w.__ray_call__.remote(offload_megatron) for w in self.actor_wg.workers])
            await self._wake(["kv_cache"])
        else:
            await self.resume_kv_cache_replicas()
            await self.resume_generation_replicas()
        self._version = version
        metrics: dict = {}
        for result in results:
            metrics.update(result or {})
        return metrics

    async def _send_and_pull(self, version: int) -> list:
        """Publish ``version`` on every trainer rank while every replica pulls it; the trainers' results."""
        sends = self.actor_wg.update_weights(global_steps=version, mode=BACKEND)
        pulls = [asyncio.ensure_future(self._pull(i, replica, version)) for i, replica in enumerate(self.replicas)]
        try:  # the first failure of either side ends the sync (a trainer's refused publish too)
            results = (await asyncio.gather(*pulls, *sends))[len(pulls):]
        except BaseException:
            for ref in sends:
                ray.cancel(ref)  # the trainers would wait for acknowledgements that never come
            for pull in pulls:
                pull.cancel()
            raise
        return results

    async def _join_vllm(self) -> None:
        """First sync: trainer rank 0 serves the Rendezvous, every trainer rank joins it, and each
        replica's vLLM engine gets ``init_weight_transfer_engine`` (its index among the replicas:
        reads spread over every trainer copy)."""
        if all(id(r) in self._joined for r in self.replicas):
            return
        n = self.actor_wg.world_size
        meta = await asyncio.to_thread(ray.get, self.actor_wg.execute_checkpoint_engine(["prepare"] * n))
        kwargs, _ = self.backend_cls.build_topology(n, 0, meta)
        await asyncio.to_thread(ray.get, self.actor_wg.execute_checkpoint_engine(
            method=["init_process_group"] * n, **kwargs))
        options = dict(self.config.engine_kwargs.get(BACKEND, {}) or {})
        master = meta[0]
        for i, replica in enumerate(self.replicas):
            info = {"host": master["host"], "port": master["port"], "job": master["job"],
                    "timeout": float(options.get("timeout", 300.0)), "replica": i, "replicas": len(self.replicas),
                    **({"secret": master["secret"]} if "secret" in master else {}), **dict(options.get("vllm") or {})}
            await self._rpc(i, replica, "init_weight_transfer_engine", {"init_info": info})
            self._joined[id(replica)] = info

    async def _pull(self, i: int, replica: Any, version: int) -> None:
        await self._rpc(i, replica, "start_weight_update")
        await self._rpc(i, replica, "update_weights", {"update_info": {"version": version}})
        await self._rpc(i, replica, "finish_weight_update")

    async def _rpc(self, i: int, replica: Any, method: str, kwargs: dict | None = None) -> None:
        """``method`` on every vLLM worker of replica ``i``: its first server's ``collective_rpc``
        (verl's ``vLLMHttpServer``; the node-rank-0 server holds the engine)."""
        timeout = float(dict(self.config.engine_kwargs.get(BACKEND, {}) or {}).get("timeout", 300.0))
        try:
            await replica.servers[0].collective_rpc.remote(method, timeout=timeout, kwargs=kwargs or {})
        except Exception as exc:
            first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise MegarefitError(f"megarefit hybrid sync: replica {i}'s vLLM {method} failed: {first}") from exc

    async def _wake(self, tags: list[str]) -> None:
        """verl's wake-up of vLLM memory (``tags``) on replicas that free it (``free_cache_engine``)."""
        await asyncio.gather(*[server.wake_up.remote(tags=tags) for r in self.replicas
                               if getattr(getattr(r, "config", None), "free_cache_engine", True) for server in r.servers])


HYBRID = "hybrid"


PULLS = ("checkpoint_worker", "vllm")  # engine_kwargs.megarefit.pull in standalone mode


def _pull_option(config: Any) -> str:
    """``engine_kwargs.megarefit.pull``: who pulls in standalone mode (verl's ``CheckpointEngineWorker``, default, or vLLM's workers).

    Raises:
        MegarefitError: another value."""
    pull = dict(config.engine_kwargs.get(BACKEND, {}) or {}).get("pull", PULLS[0])
    if pull not in PULLS:
        raise MegarefitError(f"checkpoint_engine.engine_kwargs.megarefit.pull={pull!r}: give one of {list(PULLS)} "
                             "(vllm: megarefit's WeightTransferEngine in the vLLM workers pulls)")
    return pull


def _mode(replica: Any) -> str:
    """A verl replica's ``rollout_mode`` (``RolloutMode``) as its value: hybrid, colocated, standalone."""
    mode = getattr(replica, "rollout_mode", None)
    return str(getattr(mode, "value", mode))


def offload_megatron(actor: Any) -> int:
    """Run inside an actor worker after a hybrid sync: offload the parameters of every training
    engine there with ``is_param_offload_enabled``, as verl's naive sync does (its
    ``engine.to("cpu", model=True, optimizer=False, grad=False)``). The next sync declares the move
    (``Publisher.params_moved``). Returns how many engines offloaded."""
    offloaded = 0
    for worker in _workers_of(actor):
        train = getattr(getattr(worker, "actor", None), "engine", None)
        if isinstance(getattr(worker, "checkpoint_engine", None), MegarefitCheckpointEngine) and _offloads(train):
            train.to("cpu", model=True, optimizer=False, grad=False)
            offloaded += 1
    if offloaded and _cuda():
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return offloaded
