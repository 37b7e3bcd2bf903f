"""vLLM's trainer-side weight-transfer engine, backend ``"megarefit"``: megarefit chosen by name.

vLLM-native RL stacks drive a ``TrainerWeightTransferEngine`` that vLLM's trainer factory picks
by the backend name of its init info; the worker side is the ``WeightTransferEngine`` that
``WeightTransferConfig(backend="megarefit")`` picks in every vLLM worker
(:mod:`megarefit.integrations.vllm`). Both are registered under the same name by
:func:`megarefit.integrations.vllm.register` (vLLM's ``vllm.general_plugins`` entry point, which
``vllm.plugins.load_general_plugins()`` also runs in a trainer process)::

    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins
    from megarefit.integrations.vllm_trainer import MegarefitTrainerInitInfo, MegatronSource

    load_general_plugins()  # registers backend "megarefit" on both factories
    engine = WeightTransferTrainerFactory.trainer_init(          # on every trainer rank
        MegarefitTrainerInitInfo(rank=rank, host=rdzv_host, port=rdzv_port, job="rl"),
        client=HTTPVLLMWeightSyncClient("http://vllm:8000"), source=MegatronSource(model, hf_config))
    for step in ...:
        train_step()
        engine.send_weights()   # publish the next version, rank 0 drives the update, all wait for the pulls

It stays a pull underneath: ``send_weights`` publishes the version (each rank's
:class:`~megarefit.online.trainer.publisher.Publisher`), trainer rank 0 (the sender) drives
``start_weight_update`` -> ``update_weights {"version": v}`` -> ``finish_weight_update("v")``
through the client, in which every vLLM worker pulls its share of every rank's shards, and every
rank returns once the workers acknowledged ``v`` (``wait_receivers``): the trainer may then write
its parameters again. No tensor goes through the client, and no secret: the init info carries
the rendezvous address only; every process (trainers, vLLM workers) reads the job secret from
``$MEGAREFIT_JOB_SECRET``.

What vLLM's client protocol does not carry (``VLLMWeightSyncClient``: four calls): no ``/pause`` /
``/resume`` (a server that keeps generating during ``send_weights`` refuses to run the model while
the update is open: pause it yourself, or use
:class:`~megarefit.integrations.vllm_http.VllmHttpRefit`), no recovery of an update a dead
controller left open (``VllmHttpRefit.init`` ends it), no prefetch, and vLLM's
``HTTPVLLMWeightSyncClient`` drops the server's error text (``raise_for_status``). docs/http.md
compares the two.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import torch

from megarefit.errors import MegarefitError
from megarefit.integrations.vllm import ENGINE_NAME, MegarefitInitInfo
from megarefit.integrations.vllm_install import vllm_api, vllm_internal
from megarefit.layout.dims import ModelDims, load_hf_config
from megarefit.layout.megatron_model import read_chunks
from megarefit.online.store.rendezvous import SECRET_ENV, Rendezvous
from megarefit.online.trainer.publisher import Publisher, PublisherGroup
from megarefit.planner import plan_megatron_to_hf

# What the trainer engine reads of vLLM (public in vLLM 0.32: vllm.distributed.weight_transfer); module -> names
TRAINER_API = {
    "vllm.distributed.weight_transfer.base": ("TrainerInitInfo", "TrainerWeightTransferEngine", "WeightSource",
                                              "ParamMeta", "VLLMWeightSyncClient"),
    "vllm.distributed.weight_transfer.factory": ("WeightTransferTrainerFactory",),
}
# The worker engine's init_info fields a trainer may set (``worker=``); the rest come from the trainer's init info
WORKER_OPTIONS = frozenset(f.name for f in dataclasses.fields(MegarefitInitInfo)) - {"host", "port", "job",
                                                                                     "timeout", "secret"}
CLIENT_CALLS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


class TrainerInitError(MegarefitError, ValueError):
    """A trainer engine's init info, source or client cannot start a refit (named field, value, fix)."""


class SendError(MegarefitError, RuntimeError):
    """Trainer rank 0's weight update failed; every rank's ``send_weights`` raises it for that version."""


