"""Authenticated rendezvous records: a process that knows the port but not the job secret can
neither publish weights nor move versions; an unsigned, forged or replayed record is a named
error before any pull; malformed manifests are named errors, never crashes (hypothesis)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("nixl")

from reference import reference_hf_state, reference_shards  # noqa: E402

from megarefit.errors import MegarefitError  # noqa: E402
from megarefit.layout.megatron_model import source_layout  # noqa: E402
from megarefit.online.receiver.arena import arena_key, publish_arena  # noqa: E402
from megarefit.online.receiver.node_copy import MateReader  # noqa: E402
from megarefit.online.receiver.replica_chunks import format_progress  # noqa: E402
from megarefit.online import RefitReceiver  # noqa: E402
from megarefit.online.store.rendezvous import SECRET_ENV, RecordAuthenticationError, Rendezvous  # noqa: E402
from megarefit.online.trainer.publisher import Publisher  # noqa: E402
from megarefit.transport.manifest import FORMAT, Manifest, ManifestError  # noqa: E402

_JOBS = iter(range(10**6))


@pytest.fixture
def job(config):
    """Two trainer ranks publishing version 1 under a job secret; a receiver of the same job."""
    cfg = config("Qwen3-0.6B")
    hf = reference_hf_state(cfg, "qwen3")
    shards = {r: {n: t.clone() for n, t in s.items()} for r, s in reference_shards(hf, cfg, tp=2, pp=1).items()}
    name = f"sec-{next(_JOBS)}"
    rdzv = Rendezvous.serve(job=name, secret="the-job-secret-of-this-test")
    pubs = [Publisher(s, cfg, rank=r, layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv,
                      agent_name=f"{name}-{r[0]}")
            for r, s in shards.items()]
    for p in pubs:
        p.publish(1)
    receiver = RefitReceiver(Rendezvous.connect("127.0.0.1", rdzv.port, job=name, secret="the-job-secret-of-this-test"),
                             name=f"{name}-rx", timeout=2, retries=0)
    yield hf, rdzv, pubs, receiver
    receiver.close()


def _intruder(rdzv: Rendezvous, secret: str = "a-guess-of-sixteen-bytes") -> Rendezvous:
    """A writer on the job's own store connection signing with another secret: what a record
    signed outside the job looks like (the store itself refuses connections without the secret)."""
    return Rendezvous(rdzv.store, rdzv.job, secret)


def test_forged_version_is_refused_before_any_pull(job):
    hf, rdzv, pubs, receiver = job
    assert dict(receiver.run_refit_cycle(1)).keys() == hf.keys()
    posts = receiver.counters["posts"]
    intruder = _intruder(rdzv)
    for p in pubs:
        intruder.publish_version(p.rank, 99)  # the attack of the issue: "version 99" for every rank
    # its publish also rewrites the copy's write marker (copy_fence), which a warm fence reads first
    with pytest.raises(RecordAuthenticationError, match=r"(version/0\.0\.0|writes/0)' has a wrong signature: "
                                                        r"written with another job secret, or forged"):
        dict(receiver.run_refit_cycle())
    assert receiver.counters["posts"] == posts  # nothing was read
    for p in pubs:  # the trainers publish again: the job goes on
        p.publish(2)
    got = dict(receiver.run_refit_cycle(2))
    assert receiver.stats.version == 2 and all(torch.equal(got[k], hf[k]) for k in hf)


def test_forged_manifest_is_refused(job):
    hf, rdzv, pubs, receiver = job
    forged = dataclasses.replace(pubs[0].manifest, agent="attacker-agent")
    _intruder(rdzv).publish_manifest(forged, b"attacker metadata")
    with pytest.raises(RecordAuthenticationError, match=r"(nixl|manifest|generation)/0\.0\.0' has a wrong signature"):
        dict(receiver.run_refit_cycle(1))


def test_unsigned_record_is_refused(job):
    hf, rdzv, pubs, receiver = job
    rdzv.store.set(rdzv.prefix + "version/1.0.0", "1")  # a plain TCPStore write, as before signing
    with pytest.raises(RecordAuthenticationError, match=r"version/1\.0\.0' is not a signed megarefit record"):
        dict(receiver.run_refit_cycle(1))


@pytest.mark.parametrize("keys", [("version/0.0.0",), ("writes/0", "fence/0")], ids=["rank-record", "copy-record"])
def test_replayed_record_is_refused(job, keys):
    """A record of version 1 written again after the receiver read version 2's: a rank's own
    (read where the copy's fence record is missing) or the copy's fence record and marker."""
    hf, rdzv, pubs, receiver = job
    dict(receiver.run_refit_cycle(1))
    old = {k: rdzv.store.get(rdzv.prefix + k) for k in keys}  # version 1, correctly signed
    for p in pubs:
        p.publish(2)
    if "fence/0" not in keys:  # without the copy's record every cycle reads each rank's
        assert rdzv.store.delete_key(rdzv.prefix + "fence/0")
    dict(receiver.run_refit_cycle(2))
    for k, record in old.items():
        rdzv.store.set(rdzv.prefix + k, record)  # written again by someone who kept it
    if keys[0] == "writes/0":  # a copy's marker has several writers, so no counter order: a fence record naming
        got = dict(receiver.run_refit_cycle())  # a version older than one read sends the fence to each rank's records
        assert receiver.stats.version == 2 and all(torch.equal(got[k], hf[k]) for k in hf)
        return
    with pytest.raises(RecordAuthenticationError, match=rf"{keys[0]}' is older than one already read"):
        dict(receiver.run_refit_cycle())


def test_a_connecting_side_needs_the_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.warns(UserWarning, match=r"no job secret given: generated one \(Rendezvous.secret\)"):
        rdzv = Rendezvous.serve(job="sec-generated")
    with pytest.raises(MegarefitError, match=rf"no job secret: pass secret= .* or set {SECRET_ENV}"):
        Rendezvous.connect("127.0.0.1", rdzv.port, job="sec-generated")
    peer = Rendezvous.connect("127.0.0.1", rdzv.port, job="sec-generated", secret=rdzv.secret)
    rdzv.mark_consumed(3)
    peer.wait_consumed(3, timeout=5)  # the generated secret, handed over, works
    with pytest.raises(RecordAuthenticationError, match="wrong signature"):
        _intruder(rdzv).wait_consumed(3, timeout=5)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_a_named_error_or_a_record(record):
    rdzv = Rendezvous(None, "fuzz", "fuzz-secret-of-this-test")  # type: ignore[arg-type] - unseal needs no store
    with pytest.raises(RecordAuthenticationError):
        rdzv.unseal("megarefit/fuzz/version/0.0.0", record)


def _valid_manifest() -> dict:
    from conftest import tiny_config

    from megarefit.layout import SourceLayout
    from megarefit.layout.dims import ModelDims
    from megarefit.transport.manifest import TensorEntry

    dims = ModelDims.from_hf_config(tiny_config("Qwen3-0.6B"))
    layout = SourceLayout.build(tp=1, pp=1, padded_vocab_size=dims.padded_vocab_size(1), num_layers=dims.num_layers)
    entry = TensorEntry("embedding.word_embeddings.weight", "vocab", "bfloat16", (256, 64), (256, 64), 4096,
                        256 * 64 * 2, "DRAM", 0, 4096)
    from megarefit.layout import RankCoord

    return json.loads(Manifest(RankCoord(0, 0, 0), dims, layout, "agent", (entry,)).to_json())


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["tensors", "rank", "dims", "layout", "agent", "quantization", "checksums", "ipc", "format"]),
       _JSON, st.integers(0, 9))
def test_malformed_manifests_are_named_errors(field, value, column):
    data = _valid_manifest()
    if field == "tensors" and isinstance(value, (int, str)) and value is not None:
        row = list(data["tensors"][0])
        row[column] = value  # one wrong field of a tensor row: a type, a negative size, a huge shape
        data["tensors"] = [row]
    else:
        data[field] = value
    text = json.dumps(data)
    try:
        parsed = Manifest.from_json(text)
    except ManifestError as exc:  # a named error, in one line, never a traceback of another type
        assert str(exc)
        return
    # accepted: only a value the manifest can stand behind, i.e. one that survives its own round trip
    assert field != "format", value
    assert Manifest.from_json(parsed.to_json()) == parsed


@pytest.mark.parametrize("column,value,match", [
    (3, [2**30, 2**30], "more than 2\\*\\*48 elements"),
    (3, [-1, 64], "non-negative integer"),
    (6, 7, "7 bytes, but shape"),
    (5, -4096, "address must be a non-negative integer"),
    (2, "complex64", "unknown dtype"),
])
def test_manifest_sizes_are_checked_before_use(column, value, match):
    data = _valid_manifest()
    data["tensors"][0][column] = value
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(json.dumps(data))
    assert Manifest.from_json(json.dumps(_valid_manifest())).format == FORMAT


def test_the_store_listens_only_where_asked_and_only_to_the_job():
    """Served on 127.0.0.1: another local address of this machine (127.0.0.2) is refused, and a
    process with the port but another secret cannot even connect (so it reads nothing)."""
    import socket

    from megarefit.online.store.kv import StoreError

    rdzv = Rendezvous.serve(job="sec-bind", secret="bind-secret-of-this-test")
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.2", rdzv.port))
    with pytest.raises(StoreError, match=rf"rendezvous at 127\.0\.0\.1:{rdzv.port} refused this process: wrong job secret"):
        Rendezvous.connect("127.0.0.1", rdzv.port, job="sec-bind", secret="a-guess-of-sixteen-bytes")
    rdzv.mark_consumed(1)
    Rendezvous.connect("127.0.0.1", rdzv.port, job="sec-bind", secret="bind-secret-of-this-test").wait_consumed(1, timeout=5)


def test_a_forged_progress_record_is_refused(job):
    """A node-mate's (or cut-through replica's) progress record says how far its arena landed:
    one signed with another secret, claiming every byte landed, is refused before any READ."""
    hf, rdzv, pubs, receiver = job
    arena = torch.zeros(4)
    publish_arena(rdzv, "node-g", "mate", {"float32": arena}, [("w", "float32", 0, (4,))], 1, b"metadata")
    _intruder(rdzv).put(arena_key("progress", "node-g", "mate"), format_progress(0, 1 << 40))
    reader = MateReader(rdzv, receiver.transport.nixl, group="node-g", mate="mate", timeout=2)
    t0 = time.monotonic()
    with pytest.raises(RecordAuthenticationError, match="progress/node-g/mate' has a wrong signature"):
        reader.read_targets([("w", "float32", 16, 0)], {"float32": torch.zeros(4)}, 1)
    assert time.monotonic() - t0 < 2 and receiver.counters.get("posts", 0) == 0
