"""One fence record per data-parallel copy (megarefit.online.store.copy_fence).

- A warm fence reads the same number of store records with 2 or 16 ranks per copy: two per
  copy at its start, one at its end (counted at a real store, below the rendezvous).
- The fence decides exactly as a per-rank seqlock would (hypothesis): an independent model of
  every rank's sequence, version and registration, written here from the fence's contract,
  says for each start whether it succeeds and with which version, and for each end whether
  the pull stands, over random interleavings of updates, publishes and re-registrations by
  ranks the plan reads and ranks it does not.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megarefit.layout import RankCoord, SourceLayout
from megarefit.layout.dims import ModelDims
from megarefit.online.receiver.cycle import StaleVersionError, VersionMismatchError
from megarefit.online.receiver.fence import VersionFence
from megarefit.online.store.rendezvous import Rendezvous
from megarefit.transport.manifest import Manifest, TensorEntry

_JOBS = itertools.count()
SECRET = "the-job-secret-of-the-copy-fence-test"


class CountingStore:
    """A real store, counting the requests sent to it and the keys they read."""

    def __init__(self, store):
        self._store = store
        self.keys_read = self.requests = 0

    def multi_get(self, keys, timeout=None):
        self.keys_read += len(keys)
        self.requests += 1
        return self._store.multi_get(keys, timeout)

    def get(self, key):
        self.keys_read += 1
        self.requests += 1
        return self._store.get(key)

    def check(self, keys):
        self.requests += 1
        return self._store.check(keys)

    def __getattr__(self, name):
        return getattr(self._store, name)


_SERVED: list[Rendezvous] = []


def _server() -> Rendezvous:
    """One store for the module's jobs (each its own job name: its own keys)."""
    if not _SERVED:
        _SERVED.append(Rendezvous.serve(job="copy-fence", secret=SECRET))
    return _SERVED[0]


def _manifest(rank: RankCoord, layout: SourceLayout, dims: ModelDims) -> Manifest:
    entry = TensorEntry("embedding.word_embeddings.weight", "vocab", "bfloat16", (256, 64), (256, 64), 4096,
                        256 * 64 * 2, "DRAM", 0, 4096)
    return Manifest(rank, dims, layout, f"agent-{'.'.join(map(str, rank))}", (entry,))


def _job(tiny_config, tp: int, copies: int = 2):
    """A job of ``tp`` ranks per copy and ``copies`` copies, registered (no bytes: the fence reads
    only the rendezvous), and a receiver's rendezvous counting its reads."""
    dims = ModelDims.from_hf_config(tiny_config("Qwen3-0.6B"))
    layout = SourceLayout.build(tp=tp, pp=1, padded_vocab_size=dims.padded_vocab_size(tp),
                                num_layers=dims.num_layers, dp=copies)
    trainer = Rendezvous(_server().store, f"copy-fence-{next(_JOBS)}", SECRET)  # a job of its own
    ranks = layout.all_ranks()
    for r in ranks:
        trainer.publish_manifest(_manifest(r, layout, dims), b"metadata of " + repr(r).encode())
    counting = CountingStore(trainer.store.reopen(5.0))
    return trainer, Rendezvous(counting, trainer.job, SECRET), counting, layout, ranks


def _publish(trainer: Rendezvous, layout: SourceLayout, ranks, version: int) -> None:
    for r in ranks:
        trainer.begin_update(r)
    for r in ranks:
        trainer.end_update(r, version)  # its copy's ranks: as its manifest's layout states them


@pytest.mark.parametrize("tp", [2, 16])
def test_a_warm_fence_reads_records_per_copy_not_per_rank(config, tp):
    trainer, rx, counting, layout, ranks = _job(config, tp)
    copy1 = [r for r in ranks if r.copy == 1]
    fence = VersionFence(rx, "rx", ranks_for=lambda first: copy1)
    _publish(trainer, layout, ranks, 1)
    cold = fence.start(None, 5.0)
    fence.end(cold)
    assert cold.writes is None and cold.version == 1 and cold.ranks == copy1
    for version in (2, 3):
        _publish(trainer, layout, ranks, version)
        before, requests = counting.keys_read, counting.requests
        warm = fence.start(None, 5.0)
        fence.end(warm)
        assert warm.version == version and warm.ranks == copy1 and warm.writes is not None
        assert counting.keys_read - before == 3  # writes/1 and fence/1, then writes/1: whatever tp is
        assert counting.requests - requests == (2 if version == 3 else 3)  # (+ whether they exist, once)
        assert warm.metadata[copy1[-1]] == b"metadata of " + repr(copy1[-1]).encode()


def test_a_rank_writing_during_the_pull_is_seen(config):
    trainer, rx, _, layout, ranks = _job(config, 2)
    fence = VersionFence(rx, "rx", ranks_for=lambda first: [r for r in ranks if r.copy == 0])
    for version in (1, 2):
        _publish(trainer, layout, ranks, version)
        fence.end(fence.start(None, 5.0))
    start = fence.start(None, 5.0)
    assert start.writes is not None
    trainer.begin_update(ranks[1])
    with pytest.raises(StaleVersionError, match=r"wrote their weights during the pull of version 2"):
        fence.end(start)


