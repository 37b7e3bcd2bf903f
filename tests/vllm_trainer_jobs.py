"""Trainer ranks for tests/test_vllm_trainer_engine.py: real Megatron-Core (gloo, tp 2) driving
vLLM through vLLM's own trainer factory, backend ``"megarefit"`` chosen by name."""

from __future__ import annotations

import os
from multiprocessing.connection import Client
from typing import Any

import torch

from megarefit.demo.megatron_cpu import (
    apply_cpu_patches,
    build_gpt_model,
    gpt_arch_from_hf,
    init_parallel,
    perturb_parameters_,
)
from megarefit.integrations.megatron import local_named_parameters


class PipeClient:
    """vLLM's four weight-sync calls sent over a pipe to the test process, which runs them on its
    in-process ``LLM`` through megarefit's ``LLMWeightSyncClient`` (as vLLM's
    ``RayVLLMWeightSyncClient`` reaches an ``LLM`` actor)."""

    def __init__(self, address: tuple[str, int], authkey: bytes):
        self.conn = Client(address, authkey=authkey)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> None:
        self.conn.send((method, args, kwargs))
        status, error = self.conn.recv()
        if status != "ok":
            raise RuntimeError(error)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version=weight_version)

    def close(self) -> None:
        self.conn.send(("close", (), {}))
        self.conn.close()


def engine_trainer_job(rank: int, world_size: int, master_port: int, cfg: dict, rendezvous: tuple[str, int, str],
                       client: tuple, versions: int, snapshot_dir: str, worker: dict,
                       hold: bool = False) -> dict[str, Any]:
    """Trainer rank ``rank`` of 2 (tp 2): vLLM's ``WeightTransferTrainerFactory.trainer_init`` with a
    ``MegarefitTrainerInitInfo`` (backend ``"megarefit"``, registered through vLLM's own plugin
    loader), then ``versions`` times: a step (v > 1: every weight changed in place), the shards saved
    to ``snapshot_dir`` as ``v{v}-tp{t}-pp0-ep0.pt``, ``send_weights()``. ``client``: ``("http", url)``
    (vLLM's ``HTTPVLLMWeightSyncClient``) or ``("pipe", address, authkey)`` (:class:`PipeClient`).
    ``hold``: after each ``send_weights`` wait until the test marks the version consumed (it samples
    the server first). Returns the engine's reports and what the init info / factory said."""
    apply_cpu_patches()
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # vLLM's plugin loader runs megarefit's entry point: both factories know "megarefit"
    from megarefit.integrations.vllm_trainer import MegarefitTrainerInitInfo, MegatronSource

    init_parallel(rank=rank, world_size=world_size, master_port=master_port, tp=2, pp=1)
    model = build_gpt_model(gpt_arch_from_hf(cfg, tp=2), seed=1234)
    perturb_parameters_(model, seed=1234)
    host, port, job = rendezvous
    sync = (HTTPVLLMWeightSyncClient(client[1], timeout=300) if client[0] == "http"
            else PipeClient(client[1], client[2]) if rank == 0 else None)
    info = MegarefitTrainerInitInfo(rank=rank, host=host, port=port, job=job, pull_timeout=120.0, ack_timeout=180.0,
                                    worker=worker)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=sync, source=MegatronSource(model, cfg))
    out: dict[str, Any] = {"engine": type(engine).__name__, "worker_init": info.worker_init_info(), "reports": [],
                           "metadata": [(m.name, str(m.dtype), m.shape) for m in engine.source.metadata()]}
    for v in range(1, versions + 1):
        if v > 1:
            perturb_parameters_(model, seed=1234 + v, scale=0.01)  # stands in for optimizer.step()
        torch.save(local_named_parameters(model), os.path.join(snapshot_dir, f"v{v}-tp{rank}-pp0-ep0.pt"))
        out["reports"].append(engine.send_weights())
        if hold:
            engine.rendezvous.wait_consumed(v, timeout=300)
    if isinstance(sync, PipeClient):
        sync.close()
    return out
