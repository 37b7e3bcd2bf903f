"""CUDA IPC transport, the parts a CPU proves: the device copies a plan compiles into (same
plan as NIXL pulls) against independent references, manifest records, refusals and the
checks on untrusted records. The handles themselves are opened in tests/test_cuda_ipc_gpu.py."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_cases import moe_config
from reference import moe_hf_state, moe_reference_shards, reference_hf_state, reference_shards, vllm_reference

import megarefit
from megarefit.errors import MegarefitError
from megarefit.layout import RankCoord, SourceLayout
from megarefit.layout.dims import ModelDims
from megarefit.targets import VllmTarget, plan_megatron_to_vllm
from megarefit.transport.cuda_ipc import DeviceCopies, IpcError, IpcSources, open_storage
from megarefit.transport.manifest import IpcStorage, Manifest, TensorEntry


def _flat(tensors: dict, order: list) -> dict:
    """``tensors`` re-homed as views of one flat buffer per dtype, in ``order`` (as Megatron's
    contiguous parameter buffer, or the receiver's arena in trainer order)."""
    out = {}
    for dtype in {t.dtype for t in tensors.values()}:
        names = [n for n in order if tensors[n].dtype == dtype]
        flat = torch.empty(sum(tensors[n].numel() for n in names), dtype=dtype)
        at = 0
        for n in names:
            out[n] = flat[at:at + tensors[n].numel()].view(tensors[n].shape)
            out[n].copy_(tensors[n])
            at += tensors[n].numel()
    return out


def _run(plan, shards: dict, *, run_min_bytes: int) -> tuple[dict, DeviceCopies]:
    """The plan through DeviceCopies: sources in one buffer per rank, targets in one arena laid
    out in the order the ops read them (so neighbouring runs coalesce)."""
    sources = {RankCoord(*r): _flat(s, list(s)) for r, s in shards.items()}
    position = {(RankCoord(*r), n): i for r, s in shards.items() for i, n in enumerate(s)}
    order = list(dict.fromkeys(op.dst for op in sorted(plan.ops, key=lambda o: (position[o.src.rank, o.src.name],
                                                                               o.src_offset))))
    order += [r for r in plan.targets if r not in order]
    arena = _flat({r: torch.full(plan.targets[r].shape, float("nan"), dtype=getattr(torch, plan.targets[r].dtype))
                   for r in plan.targets}, order)
    for ref, meta in plan.targets.items():  # never pulled (vLLM vocab padding rows): zeroed, as the receiver does
        for box in meta.zero_fill:
            arena[ref][box.slices()].zero_()
    copies = DeviceCopies.build(plan, plan.ops, lambda ref: sources[ref.rank][ref.name], arena,
                                run_min_bytes=run_min_bytes)
    copies()
    return {r.name: t for r, t in arena.items() if r not in plan.staging}, copies


@pytest.mark.parametrize("tp,pp,run_min", [(1, 1, 1), (2, 2, 1 << 30), (2, 1, 4096)])
def test_dense_plan_as_device_copies_equals_reference(config, tp, pp, run_min):
    cfg = config("Qwen3-0.6B")
    hf = reference_hf_state(cfg, "qwen3")
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=tp, pp=pp, padded_vocab_size=dims.padded_vocab_size(tp), num_layers=dims.num_layers)
    plan = megarefit.plan_megatron_to_hf(dims, layout, "float32")
    got, copies = _run(plan, reference_shards(hf, cfg, tp=tp, pp=pp), run_min_bytes=run_min)
    assert got.keys() == hf.keys()
    assert all(torch.equal(got[k], hf[k]) for k in hf)
    assert copies.nbytes == plan.nbytes
    contiguous = sum(op.kind == "contiguous" for op in plan.ops)
    if tp == 1:  # a tp=1 rank's tensors lie in the arena as in its buffer: runs join across tensors
        assert len(copies.runs) < contiguous / 2
    if run_min == 1 << 30:
        assert not copies.runs and copies.copies == 1  # everything in one batched launch


