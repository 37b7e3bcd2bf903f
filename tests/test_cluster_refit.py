"""A refit across the nodes of an emulated cluster (tests/cluster.py, tests/cluster_refit.py).

Real Megatron-Core trainers on CPU (gloo across nodes, data-parallel 2 x TP 2, one node each),
the rendezvous store bound to its own node's address, four RefitReceivers on four more nodes,
NIXL over UCX TCP on 300 Mbit veths. Every received byte equals the independent reference
sharder's unsharding (tests/reference.py) of the trainers' own snapshots. Every data-parallel
copy serving, the bytes spread over every trainer veth within 10% of the mean; with only copy 0
serving, they cross copy 0's veths alone; the cycle takes about the busiest veth's bytes over its
rate. A straggler (one copy's NIC at 1/8 of the rate): the cycle takes its bytes over its rate,
the other copy's readers are not slowed; at 1/32, its READs past the receivers' transfer timeout:
failed over to the other copy once the READs in flight from it finished (a released READ
still lands later), bytes exact; docs/multinode.md. Faults: a copy SIGKILLed or its link set down mid-pull: the receivers that read from it
fail over to the other copy and complete, bytes exact (``stats.failovers`` names it); with no
other holder (copy 0 alone serving), a clear error within the receivers' timeout, never a hang,
never a version handed on. (No ``netem`` on this kernel: loss and delay are not emulated.)
"""

from __future__ import annotations

import functools
import re
import time

import pytest
import torch

pytest.importorskip("nixl")
pytest.importorskip("megatron.core")

from cluster_refit import refit_on_cluster
from reference import reference_hf_state, reference_shards, unshard

pytestmark = pytest.mark.megatron

RATE_MBIT = 300.0
DP, TP, RECEIVERS, VERSIONS = 2, 2, 4, 3


@pytest.fixture(scope="module")
def run():
    return refit_on_cluster(dp=DP, tp=TP, receivers=RECEIVERS, versions=VERSIONS, rate_mbit=RATE_MBIT)


@pytest.fixture(scope="module")
def one_copy():
    return refit_on_cluster(dp=DP, tp=TP, receivers=RECEIVERS, versions=2, rate_mbit=RATE_MBIT, every_copy=False)


def oracle(run, v: int, copy: int = 0) -> dict[str, torch.Tensor]:
    """The HF tensors of version ``v``, from the trainers' own snapshots (copy ``copy``'s, as saved
    before publishing) by the reference sharder."""
    snaps = {c[:3]: s for c, s in run.snapshots[v].items() if (c[3] if len(c) > 3 else 0) == copy}
    dtype = next(iter(snaps[(0, 0, 0)].values())).dtype
    shard = functools.partial(reference_shards, cfg=run.case.hf_config, tp=TP, pp=1)
    return unshard(snaps, reference_hf_state(run.case.hf_config, "qwen3", dtype=dtype), shard)


def test_every_received_byte_equals_the_oracle(run):
    for v in range(1, VERSIONS + 1):
        want = oracle(run, v)
        assert all(torch.equal(oracle(run, v, copy=1)[n], t) for n, t in want.items())  # the copies agree
        for r in run.receivers:
            assert r["received"][v].keys() == want.keys()
            for name, tensor in want.items():
                assert torch.equal(r["received"][v][name], tensor), (v, name)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(run.receivers[0]["received"][1][name], run.receivers[0]["received"][2][name])


def test_every_copy_serving_the_bytes_spread_over_every_trainer_veth(run):
    pulled = sum(sum(r["bytes"].values()) for r in run.receivers)  # every receiver, every version
    tx = run.trainer_tx()
    assert pulled <= sum(tx.values()) <= pulled * 1.1, (tx, pulled)
    mean = sum(tx.values()) / len(tx)
    assert all(abs(b - mean) <= 0.10 * mean for b in tx.values()), tx


def test_one_copy_serving_the_bytes_cross_copy_0s_veths(one_copy):
    run = one_copy
    want = oracle(run, 2)
    assert all(torch.equal(r["received"][2][n], t) for r in run.receivers for n, t in want.items())
    pulled = sum(sum(r["bytes"].values()) for r in run.receivers)  # every receiver, every version
    tx = run.trainer_tx()
    serving = {f"t{i}" for i in range(TP)}  # data-parallel copy 0 (Megatron puts TP ranks first)
    # today only copy 0 serves: its two NICs carry every byte, copy 1's nothing (but gloo's few kB)
    assert pulled <= sum(tx[n] for n in serving) <= pulled * 1.1, (tx, pulled)
    assert all(tx[n] < 200_000 for n in tx if n not in serving), tx
    assert max(tx[n] for n in serving) < 1.15 * min(tx[n] for n in serving), tx
    for i, r in enumerate(run.receivers):
        assert sum(r["bytes"].values()) <= run.moved[f"r{i}"]["rx_bytes"] <= sum(r["bytes"].values()) * 1.1


