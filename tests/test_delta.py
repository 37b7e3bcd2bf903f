"""Delta refits over real NIXL (UCX loopback): trainers publish only the elements that changed,
a staged receiver holding the previous version patches its arena with them.

Oracles, none of them the delta path itself:

* a second receiver of the same trainers with ``delta=False`` (a full pull through the
  prepared-plan READs): after every delta cycle the two hold the same bytes, bit for bit;
* :class:`~megarefit.transport.local.LocalTransport` running each plan op on unique-valued
  sources: :func:`map_through` must send every source element where that copy put it;
* the trainers' checksums (``verify_checksums``) over the patched arena.

Layouts: dense tp=2; Qwen3-MoE tp=2 ep=2 etp=1 with legacy GroupedMLP experts (viewed and
transposed ops) to HF tensors and to a vLLM tp=2 worker with expert parallelism; block FP8
served by the trainers (FP8 bytes and float32 scales patched).
"""

from __future__ import annotations

import re

import gc
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("nixl")

from conftest import tiny_config  # noqa: E402
from moe_cases import megatron_shards, moe_config  # noqa: E402
from reference import hf_checkpoint_state, reference_hf_state, reference_shards  # noqa: E402

from megarefit import ModelDims, SourceLayout  # noqa: E402
from megarefit.layout.megatron_model import source_layout  # noqa: E402
from megarefit.online.delta import apply as delta_apply  # noqa: E402
from megarefit.online.delta import held
from megarefit.online.delta.apply import map_through, segment_elements  # noqa: E402
from megarefit.online.delta.log import BITS, DeltaOptions, RepublishError, pack_bitmap, pack_paged  # noqa: E402
from megarefit.online.delta.records import (  # noqa: E402
    BITMAP,
    INDICES,
    PAGED,
    DeltaRecord,
    DeltaRecordError,
    DeltaSegment,
    best_format,
    decode_record,
    delta_key,
    epoch_key,
    mask_bytes,
    segment_bytes,
)
from megarefit.online.delta.track import ChangeTracker  # noqa: E402
from megarefit.online.receiver.cycle import StaleVersionError  # noqa: E402
from megarefit.online.receiver.receiver import RefitReceiver  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous  # noqa: E402
from megarefit.online.trainer.publisher import Publisher, VersionOrderError  # noqa: E402
from megarefit.plan import Plan  # noqa: E402
from megarefit.targets import VllmTarget  # noqa: E402
from megarefit.transport.checksum import ChecksumMismatchError  # noqa: E402
from megarefit.transport.local import LocalTransport  # noqa: E402
from megarefit.transport.manifest import TensorEntry  # noqa: E402
from megarefit.transport.nixl_agent import TransferError  # noqa: E402

_JOBS = itertools.count()


@dataclass
class Trainer:
    """Publishers of one model in this process, a delta receiver and a full (reference) one."""

    params: dict[tuple, dict[str, torch.Tensor]]
    pubs: list[Publisher]
    rdzv: Rendezvous
    kind: str = ""
    version: int = 0
    receivers: dict[str, RefitReceiver] = field(default_factory=dict)

    def receiver(self, name: str, **kw) -> RefitReceiver:
        """A receiver of these trainers whose cost model has fixed rates: a changed element costs
        8 bytes' worth, so which tensors are patched does not depend on this machine's speed."""
        if name not in self.receivers:
            rx = RefitReceiver(self.rdzv, name=f"{self.rdzv.job}-{name}", timeout=20, **kw)
            rx.delta_model.rates.update(wire=8e9, delta_wire=8e9, scatter=1e9)
            rx.delta_model.learn = False
            self.receivers[name] = rx
        return self.receivers[name]

    def publish(self) -> int:
        self.version += 1
        for p in self.pubs:
            p.publish(self.version)
        return self.version

    def change(self, density: float | str, seed: int, edges: bool = True) -> None:
        """Scale about ``density`` of every parameter's elements (drawn at random) by 1 + 2**-5 (a
        bf16 step), and flip the lowest bit of those that stay the same (zeros, such as vocab
        padding); ``"mixed"``: every other parameter 0.9, the rest 0.001. ``edges``: also at the
        edges of every receiver's plan (:func:`plan_edges`)."""
        g = torch.Generator().manual_seed(seed)
        at_edges = plan_edges([rx.plan for rx in self.receivers.values() if rx.plan is not None], g) if edges else {}
        for rank, shard in self.params.items():
            for k, (name, t) in enumerate(shard.items()):
                d = (0.9 if k % 2 else 0.001) if density == "mixed" else density
                flat = t.view(-1)
                idx = torch.randint(flat.numel(), (max(1, int(d * flat.numel())),), generator=g)
                idx = torch.cat([idx, at_edges.get((rank, name), idx[:0])]).unique()
                old = flat[idx].view(BITS[t.element_size()])
                new = (flat[idx] * (1 + 2 ** -5)).view(BITS[t.element_size()])
                new[new == old] ^= 1
                flat.view(BITS[t.element_size()])[idx] = new

    def step(self, density: float, seed: int) -> int:
        self.change(density, seed)
        return self.publish()


