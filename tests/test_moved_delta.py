"""Declared moves of delta publishers (issue 59): a ``Publisher(delta=...)`` whose parameters move
between versions follows the move exactly (its served tensors, the tracker's index of their
parameters; mirrors, slots, records and base stay), and a delta receiver refits the next version
as a delta, bit-exactly; receivers prepare again only the moved ranks' READ requests.

Real parts: NIXL (UCX on loopback) between in-process publishers and a receiver; real
Megatron-Core (2 data-parallel processes, gloo, CPU, bf16 Adam with the ``DistributedOptimizer``,
its changes tracked by ``track_changes``) offloaded the way verl offloads it. The oracle of every
pulled HF tensor is the trainers' own parameters of that version put back through the
independent reference sharder (tests/reference.py); a ``delta=False`` receiver's full pull too.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

pytest.importorskip("nixl")

from conftest import tiny_config
from reference import reference_hf_state, reference_shards, unshard

from megarefit.errors import MegarefitError
from megarefit.layout import RankCoord
from megarefit.layout.megatron_model import source_layout
from megarefit.online import RefitReceiver
from megarefit.online.delta.log import BITS, DeltaOptions
from megarefit.online.delta.track import ChangeTracker
from megarefit.online.store.rendezvous import Rendezvous
from megarefit.online.trainer.publisher import Publisher

QWEN = tiny_config("Qwen3-0.6B", tie_word_embeddings=False)
_JOBS = itertools.count()
R0, R1 = RankCoord(0, 0, 0), RankCoord(1, 0, 0)


def _oracle(shards: dict, like: dict[str, torch.Tensor], cfg: dict, tp: int) -> dict[str, torch.Tensor]:
    """The HF tensors the trainers' shards ``{(tp, pp, ep): {megatron name: tensor}}`` are (reference sharder)."""
    return unshard(shards, like, lambda hf: reference_shards(hf, cfg, tp=tp, pp=1))


def _delta_receiver(rdzv: Rendezvous, name: str) -> RefitReceiver:
    """A delta receiver whose cost model has fixed rates (a delta wherever it reads fewer bytes)."""
    rx = RefitReceiver(rdzv, name=name, timeout=20)
    rx.delta_model.rates.update(wire=8e9, delta_wire=8e9, scatter=1e9)
    rx.delta_model.learn = False
    return rx