def test_a_cycle_takes_about_the_busiest_veths_bytes_over_its_rate(run):
    busiest = max(run.trainer_tx().values()) / VERSIONS  # bytes per cycle
    floor_s = busiest / (RATE_MBIT * 1e6 / 8)
    for s in run.warm_cycles():
        assert 0.9 * floor_s < s < 3.0 * floor_s, (s, floor_s)  # never faster than the link; loose above


def _when_pulling(c, threshold: int = 1 << 20, node: str = "r0", key: str = "rx_bytes") -> None:
    t0 = time.monotonic()
    while c[node].counters()[key] < threshold:
        assert time.monotonic() - t0 < 180, "the receivers never started pulling"
        time.sleep(0.02)


def _fails_within(fault, receiver_timeout: float = 15.0) -> tuple[str, float]:
    """Copy 0 alone serving (no other holder), ``fault`` mid-pull: the error and how long after."""
    marks = {}

    def during(c, groups):
        _when_pulling(c)
        fault(c, groups)
        marks["fault"] = time.monotonic()

    with pytest.raises(RuntimeError) as info:
        refit_on_cluster(dp=DP, tp=TP, receivers=2, versions=1, rate_mbit=15.0, receiver_timeout=receiver_timeout,
                         during=during, every_copy=False)
    return str(info.value), time.monotonic() - marks["fault"]


def _fails_over(fault):
    """Every copy serving, ``fault`` on copy 1 of tp rank 0 (node t2, at 5 Mbit: its share takes
    ~6 s) once t2 has sent 256 KiB more after the receivers started: mid-pull of its share, whatever the poll's delay. The run
    completes."""
    def during(c, groups):  # the receivers just started: t2's bytes from here on are theirs
        _when_pulling(c, c["t2"].counters()["tx_bytes"] + (1 << 18), node="t2", key="tx_bytes")
        fault(c, groups)

    return refit_on_cluster(dp=DP, tp=TP, receivers=2, versions=1, rate_mbit=15.0, receiver_timeout=10.0,
                            rates={"t2": 5.0}, during=during, trainers_may_die=True)


def test_a_link_down_mid_pull_fails_over_and_completes_exact():
    """t2's link set down mid-pull and left down. Where UCX ends its READs (an error) within the
    receivers' timeout and grace, they fail over; where the READs stay in flight (both seen on
    this machine: UCX decides), the arena and scratch they may still write are quarantined
    (transport/quarantine.py) and the failover pulls into fresh ones. Either way every byte is
    exact and ``stats.failovers`` names t2."""
    run = _fails_over(lambda c, groups: c["t2"].set_link(False))
    want = oracle(run, 1)
    for r in run.receivers:
        assert all(torch.equal(r["received"][1][n], t) for n, t in want.items())
    failed = [f for r in run.receivers for f in r["failovers"][1]]
    assert failed and all(tuple(rank) == (0, 0, 0, 1) for rank, _ in failed), failed


@pytest.mark.parametrize("fault", ["sigkill"])
def test_a_copy_that_fails_mid_pull_is_replaced_by_the_other(fault):
    run = _fails_over(lambda c, groups: groups["trainers"].kill(2))
    want = oracle(run, 1)
    for r in run.receivers:
        assert all(torch.equal(r["received"][1][n], t) for n, t in want.items())
    failed = [f for r in run.receivers for f in r["failovers"][1]]
    assert failed and all(tuple(rank) == (0, 0, 0, 1) and (0, 0, 0) in [tuple(x) for x in by] for rank, by in failed)


def test_a_serving_trainer_sigkilled_mid_pull_is_a_clear_error_within_the_timeout():
    err, after = _fails_within(lambda c, groups: groups["trainers"].kill(0))
    assert "TransferError" in err and "megarefit-trainer-0-0-0" in err, err
    assert after < 15.0 + 20.0


def test_a_serving_trainers_link_down_mid_pull_is_a_clear_error_within_the_timeout():
    err, after = _fails_within(lambda c, groups: c["t0"].set_link(False))
    assert "TransferError" in err and "megarefit-trainer-0-0-0" in err, err
    assert after < 15.0 + 20.0


STRAGGLER = "t2"  # data-parallel copy 1 of tp rank 0 (Megatron puts TP ranks first): rank (0, 0, 0, 1)


def _exact(run) -> None:
    for v in range(1, run.versions + 1):
        want = oracle(run, v)
        for r in run.receivers:
            assert r["received"][v].keys() == want.keys()
            assert all(torch.equal(r["received"][v][n], t) for n, t in want.items()), v