def _flat(box_at: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """The row-major flat index of coordinates ``box_at`` in ``shape`` (numpy's, not megarefit's)."""
    return int(np.ravel_multi_index(box_at, shape))


def plan_edges(plans: list[Plan], g: torch.Generator, unread: int = 8) -> dict[tuple, torch.Tensor]:
    """Where a trainer's change is most likely to be misplaced, per source ``(rank, name)``: the
    first and last element of every op's source box and the element after it, and up to
    ``unread`` elements no op reads (vocab padding rows), the first of them included."""
    out: dict[tuple, set[int]] = {}
    for plan in plans:
        read: dict[tuple, torch.Tensor] = {}
        for op in plan.ops:
            meta = plan.sources[op.src]
            shape = op.src_view or meta.shape
            box = op.src_box
            first = _flat(box.offsets, shape)
            last = _flat(tuple(o + n - 1 for o, n in zip(box.offsets, box.lengths)), shape)
            key = (tuple(op.src.rank), op.src.name)
            out.setdefault(key, set()).update(i for i in (first, last, last + 1) if i < meta.numel)
            mask = read.setdefault(key, torch.zeros(meta.numel, dtype=torch.bool))
            mask.view(shape)[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))] = True
        for key, mask in read.items():
            free = (~mask).nonzero().view(-1)
            if free.numel():
                pick = free[torch.randperm(free.numel(), generator=g)[:unread]]
                out[key].update([int(free[0])] + pick.tolist())
    return {k: torch.tensor(sorted(v), dtype=torch.int64) for k, v in out.items()}


def pulled(receiver: RefitReceiver, version: int | None) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in receiver.run_refit_cycle(version)}


def assert_same_bytes(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(got[name].view(torch.uint8), w.view(torch.uint8)), name


def _dense(job: str, delta) -> Trainer:
    cfg = tiny_config("Llama-3.1-8B")
    hf = {k: v.to(torch.bfloat16) for k, v in reference_hf_state(cfg, "llama").items()}
    shards = reference_shards(hf, cfg, tp=2, pp=1)
    rdzv = Rendezvous.serve(job=job)
    params = {r: {n: t.clone() for n, t in s.items()} for r, s in shards.items()}
    pubs = [Publisher(params[r], cfg, rank=r, layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv,
                      agent_name=f"{job}-t{r[0]}", delta=delta, checksums=True) for r in params]
    return Trainer(params, pubs, rdzv)


def _moe(job: str, delta, *, fp8: bool = False, tmp=None) -> Trainer:
    if fp8:
        cfg = moe_config("Qwen3-30B-A3B", hidden_size=256, head_dim=128, moe_intermediate_size=256,
                         intermediate_size=512)
        expert_layout = "te_grouped"
    else:
        cfg, expert_layout = moe_config("Qwen3-30B-A3B"), "legacy_grouped"
    hf = {k: v.to(torch.bfloat16) for k, v in hf_checkpoint_state(cfg, tmp, seed=3).items()}
    shards = megatron_shards(hf, cfg, "qwen3_moe", 2, 2, 1, expert_layout, "local")
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=2, pp=1, ep=2, etp=1, padded_vocab_size=dims.padded_vocab_size(2),
                                num_layers=dims.num_layers, expert_layout=expert_layout)
    rdzv = Rendezvous.serve(job=job)
    params = {tuple(r): {n: t.clone() for n, t in shards[tuple(r)].items()} for r in layout.ranks()}
    pubs = [Publisher(params[r], cfg, rank=r, layout=layout, rendezvous=rdzv, agent_name=f"{job}-t{r[0]}{r[2]}",
                      delta=delta, quantization="fp8" if fp8 else None) for r in params]
    return Trainer(params, pubs, rdzv)


ROOMY = DeltaOptions(keep=2, capacity=1.0)  # slots that hold even half the elements changed
KINDS: dict[str, Callable[..., Trainer]] = {
    "dense-tp2": lambda job, tmp: _dense(job, ROOMY),
    "moe-grouped-ep2": lambda job, tmp: _moe(job, ROOMY, tmp=tmp),
    "fp8-served": lambda job, tmp: _moe(job, ROOMY, fp8=True, tmp=tmp),
}
TARGETS = {  # receivers of each trainer: full HF tensors, and a vLLM tp=2 worker with expert parallelism
    "dense-tp2": {"hf": None},
    "moe-grouped-ep2": {"hf": None, "vllm-ep": VllmTarget(2, 1, expert_parallel=True)},
    "fp8-served": {"hf": None},
}


def _stop(tr: Trainer) -> None:
    """Close the receivers and drop every NIXL agent (their progress threads poll a core each)."""
    for rx in tr.receivers.values():
        rx.close()
    tr.receivers.clear()
    tr.pubs.clear()
    gc.collect()


