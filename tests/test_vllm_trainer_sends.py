"""The trainer-side engine's send outcomes: each ``send_weights`` reads its own.

Two ranks of megarefit's ``TrainerWeightTransferEngine`` (built by vLLM's own
``WeightTransferTrainerFactory.trainer_init``, on a real rendezvous store) send version 5; rank 0's
vLLM update fails, and rank 1 raises that failure. Both send version 5 again, rank 1 first: it must
wait for rank 0's second outcome (the engine keys each outcome by its count of sends), not read the
first send's failure that is still in the store under the same version. The Publisher is a recorder
(what a rank publishes and waits for; tests/test_vllm_trainer_engine.py runs the real one).
"""

from __future__ import annotations

import threading
import uuid

import pytest

vllm = pytest.importorskip("vllm")

from megarefit.integrations.vllm_trainer import (
    SendError,
    megatron_source_class,
    register_trainer,
    trainer_api,
    trainer_init_info_class,
)
from megarefit.online.store.rendezvous import Rendezvous


class _Publisher:
    """What the engine calls of a rank's Publisher, recorded."""

    def __init__(self) -> None:
        self.published: list[int] = []

    def publish(self, version: int) -> None:
        self.published.append(version)

    def wait_receivers(self, version: int, timeout: float, lease: float) -> list[str]:
        return [f"receiver-of-{version}"]


class _Client:
    """vLLM's four weight-sync calls; ``update_weights`` fails the first ``fail`` times."""

    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.calls.append("init")

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: dict) -> None:
        self.calls.append(f"update {update_info['version']}")
        if self.fail:
            self.fail -= 1
            raise RuntimeError("vLLM's update_weights failed: worker 0 could not pull")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(f"finish {weight_version}")


def _engines(rdzv: Rendezvous, client: _Client) -> list:
    """Rank 0 then rank 1, through vLLM's trainer factory; each with its own recording Publisher."""
    register_trainer()
    base = megatron_source_class()

    class Source(base):  # the engine takes a MegatronSource: serve the recorder instead of building a Publisher
        def serve(self, rendezvous: Rendezvous) -> _Publisher:
            self.publisher = self.publisher or _Publisher()
            return self.publisher

    info = trainer_init_info_class()
    factory = trainer_api().WeightTransferTrainerFactory
    return [factory.trainer_init(info(rank=rank, host="127.0.0.1", port=rdzv.port, job=rdzv.job, ack_timeout=30.0),
                                 client=client, source=Source(None, {"model_type": "qwen3"}))
            for rank in (0, 1)]


def test_a_version_sent_again_reads_its_own_outcome_not_the_earlier_failure():
    rdzv = Rendezvous.serve(job=f"sends-{uuid.uuid4().hex[:8]}")
    client = _Client(fail=1)
    rank0, rank1 = _engines(rdzv, client)
    with pytest.raises(RuntimeError, match="could not pull"):
        rank0.send_weights(5)
    with pytest.raises(SendError, match=r"trainer rank 1: rank 0's weight update to version 5 failed: "
                                        r"RuntimeError: vLLM's update_weights failed"):
        rank1.send_weights(5)

    got: dict = {}

    def again() -> None:
        try:
            got["report"] = rank1.send_weights(5)
        except Exception as exc:  # noqa: BLE001 - what the test checks
            got["error"] = exc

    retry = threading.Thread(target=again, daemon=True)
    retry.start()
    retry.join(timeout=2.0)  # rank 0 has not sent again: rank 1 has no outcome of its second send to read
    assert retry.is_alive(), f"rank 1's second send of version 5 returned before rank 0 sent it: {got}"
    report0 = rank0.send_weights(5)
    retry.join(timeout=30.0)
    assert not retry.is_alive() and "error" not in got, got
    assert got["report"]["version"] == report0["version"] == 5
    assert got["report"]["receivers"] == ["receiver-of-5"]
    assert client.calls == ["init", "start", "update 5", "start", "update 5", "finish 5"]
    assert rank0.publisher.published == rank1.publisher.published == [5, 5]
    assert rank0.sends == rank1.sends == 2