@functools.cache
def trainer_api() -> SimpleNamespace:
    """vLLM's trainer-side weight-transfer API (:data:`TRAINER_API`).

    Raises:
        VllmVersionError: a module or name is missing from the installed vLLM (before 0.32 there
            is no trainer factory), naming vLLM's version and the tested ones (:func:`vllm_api`)."""
    return vllm_api(TRAINER_API, "to register megarefit's trainer-side weight-transfer engine with vLLM's trainer "
                                 "factory")


def _refuse(field: str, value: Any, need: str) -> None:
    raise TrainerInitError(f"MegarefitTrainerInitInfo {field}={value!r}: {need}")


def check_trainer_init(info: Any) -> None:
    """Check a :class:`MegarefitTrainerInitInfo` (run at construction; vLLM builds none itself).

    Raises:
        TrainerInitError: naming the field, the value and what to give; ``secret`` anywhere (the job
            secret is read from ``$MEGAREFIT_JOB_SECRET`` in each process, never sent)."""
    if not isinstance(info.rank, int) or isinstance(info.rank, bool) or info.rank < 0:
        _refuse("rank", info.rank, "this trainer process's rank, an int >= 0 (rank 0 drives vLLM's update)")
    if not isinstance(info.host, str) or not info.host:
        _refuse("host", info.host, "the rendezvous host (Rendezvous.serve's), as the trainers and the vLLM "
                                   "workers reach it")
    if not isinstance(info.port, int) or isinstance(info.port, bool) or not 0 < info.port < 65536:
        _refuse("port", info.port, "the rendezvous port, an int in 1..65535 (Rendezvous.port)")
    if not isinstance(info.job, str) or not info.job:
        _refuse("job", info.job, "the rendezvous job name, a non-empty str")
    for field in ("pull_timeout", "ack_timeout", "lease"):
        value = getattr(info, field)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            _refuse(field, value, "seconds, a number > 0")
    if not isinstance(info.first_version, int) or isinstance(info.first_version, bool) or info.first_version < 0:
        _refuse("first_version", info.first_version, "the version the first send_weights() publishes, an int >= 0")
    if not isinstance(info.worker, dict):
        _refuse("worker", info.worker, f"a dict of the worker engine's init_info options {sorted(WORKER_OPTIONS)}")
    if "secret" in info.worker:
        _refuse("worker", {**info.worker, "secret": "..."},
                f"no secret goes through vLLM's control plane: every trainer and vLLM process reads the job secret "
                f"from ${SECRET_ENV}; drop it")
    unknown = sorted(set(info.worker) - WORKER_OPTIONS)
    if unknown:
        _refuse("worker", info.worker, f"unknown worker options {unknown}; the worker engine takes "
                                       f"{sorted(WORKER_OPTIONS)} (host, port, job and timeout: this init info's)")


def _make_init_info_class() -> type:
    api = trainer_api()

    @dataclasses.dataclass(kw_only=True)
    class MegarefitTrainerInitInfo(api.TrainerInitInfo):  # type: ignore[misc, name-defined]
        """Trainer-side init info of backend ``"megarefit"`` (vLLM's trainer factory dispatches on
        ``backend``). ``rank``: this trainer process's rank (rank 0 drives vLLM's update);
        ``host`` / ``port`` / ``job``: the rendezvous (``Rendezvous.serve``), the same for every
        trainer rank and reached by the vLLM workers; ``pull_timeout``: seconds a worker waits for a
        version's shards; ``ack_timeout``: seconds ``send_weights`` waits for the workers'
        acknowledgements (``wait_receivers``), ``lease`` the seconds after which a silent receiver is
        dropped; ``first_version``: what the first ``send_weights()`` publishes (then + 1 each);
        ``worker``: the worker engine's other init_info options (``sharded``, ``memory_budget``,
        ``keep_previous``, ``direct``, ``replica`` / ``replicas`` ...). No secret (``$MEGAREFIT_JOB_SECRET``).

        Raises:
            TrainerInitError: at construction (:func:`check_trainer_init`)."""

        backend: ClassVar[str] = ENGINE_NAME

        host: str
        port: int
        job: str = "default"
        pull_timeout: float = 60.0
        ack_timeout: float = 300.0
        lease: float = 10.0
        first_version: int = 1
        worker: dict[str, Any] = dataclasses.field(default_factory=dict)

        def __post_init__(self) -> None:
            check_trainer_init(self)

        def worker_init_info(self) -> dict[str, Any]:
            """What rank 0 sends to ``init_weight_transfer_engine``: the worker engine's init_info."""
            return {"host": self.host, "port": self.port, "job": self.job, "timeout": float(self.pull_timeout),
                    **self.worker}

    return MegarefitTrainerInitInfo


