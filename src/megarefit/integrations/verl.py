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

__all__ = ["BACKEND", "MegarefitCheckpointEngine", "MegarefitCheckpointManager", "attach_megatron"]

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

    The job secret: ``$MEGAREFIT_JOB_SECRET`` where set in every process, else trainer rank 0
    draws one and it travels with the Rendezvous address through verl's actor calls
    (``prepare`` -> ``build_topology`` -> ``init_process_group``), never through ``runtime_env``.

    ``consumes_engine``: the flag of the upstream change in docs/verl.md (verl then hands
    ``send_weights`` the training engine); verl 0.9.1 does not read it.
    """

    consumes_engine = True

    def __init__(self, bucket_size: int, is_master: bool = False, host: str | None = None, port: int = 0,
                 job: str = "verl", timeout: float = 300.0, device: str | None = None,
                 publisher: dict[str, Any] | None = None) -> None:
        self.bucket_size, self.is_master = bucket_size, is_master
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
    def attach(self, model: Any, hf_config: Any) -> None:
        """The rank's Megatron-Core model (chunk list or module) and its HF config, served from the next sync on."""
        self.model, self.hf_config, self.publisher = model, hf_config, None

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

        Returns ``{"megarefit/publish_s", "megarefit/wait_s"}`` (seconds), merged into verl's metrics.

        Raises:
            MegarefitError: no model (name the manager to set); what ``Publisher.publish`` raises
                (parameters moved: verl's Megatron ``param_offload``, see docs/verl.md).
            RendezvousTimeout: a rollout rank did not acknowledge within ``timeout``."""
        if hasattr(weights, "module") and hasattr(weights, "model_config"):
            if self.model is not weights.module:
                self.attach(weights.module, weights.model_config.hf_config)
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
        self._publisher().publish(version)
        t1 = time.perf_counter()
        await asyncio.to_thread(self.publisher.wait_receivers, version, timeout=self.timeout)
        self.version = version
        return {"megarefit/publish_s": t1 - t0, "megarefit/wait_s": time.perf_counter() - t1}

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
        engine.attach(train.module, train.model_config.hf_config)
        attached += 1
    if not attached:
        raise MegarefitError(f"megarefit: no megarefit checkpoint engine in {type(actor).__name__}; set "
                             "actor_rollout_ref.rollout.checkpoint_engine.backend=megarefit")
    return attached


class MegarefitCheckpointManager(CheckpointEngineManager):
    """verl's ``CheckpointEngineManager`` that first hands each trainer rank's Megatron model to its
    megarefit engine (:func:`attach_megatron`, once), then syncs exactly as verl's manager does
    (abort, release KV cache, build topology, update, finalize, resume).
    ``rollout.checkpoint_manager_class=megarefit.integrations.verl.MegarefitCheckpointManager``.

    Raises (``update_weights``): MegarefitError: ``checkpoint_engine.backend`` is not ``megarefit``."""

    def __init__(self, config: Any, actor_wg: Any, replicas: list[Any]) -> None:
        super().__init__(config, actor_wg, replicas)
        self._attached = False

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
        return await super().update_weights(global_steps=global_steps)
