"""Same-host copies from a node-mate's served arena (issue 60), with real NIXL (UCX) on CPU.

A mate serves two arenas (bf16, fp32) as a replica parent does (``publish_arena``, its seqlock);
a reader copies byte ranges of them into its own arenas. The oracle slices the mate's bytes with
torch (``view(torch.uint8)``), not through NIXL. Then the fences: a version not served yet waits
and times out, a newer one is refused, an odd sequence (the mate rewriting) is never read, a mate
that rewrote its arena during the READ makes the read retryable-stale, ranges outside either
arena are refused before a byte moves.
"""

from __future__ import annotations

import uuid

import pytest
import torch

pytest.importorskip("nixl")

from megarefit.online import Rendezvous
from megarefit.online.receiver.arena import arena_key, publish_arena
from megarefit.online.receiver.cycle import StaleVersionError
from megarefit.online.receiver.node_copy import MateReader, RangeCopy
from megarefit.online.store.rendezvous import RendezvousTimeout
from megarefit.transport.nixl_agent import NixlAgent, TransferError

GROUP = "node-n0"
MATE = f"mate-{uuid.uuid4().hex[:6]}"  # its receiver id is its NIXL agent's name, as a RefitReceiver's


@pytest.fixture(scope="module")
def served():
    rdzv = Rendezvous.serve("127.0.0.1", 0, job="copies", secret="c" * 64)
    g = torch.Generator().manual_seed(7)
    arenas = {"bfloat16": torch.randn(4096, generator=g).to(torch.bfloat16),
              "float32": torch.randn(1000, generator=g)}
    mate = NixlAgent(MATE, device=torch.device("cpu"))
    mate.register(list(arenas.values()))
    publish_arena(rdzv, GROUP, MATE, arenas, [], 3, mate.metadata)
    mine = {"bfloat16": torch.zeros(5000, dtype=torch.bfloat16), "float32": torch.zeros(600)}
    reader = NixlAgent(f"reader-{uuid.uuid4().hex[:6]}", device=torch.device("cpu"))
    reader.register(list(mine.values()))
    yield rdzv, arenas, mine, reader, mate
    rdzv.store.close()


def _seq(rdzv, delta: int = 0) -> int:
    return rdzv.store.add(rdzv.prefix + arena_key("seq", GROUP, MATE), delta)


COPIES = [RangeCopy("bfloat16", 0, 64, 1000), RangeCopy("bfloat16", 2048, 4096, 5000),
          RangeCopy("float32", 400, 1200, 0), RangeCopy("float32", 3996, 4, 2396)]


def test_ranges_land_where_asked_and_nowhere_else(served):
    rdzv, arenas, mine, reader, _ = served
    for t in mine.values():
        t.zero_()
    got = MateReader(rdzv, reader, group=GROUP, mate=MATE, timeout=10).read(COPIES, mine, 3)
    assert got == sum(c.nbytes for c in COPIES)
    want = {d: torch.zeros_like(t).view(torch.uint8) for d, t in mine.items()}
    for c in COPIES:
        want[c.dtype][c.dst:c.dst + c.nbytes] = arenas[c.dtype].view(torch.uint8)[c.src:c.src + c.nbytes]
    for d in mine:
        assert torch.equal(mine[d].view(torch.uint8), want[d]), d


def test_a_mate_whose_metadata_changed_is_read_again(served):
    """The mate registers more memory (its NIXL metadata changes, as a receiver's does when its
    scratch grows) and publishes it: the same reader reads again, the old metadata replaced by
    the new one (removed first), every byte where asked."""
    rdzv, arenas, mine, reader, mate = served
    rx = MateReader(rdzv, reader, group=GROUP, mate=MATE, timeout=10)
    assert rx.read(COPIES[:1], mine, 3) == COPIES[0].nbytes
    extra = torch.zeros(1 << 16, dtype=torch.uint8)
    mate.register([extra])
    try:
        publish_arena(rdzv, GROUP, MATE, arenas, [], 3, mate.metadata)
        for t in mine.values():
            t.zero_()
        assert rx.read(COPIES, mine, 3) == sum(c.nbytes for c in COPIES)
        for c in COPIES:
            assert torch.equal(mine[c.dtype].view(torch.uint8)[c.dst:c.dst + c.nbytes],
                               arenas[c.dtype].view(torch.uint8)[c.src:c.src + c.nbytes]), c
    finally:
        mate.deregister([extra])
        publish_arena(rdzv, GROUP, MATE, arenas, [], 3, mate.metadata)


def test_only_the_version_asked_for_is_read(served):
    rdzv, _, mine, reader, _ = served
    with pytest.raises(RendezvousTimeout, match=r"node-mate 'mate-\w+' \(group 'node-n0'\) did not serve version 4"):
        MateReader(rdzv, reader, group=GROUP, mate=MATE, timeout=0.3).read(COPIES, mine, 4)
    with pytest.raises(StaleVersionError, match="serves version 3, newer than the 2 asked for"):
        MateReader(rdzv, reader, group=GROUP, mate=MATE, timeout=0.3).read(COPIES, mine, 2)


def test_a_mate_rewriting_its_arena_is_not_read(served):
    rdzv, _, mine, reader, _ = served
    for t in mine.values():
        t.zero_()
    _seq(rdzv, 1)  # odd: the mate pulls into its arena
    try:
        with pytest.raises(RendezvousTimeout, match=r"within 0.3 s \(sequence \d*[13579]\)"):
            MateReader(rdzv, reader, group=GROUP, mate=MATE, timeout=0.3).read(COPIES, mine, 3)
        assert all(not t.any() for t in mine.values())  # nothing copied
    finally:
        _seq(rdzv, 1)


def test_a_mate_that_rewrote_during_the_read_makes_it_stale(served, monkeypatch):
    rdzv, _, mine, reader, _ = served
    fetch = rdzv.fetch

    def fetch_then_rewrite(key):  # the mate starts and ends a rewrite while the READ is set up
        out = fetch(key)
        if key == arena_key("meta", GROUP, MATE):
            _seq(rdzv, 2)
        return out

    monkeypatch.setattr(rdzv, "fetch", fetch_then_rewrite)
    with pytest.raises(StaleVersionError, match="rewrote its arena during the READ") as err:
        MateReader(rdzv, reader, group=GROUP, mate=MATE, timeout=5).read(COPIES, mine, 3)
    assert err.value.retryable


@pytest.mark.parametrize("bad", [RangeCopy("float32", 3998, 4, 0), RangeCopy("float32", 0, 4, 2398),
                                 RangeCopy("int8", 0, 4, 0), RangeCopy("float32", 0, 0, 0)])
def test_a_range_outside_either_arena_is_refused_before_a_byte_moves(served, bad):
    rdzv, _, mine, reader, _ = served
    for t in mine.values():
        t.zero_()
    with pytest.raises(TransferError, match="node-mate 'mate-"):
        MateReader(rdzv, reader, group=GROUP, mate=MATE, timeout=5).read([COPIES[0], bad], mine, 3)
    assert all(not t.any() for t in mine.values())