def test_a_fence_waiting_for_a_version_blocks_at_the_store_not_polling(config):
    """Version 3 asked while the trainers are still at 2: the fence waits at the store for the
    copy to complete it (a handful of requests in 1.5 s, where polling every rank's version
    every 5 ms sends hundreds), and starts as soon as it is published."""
    trainer, rx, counting, layout, ranks = _job(config, 4)
    fence = VersionFence(rx, "rx", ranks_for=lambda first: [r for r in ranks if r.copy == 1])
    for version in (1, 2):
        _publish(trainer, layout, ranks, version)
        fence.end(fence.start(None, 5.0))
    later = threading.Timer(1.5, _publish, (trainer, layout, ranks, 3))
    requests, began = counting.requests, time.monotonic()
    later.start()
    start = fence.start(3, 30.0)
    waited = time.monotonic() - began
    later.join()
    assert start.version == 3 and start.writes is not None and 1.4 < waited < 3.0
    assert counting.requests - requests < 12, counting.requests - requests


def test_a_fence_waiting_for_a_version_a_copy_passed_fails_at_once(config):
    trainer, rx, _, layout, ranks = _job(config, 2)
    fence = VersionFence(rx, "rx", ranks_for=lambda first: [r for r in ranks if r.copy == 0])
    _publish(trainer, layout, ranks, 1)
    fence.end(fence.start(None, 5.0))
    began = time.monotonic()
    later = threading.Timer(0.3, _publish, (trainer, layout, ranks, 5))  # version 4 never comes
    later.start()
    with pytest.raises(VersionMismatchError, match=r"already publish a version newer than the asked version 4"):
        fence.start(4, 20.0)
    later.join()
    assert time.monotonic() - began < 3.0


# ---- the fence against a per-rank model, over random interleavings -------------------------

OPS = st.lists(st.tuples(st.sampled_from(["begin", "end", "publish", "register"]), st.integers(0, 3)), max_size=6)


class Model:
    """Each rank's update sequence, version and registration, as the fence's contract states
    them (module docstring of megarefit.online.receiver.fence), kept apart from the store."""

    def __init__(self, ranks):
        self.seq = dict.fromkeys(ranks, 0)
        self.version = dict.fromkeys(ranks, 0)

    def start(self, ranks):
        """``("ok", version)`` or the error a start must raise."""
        if any(self.seq[r] % 2 for r in ranks):
            return StaleVersionError
        versions = {self.version[r] for r in ranks}
        return ("ok", versions.pop()) if len(versions) == 1 else VersionMismatchError

    def stands(self, ranks, before):
        return all((self.seq[r], self.version[r]) == before[r] for r in ranks)


def _apply(trainer, model, layout, dims, ranks, ops):
    for op, i in ops:
        r = ranks[i % len(ranks)]
        copy = [RankCoord(q.tp, q.pp, q.ep, r.copy) for q in layout.ranks()]
        if op == "begin" and model.seq[r] % 2 == 0:
            model.seq[r] = trainer.begin_update(r)
        elif op == "end":  # an update (begun here if it was not) ends with the next version
            if model.seq[r] % 2 == 0:
                trainer.begin_update(r)
            model.version[r] += 1
            model.seq[r] = trainer.end_update(r, model.version[r], copy)
        elif op == "publish" and model.seq[r] % 2 == 0:  # a version of unchanged bytes: no sequence moves
            model.version[r] += 1
            trainer.publish_version(r, model.version[r], copy)
        elif op == "register":  # a restarted rank: a new manifest, its sequence and version kept
            trainer.publish_manifest(_manifest(r, layout, dims), b"metadata again")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.sampled_from(["copy0", "copy1", "mixed"]), cycles=st.lists(st.tuples(OPS, OPS), min_size=1,
                                                                         max_size=4))
@example(plan="copy0", cycles=[([("end", 0), ("begin", 0), ("end", 1)], [])])  # a rank writing as its copy completes
@example(plan="copy1", cycles=[([("end", 2), ("end", 3)], [("publish", 3)]), ([], [])])  # a version moving mid-pull
def test_the_fence_decides_as_a_per_rank_seqlock(config, plan, cycles):
    trainer, rx, _, layout, ranks = _job(config, 2)
    dims = ModelDims.from_hf_config(config("Qwen3-0.6B"))
    wanted = {"copy0": [r for r in ranks if r.copy == 0], "copy1": [r for r in ranks if r.copy == 1],
              "mixed": [ranks[0], ranks[3]]}[plan]
    fence = VersionFence(rx, "rx", ranks_for=lambda first: sorted(wanted))
    model = Model(ranks)
    _publish(trainer, layout, ranks, 1)
    model.seq, model.version = dict.fromkeys(ranks, 2), dict.fromkeys(ranks, 1)
    fence.end(fence.start(None, 5.0))
    for before_pull, during_pull in cycles:
        _apply(trainer, model, layout, dims, ranks, before_pull)
        expected = model.start(wanted)
        if expected in (StaleVersionError, VersionMismatchError):
            with pytest.raises(expected):
                fence.start(None, 0.02)
            continue
        start = fence.start(None, 0.02)
        assert start.version == expected[1]
        snapshot = {r: (model.seq[r], model.version[r]) for r in wanted}
        _apply(trainer, model, layout, dims, ranks, during_pull)
        if model.stands(wanted, snapshot):
            fence.end(start)
        else:
            with pytest.raises(StaleVersionError):
                fence.end(start)
