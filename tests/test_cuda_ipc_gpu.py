"""Colocated refit through CUDA IPC (issue 22): trainer ranks in their own processes on the
receiver's GPU, read by device copies from their exported memory (skipped without CUDA; run
on a GPU machine, see docs/benchmarks.md).

Every parameter of version v holds the value v (float32, exact), so a torn pull -- bytes of
two versions under one number -- is visible in the received tensors; the trainers are the
same writer processes as the NIXL handover stress test (tests/handover_jobs.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nixl")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from conftest import tiny_config

from megarefit.demo.workers import start_workers
from megarefit.online import RefitReceiver, StaleVersionError
from megarefit.online.store.rendezvous import Rendezvous
from megarefit.transport.cuda_ipc import IpcError

CFG = tiny_config("Qwen3-0.6B", tie_word_embeddings=False)


def _values(got: dict) -> set[float]:
    return {v for t in got.values() for v in torch.unique(t).tolist()}


def _static(job: str, rdzv: Rendezvous, value: float, version: int, devices: tuple[str, ...]):
    from handover_jobs import static_trainer_job

    group = start_workers(static_trainer_job, world_size=2, args=(rdzv.port, job, CFG, None, value, version, devices))
    return group


def _stop(rdzv: Rendezvous, group, *receivers: RefitReceiver) -> None:
    rdzv.store.set(rdzv.prefix + "stop", "1")
    rdzv.store.set(rdzv.prefix + "done", "1")
    for r in receivers:
        r.close()
    group.join(timeout=120)


@pytest.mark.parametrize("budget", [None, "auto"])
def test_colocated_refit_reads_through_cuda_ipc(budget):
    """Both ranks on cuda:0 beside the receiver: every byte comes through CUDA IPC (no NIXL
    READ posted), staged and streamed, with checksums verified; a restarted trainer group
    (new processes, new allocations, new handles) is re-opened, never read through the old ones."""
    job = f"ipc-{budget}"
    rdzv = Rendezvous.serve(job=job)
    group = _static(job, rdzv, 1.0, 1, ("cuda:0",))
    receiver = RefitReceiver(rdzv, name=f"{job}-recv", timeout=60, device="cuda:0", transport="ipc",
                             memory_budget=budget)
    try:
        got = {k: t.clone() for k, t in receiver.run_refit_cycle(1)}
        stats = receiver.stats
        assert _values(got) == {1.0}
        assert stats.ipc_ranks == 2 and stats.ipc_bytes == stats.bytes_moved == stats.wire_bytes
        assert receiver.counters.get("posts", 0) == 0  # no NIXL READ
        opened = receiver.transport.ipc.opened_storages
        assert opened >= 2
        for _ in range(3):  # warm: nothing opened again
            assert _values({k: t.clone() for k, t in receiver.run_refit_cycle(1)}) == {1.0}
        assert receiver.transport.ipc.opened_storages == opened
        rdzv.store.set(rdzv.prefix + "stop", "1")
        group.join(timeout=120)  # the trainers exit: their memory is freed
        rdzv.store.delete_key(rdzv.prefix + "stop")
        group = _static(job, rdzv, 3.0, 3, ("cuda:0",))
        got = {k: t.clone() for k, t in receiver.run_refit_cycle(3)}
        assert _values(got) == {3.0} and receiver.stats.ipc_ranks == 2
        assert receiver.transport.ipc.opened_storages > opened  # the new exports were opened
    finally:
        _stop(rdzv, group, receiver)


def test_mixed_job_uses_both_transports_in_one_cycle():
    """Rank 0 on this GPU (CUDA IPC), rank 1 in host memory (NIXL): one cycle, both paths."""
    job = "ipc-mixed"
    rdzv = Rendezvous.serve(job=job)
    group = _static(job, rdzv, 2.0, 2, ("cuda:0", "cpu"))
    receiver = RefitReceiver(rdzv, name=f"{job}-recv", timeout=60, device="cuda:0")
    try:
        got = {k: t.clone() for k, t in receiver.run_refit_cycle(2)}
        stats = receiver.stats
        assert _values(got) == {2.0}
        assert stats.ipc_ranks == 1 and 0 < stats.ipc_bytes < stats.wire_bytes
        assert receiver.counters["posts"] > 0  # rank 1's READs
        with pytest.raises(IpcError, match=r"transport=.ipc.: rank \(tp=1, pp=0, ep=0\) cannot be read through CUDA IPC: "
                                           r"its manifest exports no CUDA IPC handles \(tensors on the host"):
            strict = RefitReceiver(rdzv, name=f"{job}-strict", timeout=60, device="cuda:0", transport="ipc")
            try:
                dict(strict.run_refit_cycle(2))
            finally:
                strict.close()
    finally:
        _stop(rdzv, group, receiver)


@pytest.mark.parametrize("mode,budget", [("seqlock", None), ("seqlock", "auto"), ("plain", None)])
def test_writer_stress_through_cuda_ipc(mode, budget):
    """Refits while both ranks rewrite every parameter on the GPU: with ``Publisher.updating``
    no accepted pull is torn (staged and streamed); with plain ``publish`` torn pulls get
    through (the check can fail)."""
    from handover_jobs import writer_job

    job = f"ipc-stress-{mode}-{budget}"
    rdzv = Rendezvous.serve(job=job)
    group = start_workers(writer_job, world_size=2, args=(rdzv.port, job, CFG, mode, 0.01, 0.01, "cuda:0"))
    receiver = RefitReceiver(rdzv, name=f"{job}-recv", timeout=60, retries=5, device="cuda:0", transport="ipc",
                             memory_budget=budget)
    counts = {"intact": 0, "torn": 0, "rejected": 0, "retries": 0}
    try:
        for _ in range(60 if mode == "plain" else 120):
            try:
                got = {k: t.clone() for k, t in receiver.run_refit_cycle()}
            except StaleVersionError:
                counts["rejected"] += 1
                continue
            counts["retries"] += receiver.stats.retries
            counts["intact" if _values(got) == {float(receiver.stats.version)} else "torn"] += 1
    finally:
        _stop(rdzv, group, receiver)
    print(mode, budget, counts)
    if mode == "plain":
        assert counts["torn"] > 0, counts
    else:
        assert counts["torn"] == 0 and counts["intact"] >= 60, counts
        assert counts["retries"] + counts["rejected"] > 0, counts