@pytest.mark.slow
def test_a_slow_nic_bounds_the_cycle_by_its_bytes_over_its_rate():
    """t2 at 1/8 of the others' rate: every cycle completes, bytes exact, in about t2's bytes over
    t2's rate (its veth counters); the receivers reading copy 0 pull at the full rate."""
    slow = RATE_MBIT / 8
    run = refit_on_cluster(dp=DP, tp=TP, receivers=RECEIVERS, versions=VERSIONS, rate_mbit=RATE_MBIT,
                           rates={STRAGGLER: slow})
    _exact(run)
    floor_s = run.trainer_tx()[STRAGGLER] / VERSIONS / (slow * 1e6 / 8)  # its bytes per cycle over its rate
    for s in run.warm_cycles():
        assert 0.9 * floor_s < s < 1.3 * floor_s, (s, floor_s)
    assert all(not r["failovers"][v] for r in run.receivers for v in r["failovers"])
    pulls = sorted(max(r["pull_s"][v] for v in range(2, VERSIONS + 1)) for r in run.receivers)
    assert pulls[RECEIVERS // 2 - 1] < 0.25 * floor_s < 0.5 * floor_s < pulls[RECEIVERS // 2], pulls  # half read copy 1


TRANSFER_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def too_slow():
    """t2 at 1/32 of the rate (its share of a cycle: ~6 s), the receivers' transfer timeout 2 s."""
    return refit_on_cluster(dp=DP, tp=TP, receivers=RECEIVERS, versions=VERSIONS, rate_mbit=RATE_MBIT,
                            rates={STRAGGLER: RATE_MBIT / 32}, transfer_timeout=TRANSFER_TIMEOUT)


@pytest.mark.slow
def test_a_nic_too_slow_for_the_transfer_timeout_fails_over_to_the_other_copy(too_slow):
    """t2's READs are not done within the transfer timeout: the share goes to the other holders
    once the READs already in flight from t2 have finished (a released READ would still land in
    the buffers the failover reuses: ``NixlTransport.wait``'s grace), ``stats.failovers`` names t2;
    later cycles read t2 no more and pull at the full rate."""
    run = too_slow
    failed = [f for r in run.receivers for f in r["failovers"][1]]
    assert len(failed) == RECEIVERS // 2, failed  # every receiver that read copy 1
    assert all(tuple(rank) == (0, 0, 0, 1) and (0, 0, 0) in [tuple(x) for x in by] for rank, by in failed), failed
    normal_s = max(r["pull_s"][v] for r in run.receivers for v in range(2, VERSIONS + 1))
    assert normal_s < 0.5 * TRANSFER_TIMEOUT, normal_s  # no later pull waits on t2 (its share: ~6 s)
    share_s = run.trainer_tx()[STRAGGLER] / (RATE_MBIT / 32 * 1e6 / 8)  # t2's bytes over its rate
    assert TRANSFER_TIMEOUT < run.cycle_s(1) < share_s + 1.0 + 2 * normal_s, (run.cycle_s(1), share_s)
    assert all(not r["failovers"][v] for r in run.receivers for v in range(2, VERSIONS + 1))
    share = run.trainer_tx()["t3"] / VERSIONS  # what a copy-1 rank serves a cycle, t2's share had it kept up
    assert run.trainer_tx()[STRAGGLER] < 1.2 * share, (run.trainer_tx(), share)  # asked no more after version 1


@pytest.mark.slow
def test_reads_still_in_flight_after_the_grace_are_quarantined_and_the_failover_is_exact():
    """t2 at 1/256 of the rate (its share: ~26 s), the transfer timeout 2 s and the grace (the
    receivers' timeout) 5 s: t2's READs are still in flight when the receivers fail over. Their
    arena and scratch are held (``stats.quarantined_bytes``) and the failover pulls into fresh
    ones: every byte exact, while t2's late READs land in the held memory. (One version: a second
    would wait on the slowed receiver's acknowledgement longer than the other's 5 s timeout.)"""
    run = refit_on_cluster(dp=DP, tp=TP, receivers=2, versions=1, rate_mbit=RATE_MBIT,
                           rates={STRAGGLER: RATE_MBIT / 256}, transfer_timeout=TRANSFER_TIMEOUT, receiver_timeout=5.0)
    _exact(run)
    readers = [r for r in run.receivers if r["failovers"][1]]
    assert len(readers) == 1 and tuple(readers[0]["failovers"][1][0][0]) == (0, 0, 0, 1), run.receivers  # t2's
    ever, at_end = readers[0]["quarantined"][1]
    assert ever > 0 and at_end == ever, readers[0]["quarantined"]  # t2's READs still ran when the cycle ended
    other = next(r for r in run.receivers if r is not readers[0])
    # fresh memory: the failover registered an arena and scratch again, as large as the other receiver's one set
    assert readers[0]["registered"][1][0] == 2 * other["registered"][1][0], (readers[0]["registered"], other["registered"])
    assert all(r["quarantined"][1] == (0, 0) for r in run.receivers if r is not readers[0])


@pytest.mark.slow
def test_after_a_transfer_timeout_failover_every_byte_equals_the_oracle(too_slow):
    """A released READ still lands later (tests/test_cluster.py::
    test_a_read_released_after_its_timeout_still_lands_once_the_worker_progresses): the failover
    waits for the READs in flight first, so none lands in memory it reuses."""
    _exact(too_slow)