@pytest.fixture(scope="module", params=sorted(KINDS))
def trainer(request, tmp_path_factory):
    """One trainer at a time (module scope, one parameter after the other), its receivers
    holding its first version whole."""
    tr = KINDS[request.param](f"delta-{request.param}", tmp_path_factory.mktemp(request.param))
    tr.kind = request.param
    tr.publish()
    for name, target in TARGETS[request.param].items():
        pulled(tr.receiver(name, target=target), tr.version)
    yield tr
    _stop(tr)


@pytest.fixture
def dense():
    tr = _dense(f"delta-dense-{next(_JOBS)}", DeltaOptions(keep=2, capacity=1.0))
    tr.publish()
    pulled(tr.receiver("delta"), tr.version)
    yield tr
    _stop(tr)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(density=st.sampled_from([0.0005, 0.01, 0.05, "mixed", 0.9]), seed=st.integers(0, 2 ** 16),
       steps=st.integers(1, 2))
def test_delta_cycle_equals_full_pull(trainer, density, seed, steps):
    """Random sparse changes over one or two versions: each receiver's delta cycle leaves its
    arena equal to a full pull's, byte for byte; sparse changes move a fraction of the bytes,
    tensors with most elements changed are read whole, and a delta that costs more than the full
    pull is not used."""
    for k in range(steps):
        v = trainer.step(density, seed + k)
    for name, target in TARGETS[trainer.kind].items():
        rx = trainer.receiver(name, target=target)
        got = pulled(rx, v)
        want = pulled(trainer.receiver(f"{name}-full", target=target, delta=False), v)
        stats, full = rx.stats, trainer.receiver(f"{name}-full").stats
        assert_same_bytes(got, want)
        assert full.refit == "full"
        costlier = ("costs more than a full pull", "no tensor is cheaper to patch than to read whole")
        if density == 0.9:  # most elements changed: the whole delta costs more than the full pull
            assert stats.refit == "full" and any(why in stats.delta_reason for why in costlier), stats.delta_reason
            continue
        if density in ("mixed", 0.05) and stats.refit == "full":  # a worker's share: fewer bytes than the delta
            assert any(why in stats.delta_reason for why in costlier), stats.delta_reason  # of the tensors it reads
            continue
        assert (stats.refit, stats.delta_base) == ("delta", v - steps), stats.delta_reason
        if density == "mixed":  # tensors with most elements changed are read whole, the others patched
            assert stats.full_tensors > 0 and stats.delta_tensors > 0
        elif density <= 0.01:  # (a tensor of a few elements with one changed may still be read whole)
            assert stats.bytes_moved < 0.25 * full.bytes_moved and stats.delta_tensors > stats.full_tensors


def test_lost_versions_force_a_full_pull_then_deltas_resume(dense):
    """Trainers keep two versions' deltas: a receiver three versions behind pulls in full (and
    says why in stats); from there on it refits by deltas again."""
    tr = dense
    rx = tr.receiver("delta")
    base = tr.version
    for k in range(3):
        tr.step(0.01, 100 + k)
    got = pulled(rx, tr.version)
    assert rx.stats.refit == "full" and f"no delta record for (0, 0, 0) v{base + 1}" in rx.stats.delta_reason
    assert_same_bytes(got, pulled(tr.receiver("full", delta=False), tr.version))
    v = tr.step(0.01, 200)
    assert_same_bytes(pulled(rx, v), pulled(tr.receiver("full"), v))
    assert rx.stats.refit == "delta" and rx.stats.delta_base == v - 1


def test_a_consumer_that_writes_a_handed_over_tensor_gets_a_full_pull(dense):
    """The tensors a staged cycle yields are views of the arena: a consumer that writes one (here
    doubles every q_proj in place) leaves the arena no longer holding its version, so the next
    cycle is a full pull naming the tensors written, exact; deltas resume after it."""
    tr = dense
    rx = tr.receiver("writer")
    handed = dict(rx.run_refit_cycle(tr.version))
    for name, t in handed.items():
        if "q_proj" in name:
            t.mul_(2)
    v = tr.step(0.01, 960)
    got = pulled(rx, v)
    assert_same_bytes(got, pulled(tr.receiver("full", delta=False), v))
    assert rx.stats.refit == "full", rx.stats.delta_reason
    assert f"the arena no longer holds v{v - 1} as fenced" in rx.stats.delta_reason
    assert "model.layers.0.self_attn.q_proj.weight" in rx.stats.delta_reason
    assert rx.stats.seconds["held.check"] > 0 and rx.stats.seconds["held.fingerprint"] > 0
    v = tr.step(0.01, 961)
    assert_same_bytes(pulled(rx, v), pulled(tr.receiver("full"), v))
    assert rx.stats.refit == "delta"