class _SourceMethods:
    """A rank's Megatron-Core model as vLLM's ``WeightSource``, read by megarefit's trainer engine only.

    ``model``: the rank's Megatron-Core model (or its chunks; wrapped in DDP / Float16Module or
    not), ``hf_config`` its HF config, ``options``: :meth:`Publisher.from_megatron`'s (``snapshot``,
    ``checksums``, ``delta``, ``serve_copies`` ...). The engine builds the rank's Publisher from it
    once, at ``trainer_init``. ``metadata()`` lists the HF tensors the workers receive (names,
    dtypes, full shapes), from megarefit's plan (a collective over the pipeline group before the
    Publisher exists, with pp > 1). Iterating it raises: megarefit never gathers full tensors on the
    trainer; the workers pull shards.
    """

    def __init__(self, model: torch.nn.Module | list[torch.nn.Module], hf_config: Any, **options: Any) -> None:
        self.model = model
        self.hf_config = load_hf_config(hf_config)
        self.options = options
        self.publisher: Publisher | PublisherGroup | None = None
        self._metadata: list[Any] | None = None

    def serve(self, rendezvous: Rendezvous) -> Publisher | PublisherGroup:
        """The rank's Publisher on ``rendezvous`` (built at the first call)."""
        if self.publisher is None:
            self.publisher = Publisher.from_megatron(self.model, self.hf_config, rendezvous=rendezvous,
                                                     **self.options)
        return self.publisher

    def metadata(self) -> list[Any]:
        if self._metadata is None:
            dims = ModelDims.from_hf_config(self.hf_config)
            layout = self.publisher.layout if self.publisher is not None else read_chunks(self.model, dims)[0].layout
            params = [p for p in (self.model if isinstance(self.model, list) else [self.model])[0].parameters()]
            dtype = str(params[0].dtype).removeprefix("torch.")
            plan = plan_megatron_to_hf(dims, layout, dtype)
            param_meta = trainer_api().ParamMeta
            self._metadata = [param_meta(ref.name, getattr(torch, meta.dtype), tuple(meta.shape))
                              for ref, meta in plan.targets.items() if ref not in plan.staging]
        return self._metadata

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise MegarefitError("a MegatronSource is not iterated: megarefit's trainer engine never gathers full HF "
                             "tensors on the trainer, the vLLM workers pull each rank's shards. Hand it to "
                             "WeightTransferTrainerFactory.trainer_init with a MegarefitTrainerInitInfo")


def _make_source_class() -> type:
    class MegatronSource(_SourceMethods, trainer_api().WeightSource):  # type: ignore[misc]
        __doc__ = _SourceMethods.__doc__

    return MegatronSource


def _check_client(client: Any) -> None:
    missing = [name for name in CLIENT_CALLS if not callable(getattr(client, name, None))]
    if missing:
        raise TrainerInitError(f"client {type(client).__name__} lacks {missing}: trainer rank 0 drives vLLM's update "
                               "through a VLLMWeightSyncClient (vLLM's HTTPVLLMWeightSyncClient / "
                               "RayVLLMWeightSyncClient, or megarefit's LLMWeightSyncClient for an in-process LLM)")


def _outcome(text: str) -> dict[str, Any]:
    return json.loads(text)