@pytest.mark.parametrize("layout_name", ["sequential", "legacy_grouped"])
def test_moe_vllm_plan_as_device_copies_equals_reference(layout_name):
    cfg = moe_config("Qwen3-30B-A3B")
    hf = moe_hf_state(cfg, "qwen3_moe")
    dims = ModelDims.from_hf_config(cfg)
    ep, etp = (1, 2) if layout_name == "sequential" else (2, 1)
    layout = SourceLayout.build(tp=2, pp=1, ep=ep, etp=etp, padded_vocab_size=dims.padded_vocab_size(2),
                                num_layers=dims.num_layers, expert_layout=layout_name)
    shards = moe_reference_shards(hf, cfg, "qwen3_moe", tp=2, pp=1, ep=ep, etp=etp, layout=layout_name)
    plan = megarefit.plan_megatron_to_hf(dims, layout, "float32")
    got, _ = _run(plan, shards, run_min_bytes=2048)
    assert all(torch.equal(got[k], hf[k]) for k in hf) and got.keys() == hf.keys()


def test_vllm_worker_plan_as_device_copies_equals_reference(config):
    cfg = config("Qwen3-0.6B")
    hf = reference_hf_state(cfg, "qwen3")
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=2, pp=1, padded_vocab_size=dims.padded_vocab_size(2), num_layers=dims.num_layers)
    for rank in range(2):
        plan = plan_megatron_to_vllm(dims, layout, "float32", VllmTarget(2, rank))
        got, _ = _run(plan, reference_shards(hf, cfg, tp=2, pp=1), run_min_bytes=1024)
        want = vllm_reference(hf, cfg, 2, rank)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), rank


def _record(**change) -> IpcStorage:
    rec = IpcStorage(uuid="GPU-0", dev=0, base=1 << 20, nbytes=4096, handle="ab" * 64, offset=0,
                     ref_counter=b"/torch_1_2_0".hex(), ref_offset=0, event="cd" * 64, event_sync=True, pid=1)
    return dataclasses.replace(rec, **change)


def test_manifest_carries_ipc_records_and_their_digest(config):
    dims = ModelDims.from_hf_config(config("Qwen3-0.6B"))
    layout = SourceLayout.build(tp=1, pp=1, padded_vocab_size=dims.padded_vocab_size(1), num_layers=dims.num_layers)
    entry = TensorEntry("embedding.word_embeddings.weight", "vocab", "bfloat16", (128, 8), (128, 8), 1 << 20, 2048,
                        "VRAM", 0, 1 << 20)
    m = Manifest(RankCoord(0, 0, 0), dims, layout, "agent", (entry,), ipc=(_record(),))
    back = Manifest.from_json(m.to_json())
    assert back.ipc == m.ipc and back == m
    moved = dataclasses.replace(m, ipc=(_record(handle="ef" * 64),))  # a restarted trainer exports new handles
    assert moved.memory_digest != m.memory_digest and moved.layout_digest == m.layout_digest


@pytest.mark.parametrize("change,match", [
    ({"handle": "zz"}, "non-hex field"),
    ({"handle": ""}, "not a PyTorch handle"),
    ({"ref_counter": b"/../etc/passwd".hex()}, "not a shared-memory name"),
    ({"ref_counter": b"/dev/shm/x".hex()}, "not a shared-memory name"),
    ({"nbytes": 0}, "out of range"),
    ({"offset": -1}, "out of range"),
])
def test_malformed_records_are_refused_before_any_open(change, match):
    with pytest.raises(IpcError, match=rf"rank \(0, 1, 0\).*{match}|{match}"):
        open_storage(_record(**change), 0, RankCoord(0, 1, 0))


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40), st.integers(-2**40, 2**40), st.binary(max_size=64))
def test_fuzzed_records_raise_named_errors(name, n, blob):
    rec = _record(handle=blob.hex(), ref_counter=name.encode("utf-8", "replace").hex(), nbytes=n, pid=-1)
    # a malformed field is refused before any open; a well-formed record whose handle the driver (or a
    # machine without CUDA) refuses is wrapped: either way one IpcError naming the rank, never a bare RuntimeError
    rank = RankCoord(0, 0, 0)
    named = rf"^rank {re.escape(str(rank))}: (CUDA IPC|cannot open the CUDA IPC handle)"
    with pytest.raises(IpcError, match=named) as err:
        open_storage(rec, 0, rank)
    assert type(err.value) is IpcError


def test_ipc_mode_is_checked():
    with pytest.raises(MegarefitError, match="transport must be 'auto', 'nixl' or 'ipc', got 'shm'"):
        IpcSources(torch.device("cpu"), "shm")  # type: ignore[arg-type]
    with pytest.raises(MegarefitError, match=r"transport='ipc' needs a CUDA receiver device, got cpu"):
        IpcSources(torch.device("cpu"), "ipc")
    sources = IpcSources(torch.device("cpu"), "auto")
    assert sources.ranks == frozenset() and math.isclose(sources.open_seconds, 0.0)