def _change(params: dict[str, torch.Tensor], seed: int, write=None) -> None:
    """About 2 % of every tensor's elements get new bits (``write(param, flat values)``: how),
    drawn by the tensor's name and ``seed`` (the TP ranks' copies of a replicated one stay equal)."""
    for name, t in params.items():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + seed)
        flat = t.detach().reshape(-1)
        idx = torch.randint(flat.numel(), (max(1, flat.numel() // 50),), generator=g).unique()
        new = flat.clone()
        bits = new.view(BITS[t.element_size()])
        bits[idx] = bits[idx] ^ 1 ^ (1 << 12)
        if write is None:
            flat.copy_(new)
        else:
            write(t, new)


def _pull_and_check(rx: RefitReceiver, pubs: list[Publisher], v: int) -> dict[str, torch.Tensor]:
    got = {n: t.clone() for n, t in rx.run_refit_cycle(v)}
    want = _oracle({tuple(p.rank)[:3]: p.params for p in pubs}, got, QWEN, tp=2)
    differ = [n for n in want if not torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))]
    assert differ == [], f"v{v}: {len(differ)} tensors differ from the trainers' weights, e.g. {differ[:3]}"
    return got


def _publishers(job: str, rdzv: Rendezvous, tracker: ChangeTracker | None = None) -> list[Publisher]:
    shards = reference_shards(reference_hf_state(QWEN, "qwen3", seed=3), QWEN, tp=2, pp=1)
    pubs = []
    for r, s in shards.items():
        params = {n: t.clone() for n, t in s.items()}
        if tracker is not None:
            tracker.watch(list(params.values()), names=list(params))
        pubs.append(Publisher(params, QWEN, rank=r, layout=source_layout(QWEN, tp=2, pp=1), rendezvous=rdzv,
                              agent_name=f"{job}-t{r[0]}", delta=DeltaOptions(keep=2, capacity=1.0),
                              tracker=tracker))
    return pubs


def _publish(pubs: list[Publisher], v: int) -> None:
    for p in pubs:
        p.publish(v)


def test_a_moved_rank_refits_as_a_delta_and_only_its_requests_are_prepared_again():
    """Mirrored delta publishers (tp 2): version 2 is a warm delta. Then rank 0's parameters come
    back as new tensor objects at new addresses (``params_moved(params=...)``, as after
    ``model.to``; the old memory stays taken), both ranks change 2 % of their elements and
    publish version 3: the delta receiver's cycle is a delta (its base v2, exact against the
    trainers' weights); a full receiver (``delta=False``) pulls it exactly too and prepared READ
    requests again for rank 0 only, rank 1's kept. Version 4 after a move of rank 1 only: the same
    for rank 1."""
    job = f"moved-delta-{next(_JOBS)}"
    rdzv = Rendezvous.serve(job=job)
    pubs = _publishers(job, rdzv)
    rx = _delta_receiver(rdzv, f"{job}-rx")
    full = RefitReceiver(rdzv, name=f"{job}-full", timeout=20, delta=False)
    hold = []
    try:
        for v in (1, 2):
            if v == 2:
                for p in pubs:
                    _change(p.params, seed=2)
            _publish(pubs, v)
            _pull_and_check(rx, pubs, v)
            _pull_and_check(full, pubs, v)
        assert rx.stats.refit == "delta", rx.stats.delta_reason
        for v, mover in ((3, 0), (4, 1)):
            before = dict(full.transport.rank_prepares)
            pub = pubs[mover]
            hold.append(pub.params)
            stats = pub.params_moved(params={n: t.clone() for n, t in pub.params.items()})
            assert stats.republished and len(stats.moved) == len(pub.params)
            assert all(pub.params[n].data_ptr() != t.data_ptr() for n, t in hold[-1].items())
            for p in pubs:
                _change(p.params, seed=v)
            _publish(pubs, v)
            _pull_and_check(rx, pubs, v)
            s = rx.stats
            assert s.refit == "delta" and s.delta_base == v - 1, (s.refit, s.delta_reason)
            _pull_and_check(full, pubs, v)
            after = dict(full.transport.rank_prepares)
            moved, kept = (R0, R1) if mover == 0 else (R1, R0)
            assert after[moved] == before[moved] + 1 and after[kept] == before[kept], (before, after)
        assert full.counters["plans_built"] == 1
    finally:
        rx.close()
        full.close()
    del hold


@pytest.mark.megatron
def test_megatron_tracked_delta_publisher_follows_verl_offload():
    """Real Megatron-Core (2 data-parallel processes, gloo, bf16 Adam, ``DistributedOptimizer``,
    its changes tracked by ``track_changes``; rank 0 serves every tensor from the tracker, no
    mirror): versions 3 and 4 follow verl's offload of every DDP parameter buffer (storage resized
    to 0, re-allocated elsewhere, refilled), declared with ``pub.moving()``, and a real step. Each
    version's delta receiver cycle after the first is a delta, its bytes equal the trainer's
    weights through the reference sharder and a full receiver's pull, bit for bit; every publish
    recorded a delta (the tracker re-indexed the moved parameters, their marks kept)."""
    pytest.importorskip("megatron.core")
    from moved_jobs import moved_delta_job

    from megarefit.demo.workers import start_workers

    job = "moved-delta-megatron"
    cfg = tiny_config("Qwen3-0.6B", num_hidden_layers=2, tie_word_embeddings=False)
    moves = [False, True, True]
    rdzv = Rendezvous.serve(job=job)
    workers = start_workers(moved_delta_job, world_size=2, args=(rdzv.port, job, cfg, moves))
    rx = RefitReceiver(rdzv, name=f"{job}-delta", timeout=120)
    rx.delta_model.rates.update(wire=8e9, delta_wire=8e9, scatter=1e9)
    rx.delta_model.learn = False
    full = RefitReceiver(rdzv, name=f"{job}-full", timeout=120, delta=False)
    pulls, kinds = {}, []
    try:
        for v in range(1, len(moves) + 2):
            pulls[v] = {n: t.clone() for n, t in rx.run_refit_cycle(v)}
            kinds.append((rx.stats.refit, rx.stats.delta_reason, rx.stats.bytes_moved))
            want = dict(full.run_refit_cycle(v))
            assert all(torch.equal(pulls[v][n].view(torch.uint8), want[n].view(torch.uint8)) for n in want), v
            rdzv.store.set(f"{rdzv.prefix}pulled/{v}", "1")
    except Exception:
        for v in range(1, len(moves) + 2):
            rdzv.store.set(f"{rdzv.prefix}pulled/{v}", "1")
        workers.join(timeout=60)  # a trainer's failure, if there is one, is what to report
        raise
    else:
        results = workers.join(timeout=300)
    finally:
        rx.close()
        full.close()
    first = next(r for r in results if r["rank"] == 0)
    for v, got in pulls.items():
        want = _oracle({(0, 0, 0): first["params"][v]}, got, cfg, tp=1)
        differ = [n for n in want if not torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))]
        assert differ == [], f"v{v}: {len(differ)} tensors differ from the trainer's weights, e.g. {differ[:3]}"
    assert kinds[0][0] == "full" and all(k == "delta" for k, *_ in kinds[1:]), kinds
    assert first["tracked"][0] == first["tracked"][1] > 0  # every served tensor from the tracker
    assert all(recorded and changed for recorded, changed, _ in first["deltas"]), first["deltas"]
    for addresses in first["addresses"]:
        assert addresses and all(old != new for old, new in addresses), addresses
    assert all(moved == served and republished for moved, served, republished in first["moves"]), first["moves"]


