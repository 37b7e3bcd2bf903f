"""Cut-through fan-out (issue 60): a serving replica forwards its arena chunk by chunk as chunks
land, so each hop of a chain costs about one chunk, not one arena. Real NIXL agents (UCX
loopback): in this process, on threads, or a parent in its own process that is SIGKILLed;
Publishers serve reference shards; the oracle is the HF state the shards were cut from."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import torch

pytest.importorskip("nixl")

from reference import reference_hf_state, reference_shards
from replica_jobs import PausingReplica

from megarefit.layout.megatron_model import source_layout
from megarefit.online import RefitReceiver
from megarefit.online.receiver.replica import ReplicaReceiver
from megarefit.online.store.rendezvous import Rendezvous
from megarefit.online.trainer.publisher import Publisher
from megarefit.transport.execute import torch_dtype

CHUNK = 16 << 10  # bytes: the tiny model's arena (~0.6 MB) is about 40 chunks


@pytest.fixture
def trainers(config):
    cfg = config("Llama-3.1-8B")
    hf = reference_hf_state(cfg, "llama")
    shards = {r: {n: t.clone() for n, t in s.items()} for r, s in reference_shards(hf, cfg, tp=2, pp=1).items()}
    rdzv = Rendezvous.serve(job="cut")
    pubs = [Publisher(s, cfg, rank=r, layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv,
                      agent_name=f"cut-trainer-{r[0]}")
            for r, s in shards.items()]

    def publish(version: int, sign: int) -> None:
        for s, ref in zip(shards.values(), reference_shards(hf, cfg, tp=2, pp=1).values()):  # sign x the HF state
            for n, t in s.items():
                t.copy_(sign * ref[n])
        for p in pubs:
            p.publish(version)

    return hf, rdzv, publish


class Cycle(threading.Thread):
    """``run_refit_cycle(version)`` of a receiver on its own thread; ``got``: its tensors, copied."""

    def __init__(self, rx, version: int):
        super().__init__(daemon=True)
        self.rx, self.version, self.got, self.error = rx, version, None, None
        self.start()

    def run(self) -> None:
        try:
            self.got = {k: v.clone() for k, v in self.rx.run_refit_cycle(self.version)}
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def result(self, timeout: float = 60.0) -> dict[str, torch.Tensor]:
        self.join(timeout)
        assert not self.is_alive(), f"{self.rx.name} did not end within {timeout} s"
        if self.error is not None:
            raise self.error
        return self.got


def _exact(got: dict[str, torch.Tensor], hf: dict[str, torch.Tensor], sign: int) -> bool:
    return got.keys() == hf.keys() and all(torch.equal(got[k], sign * v) for k, v in hf.items())


def _served(rdzv: Rendezvous) -> tuple[int, int]:
    """(bytes, dtype arenas) tier 1 serves, from its replica_info record."""
    info = json.loads(rdzv.fetch("replica_info/g/tier1"))
    return sum(n * torch_dtype(d).itemsize for d, (_, n, _, _) in info["arenas"].items()), len(info["arenas"])


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def test_a_chain_of_three_serving_replicas_mirrors_every_version(trainers):
    """tier 1 -> r0 -> r1 -> r2, every replica serving and started before tier 1 pulls (all at
    once, on threads, each waiting for the version): for three versions every replica holds the
    HF state bit for bit, read in many chunks."""
    hf, rdzv, publish = trainers
    root = RefitReceiver(rdzv, name="tier1", timeout=20, replica_group="g")
    chain = [ReplicaReceiver(rdzv, group="g", parent=p, name=n, timeout=20, serve=True, chunk_bytes=CHUNK)
             for p, n in (("tier1", "r0"), ("r0", "r1"), ("r1", "r2"))]
    for version, sign in ((1, 1), (2, -1), (3, 1)):
        publish(version, sign)
        cycles = [Cycle(r, version) for r in chain]
        assert _exact(dict(root.run_refit_cycle(version)), hf, sign)
        for r, c in zip(chain, cycles):
            assert _exact(c.result(), hf, sign), (r.name, version)
            assert r.version == version and not r.fell_back
            assert r.stats.chunks > 10 and r.bytes_read == r.stats.parent_bytes
    for r in chain:
        r.close()
    root.close()


def test_a_child_reads_before_its_parent_is_whole(trainers):
    """The parent stops once half its arena landed, until the child posted its first READ: that
    READ was posted while the parent's progress was below the whole arena (the child did not
    wait for its parent to finish), and both end with the exact bytes. Store-and-forward (``cut_through=False``) children read
    only a whole parent."""
    hf, rdzv, publish = trainers
    publish(1, 1)
    root = RefitReceiver(rdzv, name="tier1", timeout=20, replica_group="g")
    assert _exact(dict(root.run_refit_cycle(1)), hf, 1)
    total, arenas = _served(rdzv)
    parent = PausingReplica(rdzv, group="g", parent="tier1", name="p", timeout=20, serve=True, chunk_bytes=CHUNK,
                            pause_at=total // 2)
    child = ReplicaReceiver(rdzv, group="g", parent="p", name="c", timeout=20, chunk_bytes=CHUNK)
    stored = ReplicaReceiver(rdzv, group="g", parent="p", name="s", timeout=20, cut_through=False)
    cp, cc, cs = Cycle(parent, 1), Cycle(child, 1), Cycle(stored, 1)
    parent.paused.wait(20)
    _wait(lambda: child.reader.first_read_progress is not None, 10, "the child posted no READ of the paused parent")
    parent.resume.set()
    for c in (cp, cc, cs):
        assert _exact(c.result(), hf, 1), c.rx.name
    assert parent.stats.first_read_progress == total  # tier 1 serves only a whole arena
    assert 0 < child.stats.first_read_progress < total == child.stats.parent_bytes
    assert stored.stats.first_read_progress == total and stored.stats.chunks == arenas
    for r in (parent, child, stored, root):
        r.close()


def test_a_parent_that_moves_to_another_version_mid_mirror(trainers):
    """The parent stops half-way through version 2; the child reads that half; tier 1 then pulls
    version 3 and the parent resumes: it finds tier 1 moved, mirrors version 3, and the child,
    seeing its parent's new epoch, drops the half it had and mirrors version 3 too: never a mix."""
    hf, rdzv, publish = trainers
    root = RefitReceiver(rdzv, name="tier1", timeout=20, replica_group="g")
    publish(2, -1)
    assert _exact(dict(root.run_refit_cycle(2)), hf, -1)
    total, _ = _served(rdzv)
    parent = PausingReplica(rdzv, group="g", parent="tier1", name="p", timeout=20, serve=True, chunk_bytes=CHUNK,
                            pause_at=total // 2)
    child = ReplicaReceiver(rdzv, group="g", parent="p", name="c", timeout=20, chunk_bytes=CHUNK)
    cp, cc = Cycle(parent, 2), Cycle(child, 2)
    parent.paused.wait(20)
    _wait(lambda: child.reader.first_read_progress is not None, 10, "the child posted no READ of the paused parent")
    publish(3, 1)
    assert _exact(dict(root.run_refit_cycle(3)), hf, 1)
    parent.resume.set()
    assert _exact(cp.result(), hf, 1) and parent.version == 3 and parent.stats.retries >= 1
    assert _exact(cc.result(), hf, 1) and child.version == 3 and child.stats.retries >= 1
    for r in (parent, child, root):
        r.close()


@pytest.mark.parametrize("when", ["reading", "waiting"])
def test_a_parent_killed_mid_mirror(trainers, caplog, when):
    """The parent (its own process) stops half-way and is SIGKILLed once the child posted its
    first READ (``reading``: READs in flight fail) or once the child holds all the parent had
    and waits for more (``waiting``: the parent's heartbeat stands still past the lease, 1 s):
    the child pulls the version from the trainers through its fallback, bit-identical, long
    before its timeout (30 s)."""
    from datetime import timedelta

    from replica_jobs import pausing_replica_job

    from megarefit.demo.workers import start_workers

    hf, rdzv, publish = trainers
    publish(1, 1)
    root = RefitReceiver(rdzv, name="tier1", timeout=20, replica_group="g")
    assert _exact(dict(root.run_refit_cycle(1)), hf, 1)
    total, _ = _served(rdzv)
    group = start_workers(pausing_replica_job, world_size=1, args=(rdzv.port, "cut", "g", "tier1", CHUNK, total // 2))
    rdzv.store.wait([rdzv.prefix + "p-paused"], timedelta(seconds=120))
    fallback = RefitReceiver(rdzv, name="c-direct", timeout=20)
    child = ReplicaReceiver(rdzv, group="g", parent="p", name="c", timeout=30, chunk_bytes=CHUNK, lease=1.0,
                            fallback=fallback)

    def kill() -> None:
        reader = child.reader
        if when == "reading":
            _wait(lambda: reader.first_read_progress is not None, 20, "the child posted no READ")
        else:
            _wait(lambda: 0 < reader.done_bytes == reader.parent_landed, 20, "the child did not catch up")
            time.sleep(0.2)
        group.kill(0)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="megarefit.online.receiver.replica"):
        got = dict(child.run_refit_cycle(1))
    killer.join(5)
    assert child.fell_back and "parent 'p' failed" in caplog.text
    assert when == "reading" or "stopped beating" in caplog.text  # waiting: no READ was in flight
    assert time.monotonic() - t0 < 15
    assert _exact(got, hf, 1)
    assert 0 < child.reader.first_read_progress < total
    for r in (child, fallback, root):
        r.close()


@pytest.mark.parametrize("chunk_bytes", [1, 3, 4, 10, 24, 25, 1000, None])
def test_chunks_cover_the_served_order_once(chunk_bytes):
    """Chunks tile each dtype arena in order, at most ``chunk_bytes`` (but at least one element)
    each, ``end`` counting bytes of the arenas back to back; a chunk ends on a target boundary
    where one fits, else on a whole element."""
    from megarefit.online.receiver.replica_chunks import plan_chunks

    arenas = [("bfloat16", 13, 2), ("float32", 7, 4)]  # 26 + 28 bytes
    targets = [("bfloat16", 0, 5), ("bfloat16", 5, 8), ("float32", 0, 3), ("float32", 3, 4)]
    bounds = {"bfloat16": {10, 26}, "float32": {12, 28}}
    chunks = plan_chunks(arenas, targets, chunk_bytes)
    base, prev_end = {"bfloat16": 0, "float32": 26}, 0
    for d, numel, esize in arenas:
        mine = [c for c in chunks if c.dtype == d]
        assert [c.start for c in mine] == [0] + [c.start + c.nbytes for c in mine[:-1]]
        assert mine[-1].start + mine[-1].nbytes == numel * esize
        for c in mine:
            assert c.nbytes % esize == 0 and c.nbytes >= esize and c.end == base[d] + c.start + c.nbytes > prev_end
            prev_end = c.end
            limit = max(esize, (chunk_bytes or 10**9) // esize * esize)
            assert c.nbytes <= limit
            stop = c.start + c.nbytes
            fits = [b for b in bounds[d] if c.start < b <= c.start + limit]
            assert stop == (max(fits) if fits else min(c.start + limit, numel * esize))
    assert chunks[-1].end == 54 and (chunk_bytes is not None or len(chunks) == 2)


def test_a_parent_that_falls_back_lets_its_children_fall_back_at_once(trainers, caplog):
    """Tier 1 (its own process) is SIGKILLed; its replica falls back to the trainers and marks
    its mirror abandoned, so its own child (waiting on it, lease off) falls back too at once
    instead of waiting for its timeout: both bit-exact."""
    from datetime import timedelta

    from handover_jobs import replica_parent_job

    from megarefit.demo.workers import start_workers

    hf, rdzv, publish = trainers
    publish(1, 1)
    group = start_workers(replica_parent_job, world_size=1, args=(rdzv.port, "cut", "g"))
    rdzv.store.wait([rdzv.prefix + "tier1-ready"], timedelta(seconds=120))
    group.kill(0)
    fallbacks = [RefitReceiver(rdzv, name=f"{n}-direct", timeout=20) for n in ("p", "c")]
    parent = ReplicaReceiver(rdzv, group="g", parent="cut-tier1", name="p", timeout=20, serve=True,
                             chunk_bytes=CHUNK, fallback=fallbacks[0])
    child = ReplicaReceiver(rdzv, group="g", parent="p", name="c", timeout=20, chunk_bytes=CHUNK, lease=None,
                            fallback=fallbacks[1])
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="megarefit.online.receiver.replica"):
        cc = Cycle(child, 1)
        assert _exact(Cycle(parent, 1).result(), hf, 1) and parent.fell_back
        assert _exact(cc.result(), hf, 1) and child.fell_back
    assert time.monotonic() - t0 < 10 and "parent 'p' gave up mirroring" in caplog.text
    for r in (parent, child, *fallbacks):
        r.close()