@settings(max_examples=40, deadline=None)
@given(nbytes=st.integers(1, 5 * 8 * 4096 + 13), at=st.floats(0, 1), kind=st.sampled_from(["bit", "swap", "none"]),
       seed=st.integers(0, 2 ** 16))
def test_the_held_fingerprint_sees_every_write(nbytes, at, kind, seed):
    """Any changed byte, and any two distinct words swapped, change the fingerprint; the same
    bytes never do (the oracle: torch.equal of a copy), across chunk and tail edges."""
    g = torch.Generator().manual_seed(seed)
    arena = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    before = arena.clone()
    fp = held.HeldFingerprint({"uint8": arena})
    i = min(nbytes - 1, int(at * nbytes))
    if kind == "bit":
        arena[i] ^= 1 << int(torch.randint(8, (1,), generator=g))
    elif kind == "swap" and nbytes >= 16:
        words = arena[:nbytes // 8 * 8].view(torch.int64)
        j = min(words.numel() - 1, i // 8)
        k = (j + 1 + int(torch.randint(words.numel() - 1, (1,), generator=g))) % words.numel()
        words[[j, k]] = words[[k, j]].clone()
    changed = fp.changed()
    assert bool(changed) == (not torch.equal(arena, before))
    for a, b in changed.get("uint8", []):
        assert not torch.equal(arena[a:b], before[a:b])


def _python_sums(raw: bytes, chunk: int) -> list[int]:
    """The fingerprint's definition in Python integers: per chunk of ``chunk`` little-endian
    8-byte words (the last zero-padded), sum (2 j + 1) * word_j modulo 2**64, as signed int64."""
    raw = raw + bytes(-len(raw) % 8)
    words = [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8)]
    out = []
    for a in range(0, len(words), chunk):
        s = sum((2 * j + 1) * x for j, x in enumerate(words[a:a + chunk])) % 2 ** 64
        out.append(s - 2 ** 64 if s >= 2 ** 63 else s)
    return out


_FUSED_FINGERPRINT = """
import sys, torch
from megarefit.online.delta import held, held_kernel
sys.path.insert(0, "tests")
from test_delta import _python_sums
g = torch.Generator().manual_seed(5)
for nbytes in (8, 8 * 1024 * 3 + 8, 8 * 4096 * 2 + 5, 8 * 4096 + 8 * 1023):
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    words = raw[:nbytes // 8 * 8].view(torch.int64)
    whole = raw[:nbytes // 8 * 8].numpy().tobytes()
    assert held_kernel.chunk_sums(words, 1024).tolist() == _python_sums(whole, 1024)
    assert held.fingerprint(raw, fused=True).tolist() == _python_sums(raw.numpy().tobytes(), held.CHUNK)
print("ok")
"""


@pytest.mark.parametrize("nbytes", [1, 8, 8 * 4096, 8 * 4096 * 3 + 8 * 17 + 3])
def test_the_fingerprint_is_its_definition(nbytes, monkeypatch):
    """Both PyTorch paths (the CPU's matrix-vector product; the GPU's blocks, run here on the CPU
    in blocks of two chunks) equal the definition computed in Python integers, a partial last
    chunk and a partial last word included; so does the fused kernel, run by Triton's interpreter."""
    monkeypatch.setattr(held, "BLOCK", 2 * held.CHUNK)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    want = _python_sums(raw.numpy().tobytes(), held.CHUNK)
    words, tail = held._words(raw)
    for blocked in (False, True):
        assert held.weighted_sums(words, blocked=blocked).tolist() == _python_sums(words.view(torch.uint8).numpy().tobytes(),
                                                                                   held.CHUNK)
    assert held.fingerprint(raw, fused=False).tolist() == want


def test_the_fused_fingerprint_under_the_triton_interpreter():
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", _FUSED_FINGERPRINT], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300, check=False, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_a_delta_that_would_patch_no_tensor_is_a_full_pull(dense):
    """Where placing changed elements is so slow that every tensor is cheaper read whole, the
    cycle is a full pull (the plan's own READs, not the delta's ranges), and its reason counts
    every changed element the trainers published."""
    tr = dense
    rx = tr.receiver("slow-scatter")
    pulled(rx, tr.version)
    rx.delta_model.rates.update(scatter=1.0)  # one changed element placed per second
    v = tr.step(0.01, 950)
    got = pulled(rx, v)
    want = pulled(tr.receiver("full", delta=False), v)
    assert_same_bytes(got, want)
    changed = sum(p.last_delta.changed for p in tr.pubs)
    assert rx.stats.refit == "full" and rx.stats.bytes_moved == tr.receivers["full"].stats.bytes_moved
    # the changed elements of the tensors this receiver reads: at most what all trainer ranks published (this
    # harness changes each rank's replicated tensors apart, and the receiver reads each from one of its holders)
    m = re.match(r"no tensor is cheaper to patch than to read whole \((\d+) changed elements in (\d+) tensors",
                 rx.stats.delta_reason)
    assert m and 0 < int(m.group(1)) <= changed, rx.stats.delta_reason
    assert int(m.group(2)) == len({op.src for op in rx.plan.ops}), rx.stats.delta_reason


def test_a_delta_larger_than_its_slot_is_not_published():
    """A version whose changed elements do not fit the slot publishes no record: receivers pull
    it in full, naming the version; smaller ones after it are deltas again."""
    tr = _dense(f"delta-slot-{next(_JOBS)}", DeltaOptions(keep=2, capacity=0.05))
    try:
        rx = tr.receiver("delta")
        pulled(rx, tr.publish())
        v = tr.step(0.3, 1)
        assert not any(p.last_delta.recorded for p in tr.pubs) and tr.pubs[0].last_delta.changed > 0
        pulled(rx, v)
        assert rx.stats.refit == "full" and f"v{v}" in rx.stats.delta_reason
        v = tr.step(0.001, 2)
        assert_same_bytes(pulled(rx, v), pulled(tr.receiver("full", delta=False), v))
        assert rx.stats.refit == "delta"
    finally:
        _stop(tr)


def test_a_publish_that_fails_part_way_publishes_no_delta_after_it(dense, monkeypatch):
    """A publish whose delta record could not be written (the rendezvous failed) leaves the
    trainer unsure what its mirror holds: its next publish records no delta, receivers pull
    that version in full and are exact, and deltas resume after it."""
    tr = dense
    rx = tr.receiver("delta")
    real = Rendezvous.put

    def failing(self, key, payload):
        if "/epoch" not in key and key.startswith("delta/"):
            raise OSError("injected: the rendezvous went away")
        return real(self, key, payload)

    monkeypatch.setattr(Rendezvous, "put", failing)
    tr.change(0.01, 700)
    with pytest.raises(OSError, match="injected"):
        tr.pubs[0].publish(tr.version + 1)
    monkeypatch.undo()
    v = tr.step(0.01, 701)
    assert not tr.pubs[0].last_delta.recorded
    assert_same_bytes(pulled(rx, v), pulled(tr.receiver("full", delta=False), v))
    assert rx.stats.refit == "full" and "no delta record for (0, 0, 0)" in rx.stats.delta_reason
    v = tr.step(0.01, 702)
    assert_same_bytes(pulled(rx, v), pulled(tr.receiver("full"), v))
    assert rx.stats.refit == "delta"


def test_a_version_republished_with_other_content_is_refused(dense):
    """A version names one content: publishing the last version again with other weights raises
    RepublishError and leaves the rank marked writing (no receiver takes its bytes); the next
    version is then a delta from the content first published, exact. The same weights again, or
    an older version, are a no-op and a VersionOrderError."""
    tr = dense
    rx = tr.receiver("delta")
    v = tr.step(0.01, 900)
    tr.change(0.01, 901)
    for pub in tr.pubs:
        with pytest.raises(RepublishError, match=rf"rank \({pub.rank.tp}, 0, 0\): version {v} was already "
                                                 r"published, and \d+ served tensor\(s\) now hold other content"):
            pub.publish(v)
    rx.timeout = 0.5
    with pytest.raises(StaleVersionError, match="still writing"):
        pulled(rx, v)
    rx.timeout = 20
    v = tr.publish()
    assert_same_bytes(pulled(rx, v), pulled(tr.receiver("full", delta=False), v))
    assert (rx.stats.refit, rx.stats.delta_base) == ("delta", v - 2)  # through the first content of v - 1
    v = tr.step(0.01, 902)
    for pub in tr.pubs:
        pub.publish(v)  # the same weights again: nothing to refuse
        with pytest.raises(VersionOrderError, match=f"version {v - 1} is older than version {v}"):
            pub.publish(v - 1)
    assert_same_bytes(pulled(rx, v), pulled(tr.receiver("full"), v))
    assert (rx.stats.refit, rx.stats.delta_base) == ("delta", v - 1)


def test_a_republish_after_unseen_writes_is_refused_and_old_records_are_dropped():
    """After writes the tracker did not see (``invalidate``), the last version's content cannot be
    checked: publishing it again is refused. A new base (the first publish after such writes)
    deletes the records published before it, so no receiver follows them into it."""
    cfg = tiny_config("Llama-3.1-8B")
    hf = {k: v.to(torch.bfloat16) for k, v in reference_hf_state(cfg, "llama").items()}
    params = {n: t.clone() for n, t in reference_shards(hf, cfg, tp=1, pp=1)[(0, 0, 0)].items()}
    tracker = ChangeTracker()
    tracker.watch(list(params.values()))
    job = f"delta-unseen-{next(_JOBS)}"
    rdzv = Rendezvous.serve(job=job)
    pub = Publisher(params, cfg, rank=(0, 0, 0), layout=source_layout(cfg, tp=1, pp=1), rendezvous=rdzv,
                    agent_name=f"{job}-t", delta=ROOMY, tracker=tracker)
    keys = [rdzv.prefix + delta_key(pub.rank, pub.delta.epoch, v) for v in (2, 3)]
    for v in (1, 2, 3):
        for t in params.values():  # a sparse step through the tracked main-to-model copy
            main = t.float()
            main.view(-1)[v::97] *= 1 + 2 ** -5
            tracker.copy_(t, main)
        pub.publish(v)
    assert pub.delta.tracked == len(params) and rdzv.store.check(keys)
    tracker.invalidate()
    with pytest.raises(RepublishError, match="version 3 was already published, and the tracker was invalidated"):
        pub.publish(3)
    pub.publish(4)
    assert not pub.last_delta.recorded and not any(rdzv.store.check([k]) for k in keys)


def test_a_restarted_trainer_is_not_chained_with_the_old_one(dense):
    """A trainer process that starts anew writes a new delta epoch: a receiver holding a version
    of the old process pulls in full, naming why, however the versions line up."""
    tr = dense
    rx = tr.receiver("delta")
    tr.rdzv.put(epoch_key(tr.pubs[0].rank), "a-new-process")
    v = tr.step(0.01, 800)
    pulled(rx, v)
    assert rx.stats.refit == "full" and "delta epoch changed" in rx.stats.delta_reason


def test_checksums_cover_the_patched_arena(dense, monkeypatch):
    """verify_checksums checks every box of a delta cycle against the trainers' sums; one wrong
    patched element is caught (ChecksumMismatchError), and the next cycle is a full one."""
    tr = dense
    rx = tr.receiver("checked", verify_checksums=True)
    pulled(rx, tr.version)
    v = tr.step(0.01, 300)
    pulled(rx, v)
    assert rx.stats.refit == "delta" and rx.stats.checked_bytes == rx.plan.nbytes
    real = delta_apply.DeltaApplier.apply

    def corrupting(self, plan, choice, local, buffers, manifests):
        real(self, plan, choice, local, buffers, manifests)
        ref, pairs = next(iter(choice.delta.items()))
        op = self.ops_of(plan)[ref][0]
        buffers[op.dst].view(-1)[0] += 1

    monkeypatch.setattr(delta_apply.DeltaApplier, "apply", corrupting)
    v = tr.step(0.01, 301)
    with pytest.raises(ChecksumMismatchError):
        pulled(rx, v)
    monkeypatch.undo()
    assert_same_bytes(pulled(rx, v), pulled(tr.receiver("full", delta=False), v))
    assert rx.stats.refit == "full" and "did not complete" in rx.stats.delta_reason


def test_failed_delta_read_leaves_nothing_handed_over(dense, monkeypatch):
    """A READ that fails during a delta cycle raises before any tensor is handed over; the
    next cycle pulls in full and is exact."""
    tr = dense
    rx = tr.receiver("delta")
    v = tr.step(0.01, 400)

    def failing(*args, **kwargs):
        raise TransferError("injected: the peer went away")

    monkeypatch.setattr(delta_apply, "read_ranges", failing)
    it = rx.run_refit_cycle(v)
    with pytest.raises(TransferError, match="injected"):
        next(it)
    monkeypatch.undo()
    assert_same_bytes(pulled(rx, v), pulled(tr.receiver("full", delta=False), v))
    assert rx.stats.refit == "full"


def _stepping_during_the_read(tr: Trainer, monkeypatch, seed: int) -> Callable:
    """A stand-in for ``delta_apply.read_ranges`` that lets the trainers step once (inside their
    seqlock) while the delta's ranges are read, then reads (and puts the real one back)."""
    real = delta_apply.read_ranges

    def writing(*args, **kwargs):
        monkeypatch.setattr(delta_apply, "read_ranges", real)
        nxt = tr.version + 1
        with AllUpdating(tr.pubs, nxt):
            tr.change(0.01, seed + nxt)
        tr.version = nxt
        return real(*args, **kwargs)

    return writing


def test_a_writer_during_a_delta_pull_is_caught(dense, monkeypatch):
    """A trainer that writes (``Publisher.updating``) while a delta cycle reads is seen by the
    fence: asked for that version, StaleVersionError and nothing handed over; asked for the
    latest, pulled again (in full: the arena was patched) and exact."""
    tr = dense
    rx = tr.receiver("delta")
    writing = _stepping_during_the_read(tr, monkeypatch, 500)
    for asked in ("that version", "latest"):
        pulled(rx, tr.version) if rx.stats.version != tr.version else None
        v = tr.step(0.01, 600 + tr.version)
        monkeypatch.setattr(delta_apply, "read_ranges", writing)
        if asked == "that version":
            with pytest.raises(StaleVersionError, match="moved past version"):
                next(rx.run_refit_cycle(v))
            continue
        got = pulled(rx, None)
        assert rx.stats.version == v + 1 and rx.stats.retries == 1 and rx.stats.refit == "full"
        assert_same_bytes(got, pulled(tr.receiver("full", delta=False), v + 1))


def test_a_streamed_receiver_patches_its_direct_targets(dense, monkeypatch):
    """A streamed receiver (``memory_budget``) whose MLP weights are direct (the consumer's own
    tensors): after a whole cycle they hold its version, so the next cycles patch them with the
    changed elements and stream only the other targets. After each cycle the consumer equals a
    full pull, and the checksums cover the patched tensors. A streamed receiver without direct
    targets pulls in full and says why; new direct tensors (``set_direct``) are pulled whole once.
    A trainer that writes during the delta read: nothing is written, ``refit`` pulls again (in
    full) and the consumer holds the newest version whole."""
    tr = dense
    full = tr.receiver("full", delta=False)
    want = pulled(full, tr.version)
    model = {n: torch.zeros_like(t) for n, t in want.items()}
    direct = {n: t for n, t in model.items() if ".mlp." in n}
    budget = int(0.5 * sum(t.numel() * t.element_size() for t in want.values()))
    rx = tr.receiver("streamed-direct", memory_budget=budget, direct=direct, verify_checksums=True)
    rx.delta_model.rates["tensor"] = 0.0
    plain = tr.receiver("streamed", memory_budget=budget)

    def install(weights):
        for name, t in weights:
            model[name].copy_(t)

    for k in range(4):
        v = tr.version if k == 0 else tr.step(0.01, 400 + k)
        if k == 3:  # the consumer's direct tensors replaced: they hold no version yet
            direct = {n: torch.zeros_like(t) for n, t in direct.items()}
            model.update(direct)
            rx.set_direct(direct)
        rx.refit(install, v)
        want = pulled(full, v)
        assert all(torch.equal(model[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want), k
        stats = rx.stats
        if k in (0, 3):
            assert stats.refit == "full", stats.delta_reason
        else:
            assert (stats.refit, stats.delta_base) == ("delta", v - 1), stats.delta_reason
            assert stats.delta_tensors > 0 and stats.bytes_moved < full.stats.bytes_moved
            assert stats.checked_bytes == full.stats.bytes_moved  # patched and streamed boxes all checked
        plain.refit(lambda w: [None for _ in w], v)
        assert plain.stats.refit == "full" and "none of its targets is direct" in plain.stats.delta_reason
    tr.step(0.01, 650)
    monkeypatch.setattr(delta_apply, "read_ranges", _stepping_during_the_read(tr, monkeypatch, 700))
    stats = rx.refit(install)
    assert (stats.version, stats.retries, stats.refit) == (tr.version, 1, "full"), stats.delta_reason
    want = pulled(full, tr.version)
    assert all(torch.equal(model[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want)


class AllUpdating:
    """``Publisher.updating(version)`` of every publisher around a block."""

    def __init__(self, pubs, version):
        self.cms = [p.updating(version) for p in pubs]

    def __enter__(self):
        for cm in self.cms:
            cm.__enter__()

    def __exit__(self, *exc):
        for cm in self.cms:
            cm.__exit__(None, None, None)


def _unique_sources(plan: Plan) -> tuple[dict, dict]:
    """Every source of ``plan`` as int64 tensors of distinct values, and each one's first value."""
    sources, first, at = {}, {}, 0
    for ref, meta in plan.sources.items():
        n = meta.numel
        sources.setdefault(ref.rank, {})[ref.name] = torch.arange(at, at + n, dtype=torch.int64).view(
            meta.storage_shape or meta.shape)
        first[ref] = at
        at += n
    return sources, first


@pytest.mark.parametrize("target", ["hf", "vllm-ep"])
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(density=st.floats(0.001, 1.0), seed=st.integers(0, 2 ** 16))
def test_map_through_follows_the_local_copy(trainer, target, density, seed):
    """For every op of a real plan, the target element :func:`map_through` names for a source
    element holds that element after LocalTransport runs the op on unique values."""
    if target not in TARGETS[trainer.kind]:
        pytest.skip(f"{trainer.kind} has no {target} receiver")
    plan = trainer.receivers[target].plan
    sources, first = _unique_sources(plan)
    local = LocalTransport(sources)
    targets = {}
    for ref, ops in plan.ops_by_target.items():
        meta = plan.targets[ref]
        targets[ref] = torch.full(meta.storage_shape or meta.shape, -1, dtype=torch.int64)
        local.pull(ops, targets[ref])
    g = torch.Generator().manual_seed(seed)
    hit = {ref: 0 for ref in targets}
    for op in plan.ops:
        meta = plan.sources[op.src]
        idx = (torch.rand(meta.numel, generator=g) < density).nonzero().view(-1)
        pos, flat = map_through(op, op.src_view or meta.shape, op.dst_view or plan.targets[op.dst].shape, idx)
        assert torch.equal(targets[op.dst].view(-1)[flat], first[op.src] + idx[pos]), op
        hit[op.dst] += pos.numel()
        whole = torch.arange(meta.numel)
        assert map_through(op, op.src_view or meta.shape, op.dst_view or plan.targets[op.dst].shape,
                           whole)[0].numel() == op.numel
    assert sum(hit.values()) <= sum(op.numel for op in plan.ops)


def test_records_round_trip_and_refuse_malformed_bytes():
    rec = DeltaRecord(7, 6, 1 << 40, 4096, 96, "DRAM", 0,
                      (DeltaSegment(0, INDICES, 4, 0, 16), DeltaSegment(3, BITMAP, 10, 16, 80)))
    assert decode_record(rec.encode()) == rec
    raw = rec.encode()
    for bad, what in [(b"XXXX" + raw[4:], "magic"), (raw[:-8], "rows"),
                      (DeltaRecord(7, 6, 0, 64, 32, "DRAM", 0, (DeltaSegment(0, INDICES, 4, 16, 32),)).encode(),
                       "segment"),
                      (DeltaRecord(7, 6, 0, 64, 128, "DRAM", 0, ()).encode(), "header")]:
        with pytest.raises(DeltaRecordError, match=what):
            decode_record(bad)


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(1, 3 * 65536 + 7), density=st.floats(0.0, 1.0), fmt=st.sampled_from([INDICES, BITMAP, PAGED]),
       seed=st.integers(0, 2 ** 16))
def test_every_format_names_the_changed_elements_exactly(numel, density, fmt, seed):
    """Indices, bitmap and paged offsets decode to the changed elements and values packed, and
    best_format picks the smallest of them."""
    g = torch.Generator().manual_seed(seed)
    idx = (torch.rand(numel, generator=g) < density).nonzero().view(-1)
    values = torch.randint(-2 ** 15, 2 ** 15, (idx.numel(),), generator=g, dtype=torch.int16)
    mask = {INDICES: lambda: idx.to(torch.int32).view(torch.uint8), BITMAP: lambda: pack_bitmap(idx, numel),
            PAGED: lambda: pack_paged(idx, numel)}[fmt]()
    assert mask.numel() == mask_bytes(fmt, idx.numel(), numel)
    size = segment_bytes(fmt, idx.numel(), numel, 2)
    raw = torch.zeros(size, dtype=torch.uint8)
    raw[:mask.numel()] = mask
    at = (mask.numel() + 7) // 8 * 8
    raw[at:at + 2 * idx.numel()] = values.view(torch.uint8)
    entry = TensorEntry("w", "column", "bfloat16", (numel,), (numel,), 0, 2 * numel)
    got_idx, got_values = segment_elements(raw, DeltaSegment(0, fmt, idx.numel(), 0, size), entry, 2)
    assert torch.equal(got_idx, idx) and torch.equal(got_values, values)
    best = best_format(idx.numel(), numel)
    assert mask_bytes(best, idx.numel(), numel) == min(mask_bytes(f, idx.numel(), numel)
                                                       for f in (INDICES, BITMAP, PAGED))


_INTERPRETED = """
import torch
import megarefit.online.delta.kernel as K
from megarefit.online.delta.log import pack_paged
PAGE = K.PAGE
g = torch.Generator().manual_seed(3)
numel = 5 * PAGE + 123
idx = (torch.rand(numel, generator=g) < 0.02).nonzero().view(-1)
idx = idx[(idx < PAGE) | (idx >= 3 * PAGE)]  # pages 1 and 2 hold no change
values = torch.randint(-2 ** 15, 2 ** 15, (idx.numel(),), generator=g, dtype=torch.int16)
starts, ends = torch.tensor([0, 1000, 3 * PAGE, 4 * PAGE + 7]), torch.tensor([900, 2 * PAGE, 4 * PAGE, numel])
dst = torch.tensor([300_000, 0, 10 * PAGE, 2 * PAGE])  # disjoint in the root: no element written twice
spans = sorted(zip(dst.tolist(), (dst + ends - starts).tolist()))
assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
k = torch.searchsorted(starts, idx, right=True) - 1
inside = idx < ends[k]
want = torch.zeros(12 * PAGE, dtype=torch.int16)
want[(idx - starts[k] + dst[k])[inside]] = values[inside]
pages = (numel + PAGE - 1) // PAGE
raw = pack_paged(idx, numel)
for names, counts in ((idx.to(torch.int32), None), (raw[4 * pages:].view(torch.int16), raw[:4 * pages].view(torch.int32))):
    root = torch.zeros_like(want)
    K.place(names, counts, values, starts, ends, dst, root)
    assert torch.equal(root, want), "fused placing differs from the PyTorch scatter"
print("ok")
"""


def test_fused_placing_under_the_triton_interpreter():
    """The fused placing's kernel (decode, binary searches, masked writes) run by Triton's
    interpreter on CPU tensors writes exactly what an independent PyTorch scatter writes: runs
    with gaps between them, pages with and without changes, indices and pages. (On a GPU the
    same is tests/test_delta_gpu.py.)"""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