class _TrainerMethods:
    """vLLM ``TrainerWeightTransferEngine`` of backend ``"megarefit"``: a pull underneath.

    ``trainer_init`` (every rank) connects to the rendezvous, builds the rank's Publisher from the
    :class:`MegatronSource` (NIXL registration of its shards: once), and on rank 0 (the sender)
    sends the worker engine's init_info (:meth:`MegarefitTrainerInitInfo.worker_init_info`, no
    secret) through ``client.init_weight_transfer_engine``; the other ranks wait until it
    succeeded (a signed record in the rendezvous, ``ack_timeout``) or raise its error.

    ``send_weights(version=None)`` (every rank, after the optimizer step): publishes ``version``
    (default: ``first_version``, then the last + 1), rank 0 runs ``start_weight_update`` ->
    ``update_weights {"version": v, "timeout": pull_timeout}`` -> ``finish_weight_update("v")``
    (the workers pull inside ``update_weights``; vLLM labels the served weights ``"v"``), then every
    rank waits until the workers acknowledged ``v`` (``Publisher.wait_receivers``; ``ack_timeout``,
    ``lease``) and returns ``{"version", "seconds", "receivers"}``. A failure on rank 0 raises
    there and, as :class:`SendError`, on every other rank (the worker engine leaves vLLM on its
    previous weights where it can: docs/http.md "Failures"); publish the next version to retry.

    Raises (``trainer_init``):
        TrainerInitError: init info not a ``MegarefitTrainerInitInfo``, source not a ``MegatronSource``,
            a client without vLLM's four weight-sync calls.
        MegarefitError / StoreError: as ``Rendezvous.connect`` (no ``$MEGAREFIT_JOB_SECRET``, store
            unreachable) and ``Publisher.from_megatron``.
    """

    def __init__(self, *, client: Any, source: Any, is_sender: bool, info: Any, rendezvous: Rendezvous,
                 publisher: Publisher | PublisherGroup, session: str) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)  # type: ignore[call-arg]
        self.info = info
        self.rendezvous = rendezvous
        self.publisher = publisher
        self.session = session  # the rendezvous keys of this set of engines (one per trainer rank)
        self.version: int | None = None  # the last version sent
        self.sends = 0  # send_weights calls so far: every rank counts its own, in the same order
        self.last_report: dict[str, Any] | None = None

    @classmethod
    def trainer_init(cls, init_info: Any, *, client: Any, source: Any = None) -> Any:
        if not isinstance(init_info, trainer_init_info_class()):
            raise TrainerInitError(f"init_info is a {type(init_info).__name__}: backend {ENGINE_NAME!r} takes a "
                                   "megarefit.integrations.vllm_trainer.MegarefitTrainerInitInfo")
        if not isinstance(source, megatron_source_class()):
            raise TrainerInitError(f"source is a {type(source).__name__}: backend {ENGINE_NAME!r} serves the rank's "
                                   "Megatron-Core model in place; pass source=MegatronSource(model, hf_config)")
        sender = init_info.is_sender
        if sender:
            _check_client(client)
        rdzv = Rendezvous.connect(init_info.host, init_info.port, job=init_info.job, timeout=init_info.ack_timeout)
        # the n-th engine of this rank on this job: every rank counts its own, so all agree without a collective
        count = rdzv.store.add(rdzv.prefix + f"vllm-trainer/inits/{init_info.rank}", 1)
        engine = cls(client=client, source=source, is_sender=sender, info=init_info, rendezvous=rdzv,
                     publisher=source.serve(rdzv), session=f"vllm-trainer/{count}")
        key = f"{engine.session}/init"
        if sender:
            try:
                client.init_weight_transfer_engine(init_info.worker_init_info())
            except Exception as exc:
                rdzv.put(key, json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
                raise
            rdzv.put(key, json.dumps({"ok": True}))
        else:
            engine._sender_outcome(key, "init_weight_transfer_engine")
        return engine

    def _sender_outcome(self, key: str, what: str) -> None:
        """Wait for rank 0's record of ``what``; raise :class:`SendError` with its error."""
        outcome = _outcome(self.rendezvous.fetch_many([key], timeout=self.info.ack_timeout)[0].decode())
        if not outcome["ok"]:
            raise SendError(f"trainer rank {self.info.rank}: rank 0's {what} failed: {outcome['error']}")

    def send_weights(self, version: int | None = None) -> dict[str, Any]:
        """Publish ``version`` (default: the next), have the workers pull it, wait for their
        acknowledgements; see the class docstring. Every rank, in the same order."""
        info = self.info
        v = (info.first_version if self.version is None else self.version + 1) if version is None else version
        t0 = time.perf_counter()
        self.publisher.publish(v)  # VersionOrderError for an older version: nothing is sent
        self.sends += 1  # a version sent again has its own outcome key: never an earlier send's record
        key = f"{self.session}/sent/{self.sends}/{v}"
        if self.is_sender:
            try:
                self.client.start_weight_update()
                self.client.update_weights({"version": v, "timeout": float(info.pull_timeout)})
                self.client.finish_weight_update(weight_version=str(v))
            except Exception as exc:
                self.rendezvous.put(key, json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
                raise
            self.rendezvous.put(key, json.dumps({"ok": True}))
        else:
            self._sender_outcome(key, f"weight update to version {v}")
        receivers = self.publisher.wait_receivers(v, timeout=info.ack_timeout, lease=info.lease)
        self.version = v
        self.last_report = {"version": v, "seconds": time.perf_counter() - t0, "receivers": receivers}
        return self.last_report

    def shutdown(self) -> None:
        """Rank 0: ``client.shutdown_weight_transfer_engine()`` where the client has it (vLLM's HTTP
        and Ray clients, :class:`LLMWeightSyncClient`): the workers' receivers stop."""
        stop = getattr(self.client, "shutdown_weight_transfer_engine", None)
        if self.is_sender and callable(stop):
            stop()


def _make_engine_class() -> type:
    base = trainer_api().TrainerWeightTransferEngine

    class MegarefitTrainerWeightTransferEngine(_TrainerMethods, base):  # type: ignore[misc, valid-type]
        __doc__ = _TrainerMethods.__doc__
        init_info_cls = trainer_init_info_class()

    return MegarefitTrainerWeightTransferEngine


class LLMWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an in-process ``vllm.LLM`` (its RL methods
    take ``{"init_info": ...}`` / ``{"update_info": ...}`` requests; the protocol passes the inner
    dicts). Hand it to trainer rank 0's ``trainer_init`` where that process holds the engine."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()


@functools.cache
def trainer_init_info_class() -> type:
    """``MegarefitTrainerInitInfo`` on vLLM's ``TrainerInitInfo`` (built at first use).

    Raises:
        VllmVersionError: as :func:`trainer_api`."""
    cls = _make_init_info_class()
    cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return cls


@functools.cache
def megatron_source_class() -> type:
    """``MegatronSource`` on vLLM's ``WeightSource`` (built at first use)."""
    cls = _make_source_class()
    cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return cls


@functools.cache
def trainer_engine_class() -> type:
    """``MegarefitTrainerWeightTransferEngine`` on vLLM's ``TrainerWeightTransferEngine``."""
    cls = _make_engine_class()
    cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return cls


_LAZY = {"MegarefitTrainerInitInfo": trainer_init_info_class, "MegatronSource": megatron_source_class,
         "MegarefitTrainerWeightTransferEngine": trainer_engine_class}


def __getattr__(name: str) -> Any:
    if name in _LAZY:  # built on vLLM's classes at first use: importing vLLM is slow and optional
        return _LAZY[name]()
    raise AttributeError(name)


def register_trainer() -> None:
    """Register the ``megarefit`` trainer engine on vLLM's ``WeightTransferTrainerFactory``
    (public ``register_engine``, lazily by module path; idempotent).

    Raises:
        VllmVersionError: the installed vLLM has no trainer factory (:func:`trainer_api`)."""
    factory = trainer_api().WeightTransferTrainerFactory
    registry = vllm_internal(factory, "_registry", "to keep registration idempotent", "WeightTransferTrainerFactory")
    if ENGINE_NAME not in registry:
        factory.register_engine(ENGINE_NAME, __name__, "MegarefitTrainerWeightTransferEngine")


__all__ = ["CLIENT_CALLS", "TRAINER_API", "WORKER_OPTIONS", "LLMWeightSyncClient", "SendError", "TrainerInitError",
           "check_trainer_init", "megatron_source_class", "register_trainer", "trainer_api", "trainer_engine_class",
           "trainer_init_info_class"]