def test_a_move_the_tracker_cannot_follow_is_refused_naming_rank_tensor_and_fix():
    """Publishers whose changes come from a tracker (every tensor watched, written through
    ``tracker.copy_``): a move that hands the Publisher new tensor objects the optimizer does not
    write (``params=`` clones) is refused, naming the rank, a tensor and the fix; nothing changed
    (the Publisher still serves its tensors, same manifest), the rank stays marked writing until
    the tensors are back and the next version refits as a delta, exactly."""
    job = f"moved-delta-refused-{next(_JOBS)}"
    rdzv = Rendezvous.serve(job=job)
    tracker = ChangeTracker()
    pubs = _publishers(job, rdzv, tracker)
    rx = _delta_receiver(rdzv, f"{job}-rx")
    try:
        _publish(pubs, 1)
        _pull_and_check(rx, pubs, 1)
        pub = pubs[0]
        assert pub.delta.tracked == len(pub.delta.served)
        served, manifest = list(pub.delta.served), pub.manifest
        with pytest.raises(MegarefitError) as err:
            pub.params_moved(params={n: t.clone() for n, t in pub.params.items()})
        msg = str(err.value)
        assert "rank (0, 0, 0)" in msg and "no longer tracks" in msg and "track_changes()" in msg, msg
        assert any(n in msg for n in pub.params), msg
        assert pub.manifest is manifest and all(a is b for a, b in zip(pub.delta.served, served))
        assert pub.writing
        for p in pubs:
            _change(p.params, seed=5, write=lambda t, new: tracker.copy_(t, new))
        _publish(pubs, 2)
        _pull_and_check(rx, pubs, 2)
        assert rx.stats.refit == "delta", rx.stats.delta_reason
    finally:
        rx.close()
