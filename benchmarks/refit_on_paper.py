"""On paper: how long one refit takes across nodes, 16 to 1024 GPUs (issue 43).

    python benchmarks/refit_on_paper.py [--json docs/refit_on_paper.jsonl] [--processes 1] [--cache DIR]
    python benchmarks/refit_on_paper.py --from-json docs/refit_on_paper.jsonl    # the predictions table only
    python benchmarks/refit_on_paper.py --from-json docs/refit_on_paper.jsonl --summary calibration
    python benchmarks/refit_on_paper.py --from-json docs/refit_on_paper.jsonl --summary anchors

Units: bytes and seconds in the code and the JSON lines; tables print GB (1e9 bytes), GB/s
(1e9 bytes per second), seconds, and ms where a column says so.

Bytes come from megarefit's planner, as in ``memory_on_paper.py``: for each case EVERY vLLM
worker of one engine is planned (``plan_megatron_to_vllm`` on the real HF config, cached under
``--cache`` per megarefit source digest); the slowest worker decides the receiver side. What each
trainer GPU serves one replica is the sum over every worker's plan of the bytes it reads from
that trainer coordinate, at the wire dtype: tensors vLLM keeps whole on every tp rank (norms,
routers, MLA's fused_qkv_a_proj, shared experts under EP) are read by every worker of a vLLM dp
rank, not once per dp rank (tests/test_refit_on_paper.py checks the sum against the plans' ops).
``plan_megatron_to_hf`` (bf16) per trainer coordinate gives only the FP8 quantize term.

The model of one cycle (the slowest worker decides)::

    refit = overhead + per_op * ops             fixed costs of a cycle (fitted)
          + quantize                            FP8: the trainer's block quantization of its served shard
          + pull                                the links, below
          + scratch bytes / BoxCopies rate      strided pieces placed from scratch
          + worker bytes / install rate         vLLM's reload copying the pulled tensors into its parameters

    pull, direct: every replica's worker reads the trainers
        max(receiver, sender)
        receiver = max(remote bytes / NIC, same-node bytes / NVLink)
        sender   = the most one trainer GPU serves: replicas x its bytes per replica, over its NIC (and NVLink)
    pull, fan-out tree of k: one replica reads the trainers, every other replica mirrors a
        parent's arena (``megarefit.online.receiver.replica``, store and forward, whole arena)
        max(receiver, sender for one replica) + depth x k x worker bytes / NIC
    the smaller of direct and trees k = 1..4 is taken.

Two designs of who serves (every prediction row has both):

- today: a trainer coordinate (tp, pp, ep) is served by its first copy in Megatron's rank order
  (``Publisher.from_megatron``: data-parallel copies serve nothing), and the planner reads a
  tensor several coordinates hold from the first of them: the busiest trainer GPU serves
  replicas x max over coordinates of the engine's sum (``sender_bytes``);
- new (issue 58): every data-parallel copy serves and every source byte is spread evenly over
  all its holders (``spread_sender_bytes``): a TP shard is held by every GPU of its stage with
  its dense tp rank (data-parallel copies; under EP the stage's ranks of that tp rank), an expert
  shard by its expert-data-parallel copies, a Megatron-replicated tensor (``Role.REPLICATED``:
  norms, routers, MLA's q/kv down projections) by its whole stage. A trainer GPU sends, per
  replica, the sum over the pieces it holds of what every worker reads of each, over its holders.
  Predicted at NIC efficiency 0.8 and 0.5 (``NEW_EFFICIENCIES``).

A delta refit (``docs/delta.md``) moves a fraction ``f`` of the pulled
bytes: the changed elements plus their index, 16-bit offsets (2 bytes a change) or a bitmap,
whichever is smaller; replicas still mirror whole arenas, vLLM still reloads every tensor.

The link terms on the emulated cluster (issue 58, item 5): ``cluster_link`` reads the link rows
``benchmarks/bench_cluster.py`` records in ``docs/cluster_*.jsonl`` (the busiest trainer veth's
bytes, the pull's seconds, the veth's tc rate), fits the NIC efficiency on the rows marked fit and
checks every row within ``TOLERANCE``; where such rows exist the new design is also predicted at
that efficiency (its line rate stays the assumed 400 Gb/s: the veths are slower, the share of
line rate is what carries over). Until they are recorded the tables say so.

Calibrated on the recorded two-GPU runs (``docs/refit_nixl_h200.jsonl``: two H200s, NIXL over
CUDA IPC, so the link there is NVLink): the link rate is bytes / raw NIXL READ; the fixed
overhead and per-op cost are a least-squares fit of (warm - link - copies) on the FIT rows;
copy rates come from ``docs/box_copies_h200.jsonl`` (BoxCopies; PyTorch's strided ``copy_``,
the legacy GroupedMLP transposes) and ``docs/install_gpu_h200.jsonl`` (vLLM-style install
loop); the FP8 quantize rate from the FIT rows' trainer-side quantize seconds. The other rows
are held out. The predicted quantity is the median warm cycle (``bench_nixl.py``'s "warm ms").

Assumptions (ASSUMPTIONS below, printed with every table): 8 GPUs per node, one 400 Gb/s NIC
per GPU (50 GB/s line) at an achievable efficiency; NVLink at the calibrated rate; trainer
Megatron tp (per model), pp 1 (NeMo-RL's anchor: pp 16), ep min(ep_max, trainer GPUs per stage), etp 1; split placement gives half
the GPUs to the trainer, colocated shares them; fan-out hops always cross nodes. Not modelled:
vLLM's pause and resume, its post-load processing, stragglers, congestion in the fabric.

Published numbers set beside the predictions (ANCHORS) are other systems' measurements on
their own setups, not megarefit's; each names its source and is set beside a like case (split
or colocated as published, their layouts where published).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import pickle
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
NODE_GPUS = 8
RECORDED = {"nixl": "docs/refit_nixl_h200.jsonl", "box": "docs/box_copies_h200.jsonl",
            "install": "docs/install_gpu_h200.jsonl"}
FIT = ("dense-tp2", "moe-ep2-te_grouped", "dense-tp2-fp8", "moe-ep2-te_grouped-fp8", "moe-etp2-sequential")
CLUSTER_GLOB = "docs/cluster_*.jsonl"  # emulated-cluster records (benchmarks/bench_cluster.py), see cluster_link
NEW_EFFICIENCIES = (0.8, 0.5)  # the new design is predicted at each of these NIC efficiencies
TOLERANCE = 0.15  # the done-when bar: every recorded two-GPU row within 15% of its median warm cycle
ASSUMPTIONS = {
    "gpus_per_node": NODE_GPUS,
    "nic_line_bytes_per_s": 400e9 / 8,  # one 400 Gb/s NIC per GPU (DGX H100 / H200: 8 compute NICs)
    "nic_efficiency": 0.80,  # achievable share of line rate (assumed; not measured by megarefit)
    "delta_low": 0.05,  # "a few percent" of elements change per step at lr 1e-6 (docs/delta.md)
    "fanout_max": 4,  # trees of fan-out 1..4 are tried
    "split": "trainer on half the GPUs, vLLM on the other half, on separate nodes",
    "colocated": "trainer and vLLM on the same GPUs; a worker reads same-node sources over NVLink",
}


@dataclass(frozen=True)
class Model:
    """A model and the layouts it is run with: the HF config, the trainer's Megatron tp and
    largest ep (and pp, with its first / last stage layers), the vLLM engine (tp x dp GPUs,
    ``ep``: vLLM's enable_expert_parallel)."""

    name: str
    config: str
    trainer_tp: int
    trainer_ep: int
    vllm_tp: int
    vllm_dp: int
    vllm_ep: bool
    trainer_pp: int = 1
    first_stage_layers: int | None = None  # Megatron's num_layers_in_first_pipeline_stage (pp > 1)
    last_stage_layers: int | None = None

    @property
    def engine(self) -> int:
        return self.vllm_tp * self.vllm_dp


@dataclass(frozen=True)
class Case:
    """One refit: a model on ``gpus`` GPUs, ``placement`` split or colocated, the wire dtype."""

    model: Model
    gpus: int
    placement: str = "split"
    quant: str = "bf16"
    anchor: str = ""  # the ANCHORS entry this case is set beside, or "trees" (TREE_CASES)
    split_at: int = 0  # split placement: trainer GPUs (0: half of ``gpus``)

    @property
    def trainer_gpus(self) -> int:
        return self.gpus if self.placement == "colocated" else self.split_at or self.gpus // 2

    @property
    def vllm_gpus(self) -> int:
        return self.gpus if self.placement == "colocated" else self.gpus - self.trainer_gpus

    @property
    def trainer_ep(self) -> int:
        return min(self.model.trainer_ep, self.trainer_gpus // self.model.trainer_pp)


MODELS = {m.name: m for m in (
    Model("DeepSeek-V3", "DeepSeek-V3.json", 8, 64, 8, 4, True),
    Model("Kimi-K2", "Kimi-K2-Instruct.json", 8, 64, 8, 4, True),
    Model("GLM-5", "GLM-5.json", 8, 64, 8, 4, True),
    Model("Qwen3-235B-A22B", "Qwen3-235B-A22B.json", 8, 64, 1, 8, True),
    Model("Qwen3-30B-A3B", "Qwen3-30B-A3B.json", 2, 8, 2, 1, False),
)}
GPUS = (16, 64, 256, 1024)
CASES = [Case(MODELS[n], g, quant=q) for n in MODELS for g in GPUS for q in ("bf16", "fp8")]

TREE_CASES = [  # trainer GPUs far fewer than vLLM GPUs: where fan-out trees, store and forward or cut-through, pay
    Case(MODELS[n], 1024, quant=q, anchor="trees", split_at=t) for n, t in (("DeepSeek-V3", 64), ("Qwen3-30B-A3B", 16))
    for q in ("bf16", "fp8")]
DEDUP_TABLE = [("DeepSeek-V3", 1024, ""), ("Kimi-K2", 1024, ""), ("GLM-5", 1024, ""), ("Qwen3-235B-A22B", 1024, ""),
               ("Qwen3-30B-A3B", 1024, ""), ("GLM-5.2", 96, "prime-rl"), ("DeepSeek-V3", 1024, "trees"),
               ("Qwen3-30B-A3B", 1024, "trees")]  # (model, GPUs, anchor): the node-dedup table's rows
TARGETS = {("DeepSeek-V3", 1024, ""): ("1.2", "0.65"), ("Qwen3-30B-A3B", 1024, ""): ("0.3", ""),
           ("GLM-5.2", 96, "prime-rl"): ("1.4", "")}  # issue 60's done-when, bf16 and FP8 seconds at NIC 0.8

NEMO_DSV3 = Model("DeepSeek-V3", "DeepSeek-V3.json", 1, 16, 32, 1, False, trainer_pp=16,
                  first_stage_layers=3, last_stage_layers=2)  # NeMo-RL's layouts; the stage split is assumed
ANCHORS = [  # other systems' published numbers (not megarefit measurements), with the like case set beside each
    {"key": "prime-rl", "system": "prime-rl (NIXL pulls, PR #3341)", "seconds": "2.842",
     "setup": "GLM-5.2, 64 trainer -> 32 inference H200s (one engine, EP32), bf16 served",
     "timed": "inference client's weight update, median (RDMA alone 1.864 s)", "published_gb": 82.501,
     "source": "https://github.com/PrimeIntellect-ai/prime-rl/pull/3341",
     "case": Case(Model("GLM-5.2", "GLM-5.2-FP8.json", 8, 64, 1, 32, True), 96, anchor="prime-rl", split_at=64)},
    {"key": "sharded_rdt", "system": "vLLM sharded_rdt (Ray + NIXL, PR #43375)", "seconds": "3.2-3.3",
     "setup": "Qwen3-235B-A22B, 8 trainer (FSDP2) -> 8 inference H100s, DP8 + EP8, bf16",
     "timed": "warm sync at the engine level", "published_gb": None,
     "source": "https://github.com/vllm-project/vllm/pull/43375",
     "case": Case(MODELS["Qwen3-235B-A22B"], 16, anchor="sharded_rdt")},
    {"key": "sharded_rdt-kimi", "system": "vLLM sharded_rdt (Ray + NIXL)", "seconds": "7.53",
     "setup": "Kimi-K2, 256 trainer -> 128 inference GPUs, bf16; layouts not given (model: megarefit's Kimi-K2 "
              "layouts)", "timed": "weight sync", "published_gb": None,
     "source": "issue 58, citing vLLM sharded_rdt (https://github.com/vllm-project/vllm/pull/43375)",
     "case": Case(MODELS["Kimi-K2"], 384, anchor="sharded_rdt-kimi", split_at=256)},
    {"key": "nemo-dsv3", "system": "NeMo-RL (NCCL reshard refit)", "seconds": "2.39-2.83",
     "setup": "DeepSeek-V3 on H100, bf16, Megatron PP16 x EP16 -> vLLM TP32 x DP8: 256 + 256 GPUs, non-colocated "
              "(model: 8 engines of vLLM tp32, EP off; pp stages of 3, 4 x 14, 2 layers, assumed)",
     "timed": "refit", "published_gb": None,
     "source": "NVIDIA-NeMo/RL's design doc nccl-reshard-refit.md "
               "(https://github.com/NVIDIA-NeMo/RL/blob/main/docs/design-docs/nccl-reshard-refit.md)",
     "case": Case(NEMO_DSV3, 512, anchor="nemo-dsv3")},
    {"key": "nemo-30b-32", "system": "NeMo-RL", "seconds": "1.96-2.41 (32-1024 GPUs)",
     "setup": "Qwen3-30B-A3B at 32 to 1024 GPUs, a 1:1 split of trainer and inference GPUs; layouts not given "
              "(model: megarefit's Qwen3-30B-A3B layouts), the 32-GPU end",
     "timed": "refit", "published_gb": None, "source": "NVIDIA-NeMo/RL#3334 (https://github.com/NVIDIA-NeMo/RL/issues/3334)",
     "case": Case(MODELS["Qwen3-30B-A3B"], 32, anchor="nemo-30b-32")},
    {"key": "nemo-30b-1024", "system": "NeMo-RL", "seconds": "1.96-2.41 (32-1024 GPUs)",
     "setup": "as above, the 1024-GPU end", "timed": "refit", "published_gb": None,
     "source": "NVIDIA-NeMo/RL#3334 (as above)",
     "case": Case(MODELS["Qwen3-30B-A3B"], 1024, anchor="nemo-30b-1024")},
]


# ---- calibration: the recorded two-GPU runs (JSON only, no torch) ---------------------------

def load(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in (ROOT / path).read_text().splitlines() if line.strip()]


def _copy_rates() -> dict[str, float]:
    """Bytes per second of BoxCopies and of PyTorch's strided copy_ (bench_box_copies.py) and of
    the install loop (bench_install.py, ``loop copy_``, median over its models)."""
    box = load(RECORDED["box"])[0]
    med = {k: statistics.median(v) for k, v in box["samples"].items()}
    install = [r["bytes"] / statistics.median(r["loop_s"]) for r in load(RECORDED["install"])]
    return {"box": box["bytes"] / med["BoxCopies (one batched launch)"],
            "strided": box["bytes"] / med["copy_ per box (PyTorch strided kernel)"],
            "install": statistics.median(install)}


def _trainers(r: dict) -> int:
    return max(r["tp"], r["ep"] * r["etp"])  # trainer processes of a recorded run (pp 1)


def _copies_s(r: dict, rates: dict[str, float]) -> float:
    """Receiver copies of a recorded row: scratch through BoxCopies; legacy GroupedMLP experts
    through PyTorch's strided copy_ (transposed), and with FP8 quantized on the receiver."""
    sb = r["ops"]["scratch_bytes"]
    if r["expert_layout"] != "legacy_grouped":
        return sb / rates["box"]
    return sb / rates["strided"] + (sb / rates["quantize"] if r["quantization"] == "fp8" else 0.0)


def calibrate(rows: list[dict] | None = None) -> dict[str, float]:
    """Rates (bytes/s) and fixed costs (s, s/op) from the FIT rows and the copy benchmarks.

    The FP8 quantize rate: a trainer quantizes the elements that become FP8; with half the
    bytes per element on the wire, those are ``2 * (bf16 bytes - FP8 bytes)`` of the whole
    model (scales ignored), split over the trainers, in its recorded ``trainer_quantize_s``."""
    rows = rows if rows is not None else load(RECORDED["nixl"])
    fit = [r for r in rows if r["label"] in FIT]
    rates = _copy_rates()
    rates["link"] = statistics.median(r["bytes"] / statistics.median(r["samples"]["raw"]) for r in fit)
    rates["quantize"] = statistics.median(2 * (r["full_bytes"] - r["bytes"]) / _trainers(r) / r["trainer_quantize_s"]
                                          for r in fit if r["quantization"] == "fp8")
    xs = [r["ops"]["ops"] for r in fit]
    ys = [statistics.median(r["samples"]["warm"]) - r["bytes"] / rates["link"] - _copies_s(r, rates) for r in fit]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    per_op = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {**rates, "per_op_s": per_op, "overhead_s": my - per_op * mx}


def predict_recorded(r: dict, cal: dict[str, float]) -> float:
    """The model's seconds for a recorded two-GPU row (its bytes over the calibrated link)."""
    return cal["overhead_s"] + cal["per_op_s"] * r["ops"]["ops"] + r["bytes"] / cal["link"] + _copies_s(r, cal)


def calibration_rows(cal: dict[str, float]) -> list[dict]:
    out = []
    for r in load(RECORDED["nixl"]):
        measured, predicted = statistics.median(r["samples"]["warm"]), predict_recorded(r, cal)
        out.append({"kind": "calibration", "label": r["label"], "role": "fit" if r["label"] in FIT else "held out",
                    "config": r["config"], "quantization": r["quantization"], "expert_layout": r["expert_layout"],
                    "target": r["target"], "bytes": r["bytes"], "ops": r["ops"]["ops"],
                    "scratch_bytes": r["ops"]["scratch_bytes"], "measured_s": measured, "predicted_s": predicted,
                    "error": predicted / measured - 1, "recorded_on": f"{r['machine']}, {r['date']}"})
    return out


# ---- planning (megarefit; imported only here) -----------------------------------------------

KINDS = ("tp", "expert", "replicated")  # what a source piece is, for who else holds it (``holders``)


def trainer_key(model: Model, ep: int) -> tuple:
    """The trainer layout a plan is made for: ``(tp, pp, ep, first_stage_layers, last_stage_layers)``."""
    return (model.trainer_tp, model.trainer_pp, ep, model.first_stage_layers, model.last_stage_layers)


@functools.lru_cache(maxsize=8)
def _dims(config: str):
    from megarefit import ModelDims
    from megarefit.layout.dims import load_hf_config

    cfg = dict(load_hf_config(str(ROOT / "tests/data/configs" / config)))
    return cfg, ModelDims.from_hf_config(cfg)


def _layout(dims, key: tuple):
    from megarefit import SourceLayout

    tp, pp, ep, first, last = key
    return SourceLayout.build(tp=tp, pp=pp, ep=ep, etp=1, padded_vocab_size=dims.padded_vocab_size(tp),
                              num_layers=dims.num_layers, first_stage_layers=first, last_stage_layers=last)


def _kind(spec) -> str:
    """A source tensor's holders class: Megatron-replicated (``Role.REPLICATED``: every rank of
    its stage), expert (its expert-data-parallel copies), or a TP shard (every rank of the stage
    with its dense tp rank)."""
    from megarefit.specs.table import Role

    if spec.role is Role.REPLICATED:
        return "replicated"
    return "expert" if spec.per_expert or spec.role.value.startswith("expert_") else "tp"


def per_kind_bytes(plan) -> dict[tuple[int, int, int, str], int]:
    """Bytes a plan reads from each trainer coordinate, by the kind of source tensor:
    ``{(tp, pp, ep, kind): bytes}`` (``kind`` in ``KINDS``)."""
    import torch

    table, cols = plan.ops.sources, plan.ops.columns  # plan_megatron_to_vllm plans are columnar
    group = table.group[cols.src_id]
    nbytes = torch.zeros(len(table.groups), dtype=torch.int64).index_add_(0, group, plan.ops.nbytes()).tolist()
    out: Counter = Counter()
    for g, b in zip(table.groups, nbytes):
        if b:
            out[(g.rank.tp, g.rank.pp, g.rank.ep, _kind(g.spec))] += b
    return dict(out)


def plan_worker(job: tuple) -> dict:
    """One vLLM worker's plan: bytes, ops, scratch bytes, bytes per trainer coordinate
    (``per_source``: ``{(tp, pp, ep): bytes}``) and per coordinate and kind (``per_kind``).
    ``job``: ``(config, trainer_key, vllm tp, vllm dp, vllm ep, rank, quant)``."""
    config, key, vtp, vdp, vep, rank, quant = job
    from megarefit.quant.fp8 import resolve_quantization
    from megarefit.targets import VllmTarget, plan_megatron_to_vllm

    cfg, dims = _dims(config)
    q = resolve_quantization("fp8", cfg) if quant == "fp8" else None
    target = VllmTarget(vtp, rank % vtp, dp=vdp, dp_rank=rank // vtp, expert_parallel=vep)
    plan = plan_megatron_to_vllm(dims, _layout(dims, key), "bfloat16", target, quantization=q)
    s = plan.summary()
    return {"rank": rank, "bytes": s["total"]["bytes"], "ops": s["total"]["ops"],
            "scratch_bytes": s["total"]["scratch_bytes"],
            "per_source": {tuple(c): v["bytes"] for c, v in s["per_rank"].items()}, "per_kind": per_kind_bytes(plan)}


def _logical(group) -> tuple:
    """The logical tensor a source group's instances are shards of, whichever trainer holder
    serves it: its Megatron name template and suffix, its pipeline stage, and the shard -- the
    tp rank of a TP shard, the expert rank of an expert shard, nothing for a replicated tensor
    (every holder of a stage keeps the same bytes)."""
    r = group.rank
    kind = _kind(group.spec)
    shard = {"tp": (r.tp,), "expert": (r.ep,), "replicated": ()}[kind]
    return (group.spec.megatron, group.suffix, kind, r.pp, *shard)


def plan_pieces(plan) -> tuple[dict[tuple, int], dict[tuple, tuple], int]:
    """A plan's reads by logical identity: ``{piece: bytes}``, each piece ``(logical tensor
    (_logical), local layer, local expert, flat element offset, box lengths)`` -- the same
    bytes of the same HF tensor whichever holder a plan names; ``{piece: (tp, pp, ep, kind)}``
    (the coordinate read, for the sender term); and the bytes of its largest layer group (a
    decoder layer's targets, or one non-layer target: what a streamed receiver pulls at once)."""
    import torch

    table, cols = plan.ops.sources, plan.ops.columns
    logical = [_logical(g) for g in table.groups]
    coord = [(g.rank.tp, g.rank.pp, g.rank.ep, _kind(g.spec)) for g in table.groups]
    nbytes = plan.ops.nbytes()
    lens = cols.src_len.tolist()
    pieces: dict[tuple, int] = {}
    where: dict[tuple, tuple] = {}
    for g, lay, exp, flat, ln, b in zip(table.group[cols.src_id].tolist(), table.layer[cols.src_id].tolist(),
                                        table.expert[cols.src_id].tolist(), cols.src_flat.tolist(), lens,
                                        nbytes.tolist()):
        while len(ln) > 1 and ln[0] == 1:
            ln = ln[1:]
        key = (logical[g], lay, exp, flat, tuple(ln))
        pieces[key] = pieces.get(key, 0) + b
        where[key] = coord[g]
    from megarefit.online.receiver.stream import layer_of

    targets = plan.ops.targets
    layers = torch.tensor([-1 if (x := layer_of(targets.ref(i).name)) is None else x for i in range(len(targets))],
                          dtype=torch.int64)
    layer = layers[cols.dst_id]
    run = torch.where(layer >= 0, layer, -2 - cols.dst_id)
    _, inverse = torch.unique(run, return_inverse=True)
    group = torch.zeros(int(inverse.max()) + 1 if len(inverse) else 1, dtype=torch.int64).index_add_(0, inverse, nbytes)
    return pieces, where, int(group.max())


def plan_node(job: tuple) -> dict:
    """One vLLM node's receivers and what they share. ``job``: ``(config, trainer_key, vllm tp,
    vllm dp, vllm ep, quant, members)``, ``members`` the engine ranks of the node's GPUs (a rank
    once per replica on the node). Each distinct rank is planned (``plan_megatron_to_vllm``).

    Returns ``{"ranks": {rank: {"bytes": W, "shared": S, "nic": bytes over its own NIC,
    "nvlink": bytes in (= out) over NVLink, "group": largest layer group}}, "distinct": bytes
    the node pulls, each piece once, "per_kind": {(tp, pp, ep, kind): those bytes}}``. A piece
    more than one node-mate needs (``c`` of them) is split evenly among them: each pulls 1/c
    over its NIC and sends it to the others over NVLink (so NIC = W - S + sum b/c, NVLink in =
    out = sum b (c-1)/c; W - (n-1)/n S when every shared piece is needed by all n)."""
    config, key, vtp, vdp, vep, quant, members = job
    from megarefit.quant.fp8 import resolve_quantization
    from megarefit.targets import VllmTarget, plan_megatron_to_vllm

    cfg, dims = _dims(config)
    q = resolve_quantization("fp8", cfg) if quant == "fp8" else None
    planned = {}
    for rank in sorted(set(members)):
        target = VllmTarget(vtp, rank % vtp, dp=vdp, dp_rank=rank // vtp, expert_parallel=vep)
        planned[rank] = plan_pieces(plan_megatron_to_vllm(dims, _layout(dims, key), "bfloat16", target, quantization=q))
    return node_sharing({r: p for r, (p, _, _) in planned.items()}, members,
                        {r: w for r, (_, w, _) in planned.items()}, {r: g for r, (_, _, g) in planned.items()})


def node_sharing(pieces: dict[int, dict], members: tuple[int, ...], where: dict[int, dict],
                 groups: dict[int, int]) -> dict:
    """``plan_node``'s sums from each distinct rank's ``plan_pieces``."""
    need = Counter(k for r in members for k in pieces[r])
    ranks = {}
    for r, own in pieces.items():
        shared = {k: b for k, b in own.items() if need[k] > 1}
        s = sum(shared.values())
        w = sum(own.values())
        ranks[r] = {"bytes": w, "shared": s, "nic": w - s + sum(b / need[k] for k, b in shared.items()),
                    "nvlink": sum(b * (need[k] - 1) / need[k] for k, b in shared.items()), "group": groups[r]}
    distinct: dict[tuple, int] = {}
    per_kind: Counter = Counter()
    for r, own in pieces.items():
        for k, b in own.items():
            if k not in distinct:
                distinct[k] = b
                per_kind[where[r][k]] += b
    return {"ranks": ranks, "distinct": sum(distinct.values()), "per_kind": dict(per_kind)}


def plan_trainer(job: tuple) -> dict:
    """Bytes each trainer coordinate serves for one copy of every HF tensor (bf16), and of
    them its expert bytes: ``{(tp, pp, ep): (served, expert)}``. ``job``: ``(config, trainer_key)``."""
    config, key = job
    from megarefit.layout.geometry import source_tensors
    from megarefit.planner import plan_megatron_to_hf

    _, dims = _dims(config)
    layout = _layout(dims, key)
    served = plan_megatron_to_hf(dims, layout, "bfloat16").summary()["per_rank"]
    out = {}
    for c, tensors in source_tensors(dims, layout).items():
        expert = sum(2 * _numel(t.shape) for t in tensors.values() if t.expert is not None)
        out[tuple(c)] = (served.get(c, {"bytes": 0})["bytes"], expert)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def worker_jobs(case: Case, quant: str | None = None) -> list[tuple]:
    """The plans a case needs: every worker of its engine, at ``quant`` (default: the case's)."""
    m = case.model
    return [(m.config, trainer_key(m, case.trainer_ep), m.vllm_tp, m.vllm_dp, m.vllm_ep, r, quant or case.quant)
            for r in range(m.engine)]


def case_workers(case: Case, plans: dict) -> list[dict]:
    """The case's planned workers, each with its bytes at bf16 beside (``bf16_bytes``)."""
    return [{**plans[j], "bf16_bytes": plans[b]["bytes"]}
            for j, b in zip(worker_jobs(case), worker_jobs(case, "bf16"))]


def _source_digest() -> str:
    """A digest of megarefit's source (the plans' inputs besides the job): the cache key's salt."""
    import megarefit

    h = hashlib.sha256()
    for f in sorted(Path(megarefit.__file__).parent.rglob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _cached(fn, jobs: list[tuple], cache: Path | None, processes: int) -> dict:
    """``{job: fn(job)}``, from ``cache`` (one pickle per function and source digest) where it
    has them, the rest planned in ``processes`` processes and added to it."""
    from concurrent.futures import ProcessPoolExecutor

    path = cache / f"{fn.__name__}-{_source_digest()}.pkl" if cache else None
    done = pickle.loads(path.read_bytes()) if path and path.exists() else {}
    todo = [j for j in jobs if j not in done]
    if todo:
        with ProcessPoolExecutor(processes) as pool:
            done.update(zip(todo, pool.map(fn, todo, chunksize=4)))
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(pickle.dumps(done))
    return {j: done[j] for j in jobs}


def plan_all(cases: list[Case], processes: int = 2, cache: Path | None = None) -> tuple[dict, dict, dict]:
    """Every distinct worker, trainer and vLLM-node plan the cases need, in ``processes``
    processes, kept in ``cache`` (a folder; None: no cache)."""
    ok = [c for c in cases if feasible(c) is None]
    workers = sorted({j for c in ok for q in {c.quant, "bf16"} for j in worker_jobs(c, q)}, key=str)
    trainers = sorted({(c.model.config, trainer_key(c.model, c.trainer_ep)) for c in ok}, key=str)
    nodes = sorted({j for c in ok for j in node_jobs(c)}, key=str)
    return (_cached(plan_worker, workers, cache, processes), _cached(plan_trainer, trainers, cache, processes),
            _cached(plan_node, nodes, cache, processes))


# ---- the multi-node model -------------------------------------------------------------------

def feasible(case: Case) -> str | None:
    """Why the case cannot run as stated, or None."""
    m = case.model
    if m.engine > case.vllm_gpus:
        return f"the vLLM engine needs {m.engine} GPUs, the case gives it {case.vllm_gpus}"
    if case.trainer_gpus % (m.trainer_pp * max(m.trainer_tp, case.trainer_ep)):
        return f"{case.trainer_gpus} trainer GPUs do not hold pp {m.trainer_pp} x tp {m.trainer_tp} x ep {case.trainer_ep}"
    return None


def delta_fraction(delta: float, quant: str) -> float:
    """Share of the pulled bytes a delta refit moves: changed elements plus 16-bit offsets (2 bytes
    a change) or a bitmap (1 bit an element), whichever is smaller (docs/delta.md)."""
    width = 1 if quant == "fp8" else 2
    return min(1.0, delta * (1 + 2 / width), delta + 1 / (8 * width))


def gpu_coordinate(g: int, tp: int, pp: int, ep: int, world: int) -> tuple[int, int, int]:
    """Trainer GPU ``g``'s ``(tp, pp, ep)`` in Megatron's rank order (tp-cp-ep-dp-pp: pp slowest,
    tp fastest; with etp 1 the expert rank is the stage-local rank mod ep)."""
    stage = world // pp
    return g % stage % tp, g // stage, g % stage % ep


def coordinate_gpu(coord: tuple[int, int, int], tp: int, ep: int, world: int, pp: int = 1) -> int:
    """The first GPU in Megatron's rank order holding trainer coordinate ``(tp, pp, ep)``: the
    one that serves it today (``Publisher.from_megatron``: data-parallel copies serve nothing)."""
    return next(g for g in range(world) if gpu_coordinate(g, tp, pp, ep, world) == tuple(coord))


def engine_bytes(workers: list[dict]) -> Counter:
    """What one vLLM replica reads: every worker's ``per_kind`` summed, ``{(tp, pp, ep, kind): bytes}``."""
    total: Counter = Counter()
    for w in workers:
        total.update(w["per_kind"])
    return total


def sender_bytes(case: Case, workers: list[dict]) -> dict:
    """Today: bytes each serving trainer coordinate sends ONE vLLM replica, ``{(tp, pp, ep): bytes}``:
    the sum over every worker of the engine of what it reads there (tensors vLLM keeps whole on
    every tp rank -- norms, routers, MLA's fused_qkv_a_proj, shared experts under EP -- are read
    by every worker that holds them). Each coordinate is served by one GPU, its first copy."""
    out: Counter = Counter()
    for (t, p, e, _), b in engine_bytes(workers).items():
        out[(t, p, e)] += b
    return dict(out)


def holders(kind: str, world: int, tp: int, pp: int, ep: int) -> int:
    """Trainer GPUs that hold a piece of ``kind`` (etp 1): a TP shard every GPU of its stage with
    its dense tp rank (data-parallel copies, and under EP the stage's ranks of that tp rank); an
    expert shard its expert-data-parallel copies; a Megatron-replicated tensor its whole stage."""
    stage = world // pp
    return {"tp": stage // tp, "expert": stage // ep, "replicated": stage}[kind]


def spread_sender_bytes(case: Case, workers: list[dict]) -> dict[int, float]:
    """The new design: every trainer data-parallel copy serves and every source byte is spread
    evenly over all its holders. Bytes each trainer GPU sends ONE vLLM replica, ``{gpu: bytes}``:
    over every piece it holds, the bytes every worker reads of it over the piece's holders."""
    return spread_bytes(case, engine_bytes(workers))


def spread_bytes(case: Case, per_kind: Counter) -> dict[int, float]:
    """``per_kind`` (``{(tp, pp, ep, kind): bytes}`` one vLLM replica reads) spread evenly over
    every trainer GPU holding each piece (``holders``): ``{gpu: bytes}``."""
    m, world = case.model, case.trainer_gpus
    tp, pp, ep = m.trainer_tp, m.trainer_pp, case.trainer_ep
    tp_b, ex_b, rep_b = Counter(), Counter(), Counter()  # by (pp, tp rank), (pp, ep rank), pp
    for (t, p, e, kind), b in per_kind.items():
        if kind == "tp":
            tp_b[(p, t)] += b / holders(kind, world, tp, pp, ep)
        elif kind == "expert":
            ex_b[(p, e)] += b / holders(kind, world, tp, pp, ep)
        else:
            rep_b[p] += b / holders(kind, world, tp, pp, ep)
    out = {}
    for g in range(world):
        t, p, e = gpu_coordinate(g, tp, pp, ep, world)
        out[g] = tp_b[(p, t)] + ex_b[(p, e)] + rep_b[p]
    return out


def receiver_s(case: Case, worker: dict, gpu: int, f: float, rates: dict) -> float:
    """One worker's pull: remote bytes over its NIC, same-node bytes over NVLink, at once."""
    if case.placement == "split":
        return f * worker["bytes"] / rates["nic"]
    m = case.model
    local = sum(b for c, b in worker["per_source"].items()
                if coordinate_gpu(c, m.trainer_tp, case.trainer_ep, case.trainer_gpus, m.trainer_pp) // NODE_GPUS
                == gpu // NODE_GPUS)
    return f * max((worker["bytes"] - local) / rates["nic"], local / rates["link"])


def sender_s(case: Case, per_replica: float, replicas: int, f: float, rates: dict) -> float:
    """The busiest trainer GPU: ``replicas`` x its per-replica bytes; colocated, the receivers on
    its own node (a share 8/GPUs of them) take theirs over NVLink."""
    nbytes = f * per_replica * replicas
    if case.placement == "split":
        return nbytes / rates["nic"]
    local = min(1.0, NODE_GPUS / case.gpus)
    return max(nbytes * (1 - local) / rates["nic"], nbytes * local / rates["link"])


def tree_depth(replicas: int, k: int) -> int:
    """Hops from the root to the deepest of ``replicas`` members of a k-ary tree in
    registration order (``arena.tree_parent``: member i reads member (i - 1) // k)."""
    depth, i = 0, replicas - 1
    while i > 0:
        i, depth = (i - 1) // k, depth + 1
    return depth


def pull_s(case: Case, worst: dict, recv: float, per_replica: float, f: float, rates: dict,
           hop_bytes: float | None = None, group_bytes: float | None = None) -> tuple[float, str]:
    """The pull's seconds and how: direct, or the best fan-out tree. A tree member sends its
    ``k`` children ``hop_bytes`` each (default: the worker's bytes; a delta refit's replicas
    still mirror whole arenas) over its NIC: store and
    forward (``group_bytes`` None: a whole arena per hop, ``first + depth x send``) or
    cut-through (each layer group forwarded as it lands: a pipeline of ``G = hop_bytes /
    group_bytes`` groups through the root's pull and ``depth`` sends, ``a + depth x b + (G - 1) x
    max(a, b)`` with ``a = first / G``, ``b = send / G``: store and forward at ``G = 1``, the
    slower stage plus one group per hop as ``G`` grows)."""
    replicas = case.vllm_gpus // case.model.engine
    send_all = sender_s(case, per_replica, replicas, f, rates)
    bound = "worker link" if recv >= send_all else f"trainer NIC, {replicas} replica" + "s" * (replicas > 1)
    best = (max(recv, send_all), f"direct; {bound}")
    first = max(recv, sender_s(case, per_replica, 1, f, rates))
    hop = (worst["bytes"] if hop_bytes is None else hop_bytes) / rates["nic"]  # a delta too: whole arenas
    for k in range(1, ASSUMPTIONS["fanout_max"] + 1 if replicas > 1 else 1):
        d = tree_depth(replicas, k)
        if group_bytes is None:
            t, how = first + d * k * hop, f"tree k={k}, {d} hops"
        else:
            g = max(1.0, (worst["bytes"] if hop_bytes is None else hop_bytes) / group_bytes)
            a, b = first / g, k * hop / g
            t, how = a + d * b + (g - 1) * max(a, b), f"cut-through tree k={k}, {d} hops"
        if t < best[0]:
            best = (t, how)
    return best


def model_rates(cal: dict[str, float], efficiency: float | None = None) -> dict[str, float]:
    """The calibrated rates plus the NIC's achievable bytes/s (line rate x ``efficiency``)."""
    eff = ASSUMPTIONS["nic_efficiency"] if efficiency is None else efficiency
    return {**cal, "nic": ASSUMPTIONS["nic_line_bytes_per_s"] * eff}


def busiest_sender(case: Case, workers: list[dict], design: str = "today") -> float:
    """Bytes the busiest trainer GPU sends one vLLM replica, at the wire dtype: ``design``
    "today" (first copies serve, ``sender_bytes``) or "new" (every copy, ``spread_sender_bytes``)."""
    if design == "today":
        return max(sender_bytes(case, workers).values())
    if design == "new":
        return max(spread_sender_bytes(case, workers).values())
    raise ValueError(f"design must be 'today' or 'new', got {design!r}")


def predict(case: Case, delta: float, workers: list[dict], shares: dict, cal: dict,
            efficiency: float | None = None, design: str = "today") -> dict:
    """Seconds per term for one case: the slowest of its planned workers decides. ``workers``:
    ``plan_worker`` results (every worker of the engine) with ``bf16_bytes``; ``shares``:
    ``plan_trainer``'s; ``design``: who serves (``busiest_sender``)."""
    rates = model_rates(cal, efficiency)
    f = delta_fraction(delta, case.quant)
    recvs = [receiver_s(case, w, w["rank"], f, rates) for w in workers]  # colocated: the first engine, rank r on GPU r
    worst = workers[max(range(len(workers)), key=lambda i: (recvs[i], workers[i]["bytes"]))]
    per_replica = busiest_sender(case, workers, design)
    pull = pull_s(case, worst, max(recvs), per_replica, f, rates)
    return _cycle(case, delta, worst, pull, per_replica, shares, rates, design)


def _cycle(case: Case, delta: float, worst: dict, pull: tuple[float, str], per_replica: float, shares: dict,
           rates: dict, design: str) -> dict:
    """``predict``'s terms around a pull: quantize, copies and fixed costs of the worst worker."""
    f = delta_fraction(delta, case.quant)
    quantize = max(s for s, _ in shares.values()) / rates["quantize"] if case.quant == "fp8" else 0.0
    fixed = rates["overhead_s"] + rates["per_op_s"] * worst["ops"]
    copies = f * worst["scratch_bytes"] / rates["box"] + worst["bytes"] / rates["install"]
    return {"quantize_s": quantize, "pull_s": pull[0], "copies_s": copies, "fixed_s": fixed,
            "seconds": quantize + pull[0] + copies + fixed, "pull_path": pull[1], "delta": delta,
            "delta_bytes_share": f, "worker_bytes": worst["bytes"], "worker_rank": worst["rank"],
            "worker_ops": worst["ops"], "sender_bytes_per_replica": per_replica,
            "replicas": case.vllm_gpus // case.model.engine, "design": design,
            "nic_efficiency": rates["nic"] / ASSUMPTIONS["nic_line_bytes_per_s"]}


# ---- node-local dedup (issue 60) ------------------------------------------------------------

def node_members(case: Case) -> tuple[list[tuple[int, ...]], float] | None:
    """The distinct vLLM nodes of a case (``NODE_GPUS`` GPUs each, engines placed in order: GPU
    ``g`` is rank ``g % engine`` of replica ``g // engine``), each as its GPUs' engine ranks, and
    the share of a node one replica is (an engine of 16 GPUs: two nodes, share 1 each; of 2 GPUs:
    four replicas a node, share 1/4). None where nodes and engines do not tile."""
    e = case.model.engine
    if case.placement != "split" or case.vllm_gpus % NODE_GPUS:
        return None
    if e % NODE_GPUS == 0:
        return [tuple(range(k * NODE_GPUS, (k + 1) * NODE_GPUS)) for k in range(e // NODE_GPUS)], 1.0
    if NODE_GPUS % e == 0:
        return [tuple(r % e for r in range(NODE_GPUS))], e / NODE_GPUS
    return None


def node_jobs(case: Case) -> list[tuple]:
    """``plan_node`` jobs of a case (none where ``node_members`` is None)."""
    m, nodes = case.model, node_members(case)
    return [(m.config, trainer_key(m, case.trainer_ep), m.vllm_tp, m.vllm_dp, m.vllm_ep, case.quant, members)
            for members in (nodes[0] if nodes else [])]


def dedup_receiver_s(x: dict, f: float, rates: dict) -> float:
    """A node-mate's pull under node dedup: its NIC bytes and its NVLink bytes (in and out are
    equal) stream by layer group, overlapped; then the last group's share of NVLink bytes."""
    tail = x["group"] * x["nvlink"] / x["bytes"] if x["bytes"] else 0.0
    return f * (max(x["nic"] / rates["nic"], x["nvlink"] / rates["link"]) + tail / rates["link"])


def predict_dedup(case: Case, delta: float, workers: list[dict], nodes: list[dict], shares: dict, cal: dict,
                  efficiency: float | None = None) -> dict:
    """The node-dedup design: every trainer copy serves, bytes spread over all holders, each
    piece more than one node-mate needs crosses the node's NICs once (split among its needers)
    and reaches the others over NVLink; fan-out trees cut through. The slowest node-mate of the
    slowest node decides (``nodes``: ``plan_node`` results of ``node_jobs(case)``)."""
    rates = model_rates(cal, efficiency)
    f = delta_fraction(delta, case.quant)
    mates = [x | {"rank": r} for n in nodes for r, x in n["ranks"].items()]
    x = max(mates, key=lambda y: (dedup_receiver_s(y, f, rates), y["bytes"]))
    worst = next(w for w in workers if w["rank"] == x["rank"])
    share = node_members(case)[1]
    per_kind: Counter = Counter()
    for n in nodes:
        per_kind.update({k: b * share for k, b in n["per_kind"].items()})
    per_replica = max(spread_bytes(case, per_kind).values())
    recv = dedup_receiver_s(x, f, rates)
    pull = pull_s(case, worst, recv, per_replica, f, rates, x["nic"], x["group"])
    out = _cycle(case, delta, worst, pull, per_replica, shares, rates, "dedup")
    stored = pull_s(case, worst, recv, per_replica, f, rates, x["nic"])  # the same with today's trees
    return out | {"node_bytes": x["bytes"], "node_shared": x["shared"], "node_nic": x["nic"],
                  "node_nvlink": x["nvlink"], "node_group": x["group"], "node_gpus": NODE_GPUS,
                  "store_and_forward_s": out["seconds"] - pull[0] + stored[0], "store_and_forward_path": stored[1]}


# ---- rows, tables, main ---------------------------------------------------------------------

def meta() -> dict:
    """The commit (``+uncommitted src`` when the imported megarefit is this checkout's src/ and
    it has uncommitted changes), the date, this machine and its versions."""
    import megarefit
    from megarefit.demo.bench import machine

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    if ROOT / "src" in Path(megarefit.__file__).resolve().parents and git("status", "--porcelain", "--", "src"):
        commit += "+uncommitted src"
    return {"commit": commit, "date": time.strftime("%Y-%m-%d"), "machine": machine(),
            "megarefit": getattr(megarefit, "__version__", "?")}


def case_row(case: Case, delta: float, plans: tuple[dict, dict, dict], cal: dict, common: dict,
             efficiencies: dict[str, float] | None = None) -> dict:
    """One case's row: today's design at the assumed NIC efficiency (top level), the new design
    at each of ``efficiencies`` (``new``, keyed by label; default ``NEW_EFFICIENCIES`` labelled
    ``f"{e:.2f}"``), the node-dedup design at the same efficiencies (``dedup``; None where
    nodes and engines do not tile, ``node_members``), and the new design's balance
    (``new_busiest_over_mean``: busiest trainer GPU's bytes over the mean)."""
    m = case.model
    row = {"kind": "prediction", "model": m.name, "config": m.config, "gpus": case.gpus,
           "trainer_gpus": case.trainer_gpus, "vllm_gpus": case.vllm_gpus, "placement": case.placement,
           "quant": case.quant, "anchor": case.anchor, "delta": delta,
           "trainer": {"tp": m.trainer_tp, "pp": m.trainer_pp, "ep": case.trainer_ep, "etp": 1},
           "vllm": {"tp": m.vllm_tp, "dp": m.vllm_dp, "expert_parallel": m.vllm_ep, "engine_gpus": m.engine},
           "infeasible": feasible(case), **common}
    if row["infeasible"] is None:
        workers = case_workers(case, plans[0])
        shares = plans[1][(m.config, trainer_key(m, case.trainer_ep))]
        row.update(predict(case, delta, workers, shares, cal))
        effs = efficiencies or {f"{e:.2f}": e for e in NEW_EFFICIENCIES}
        row["new"] = {k: predict(case, delta, workers, shares, cal, e, "new") for k, e in effs.items()}
        nodes = [plans[2][j] for j in node_jobs(case)]
        row["dedup"] = {k: predict_dedup(case, delta, workers, nodes, shares, cal, e)
                        for k, e in effs.items()} if nodes else None
        spread = spread_sender_bytes(case, workers).values()
        row["new_busiest_over_mean"] = max(spread) / (sum(spread) / len(spread))
    return row


def run(cache: Path | None = None, processes: int = 2, cluster: list[str] | None = None) -> list[dict]:
    """Calibrate, plan every case, model it: the rows ``--json`` records. ``cluster``: emulated
    cluster records (``cluster_link``); where they hold link rows, the new design is also
    predicted at the NIC efficiency measured there."""
    cal = calibrate()
    link = cluster_link(cluster or [])
    effs = {f"{e:.2f}": e for e in NEW_EFFICIENCIES}
    if link:
        effs[f"{link['nic_efficiency']:.3f} (cluster)"] = link["nic_efficiency"]
    common = {**meta(), "assumptions": ASSUMPTIONS, "rates": model_rates(cal),
              "calibrated_on": RECORDED["nixl"], "cluster_link": link}  # the commit as planning starts
    anchors = [a["case"] for a in ANCHORS]
    t0 = time.perf_counter()
    plans = plan_all(CASES + anchors + TREE_CASES, processes, cache)
    print(f"planned in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    rows = [case_row(c, d, plans, cal, common, effs) for c in CASES for d in (1.0, ASSUMPTIONS["delta_low"])]
    rows += [case_row(c, 1.0, plans, cal, common, effs) for c in anchors]
    rows += [case_row(c, 1.0, plans, cal, common, effs) for c in TREE_CASES]
    rows += [{**r, **common} for r in calibration_rows(cal)]
    rows += [{"kind": "anchor", **{k: v for k, v in a.items() if k != "case"}, **common} for a in ANCHORS]
    return rows


# ---- calibrating the link terms on the emulated cluster (issue 58, item 5) ------------------

def cluster_link(paths: list[str]) -> dict | None:
    """The NIC efficiency measured on the emulated cluster, or None where no file holds link rows.

    Reads rows ``{"kind": "link", "label", "role": "fit" | "held out", "line_bytes_per_s": the
    veth's configured (tc) rate, "bytes": the busiest trainer veth's bytes in one pull,
    "seconds": that pull's measured seconds}`` from the JSON-lines files ``paths`` (recorded by
    ``benchmarks/bench_cluster.py``, e.g. ``docs/cluster_*.jsonl``). The efficiency is the median
    of ``bytes / seconds / line`` over the fit rows; ``rows`` gives every row's predicted link
    seconds (``bytes / (line x efficiency)``) and its error, the bar being ``TOLERANCE``.

    Raises:
        ValueError: link rows but none marked "fit" (nothing to calibrate on).
    """
    rows = [x for path in paths for r in load(path) for x in ([r] if r.get("kind") == "link" else _bench_rows(r))]
    if not rows:
        return None
    fit = [r for r in rows if r.get("role") == "fit"]
    if not fit:
        raise ValueError(f"{paths}: {len(rows)} link rows, none with role 'fit'; mark the rows to calibrate on")
    eff = statistics.median(r["bytes"] / r["seconds"] / r["line_bytes_per_s"] for r in fit)
    checked = [{"label": r.get("label", ""), "role": r.get("role", "held out"), "measured_s": r["seconds"],
                "predicted_s": (p := r["bytes"] / (r["line_bytes_per_s"] * eff)), "error": p / r["seconds"] - 1}
               for r in rows]
    return {"nic_efficiency": eff, "sources": list(paths), "rows": checked,
            "within_tolerance": all(abs(c["error"]) <= TOLERANCE for c in checked)}


def _bench_rows(r: dict) -> list[dict]:
    """Link rows of one ``benchmarks/bench_cluster.py`` record: its raw NIXL READs (fit: the
    efficiency), then each refit's busiest trainer veth per warm cycle (held out)."""
    if "link" not in r or "refits" not in r:
        return []
    line = r["rate_mbit"] * 1e6 / 8
    link = r["link"]
    out = [{"kind": "link", "label": f"raw READ, {r['rate_mbit']:.0f} Mbit/s", "role": "fit",
            "line_bytes_per_s": line, "bytes": link["nbytes"], "seconds": statistics.median(link["seconds"])}]
    for who, rf in r["refits"].items():
        out.append({"kind": "link", "label": f"refit, {who} serving (dp{r['dp']} x tp{r['tp']}, {r['receivers']} "
                    "receivers), busiest veth", "role": "held out", "line_bytes_per_s": line,
                    "bytes": max(rf["trainer_bytes_per_cycle"].values()), "seconds": rf["median_warm_s"]})
    return out


def cluster_table(paths: list[str]) -> str:
    """The link term against the emulated cluster: every row's measured and predicted seconds."""
    link = cluster_link(paths)
    if link is None:
        return f"No emulated-cluster records in {paths}."
    out = ["| row | fit or held out | measured s | predicted s (bytes / (line x efficiency)) | error |",
           "|---|---|---|---|---|"]
    out += [f"| {c['label']} | {c['role']} | {c['measured_s']:.3f} | {c['predicted_s']:.3f} | {c['error']:+.1%} |"
            for c in link["rows"]]
    verdict = "within" if link["within_tolerance"] else "NOT within"
    out += ["", f"NIC efficiency {link['nic_efficiency']:.3f} (fit on the raw READs); every row {verdict} "
                f"{TOLERANCE:.0%} ({', '.join(link['sources'])})."]
    return "\n".join(out)


def _assumption_line(r: dict) -> str:
    a, x = r["assumptions"], r["rates"]
    d = a["delta_low"]
    return (f"Assumptions: {a['gpus_per_node']} GPUs per node, one NIC per GPU at "
            f"{a['nic_line_bytes_per_s'] / GB:.0f} GB/s line x {a['nic_efficiency']:.2f} efficiency = "
            f"{x['nic'] / GB:.0f} GB/s; NVLink {x['link'] / GB:.0f} GB/s, install {x['install'] / GB:.0f} GB/s, "
            f"BoxCopies {x['box'] / GB:.0f} GB/s, FP8 quantize {x['quantize'] / GB:.0f} GB/s, fixed "
            f"{x['overhead_s'] * 1e3:.2f} ms + {x['per_op_s'] * 1e6:.2f} us per op (calibrated on "
            f"{r['calibrated_on']}); delta: {d:g} of the elements changed moves {delta_fraction(d, 'bf16'):.2f} of "
            f"the bf16 bytes, {delta_fraction(d, 'fp8'):.2f} of the FP8 bytes. Planned at megarefit {r['commit']}, "
            f"{r['date']}, on {r['machine']}.")


def _engine(r: dict) -> str:
    v = r["vllm"]
    ep = " EP" if v["expert_parallel"] else ""
    return f"tp{v['tp']}" + (f" dp{v['dp']}" if v["dp"] > 1 else "") + ep


def _gpus(r: dict) -> str:
    return f"{r['gpus']} colocated" if r["placement"] == "colocated" else f"{r['trainer_gpus']} + {r['vllm_gpus']}"


def _new_s(r: dict) -> str:
    """The new design's seconds at each recorded NIC efficiency, ``" / "``-joined."""
    return " / ".join(f"{v['seconds']:.2f}" for v in r["new"].values())


def _new_heading(r: dict, unit: str = " s") -> str:
    return f"new design{unit}, NIC " + " / ".join(r["new"])


def _cluster_line(r: dict) -> str:
    link = r.get("cluster_link")
    if not link:
        return ("Link terms not yet calibrated on the emulated cluster: no link rows in "
                f"{CLUSTER_GLOB} (`cluster_link` reads them once the emulated-cluster benchmark records them).")
    worst = max(abs(c["error"]) for c in link["rows"])
    return (f"Link terms calibrated on the emulated cluster ({', '.join(link['sources'])}): NIC efficiency "
            f"{link['nic_efficiency']:.3f}, largest error {worst:.1%} over {len(link['rows'])} rows (bar "
            f"{TOLERANCE:.0%}); the last new-design column is at that efficiency.")


def predictions_table(rows: list[dict]) -> str:
    preds = [r for r in rows if r["kind"] == "prediction" and not r["anchor"]]
    low = {(r["model"], r["gpus"], r["quant"]): r for r in preds if r["delta"] < 1}
    first = next(r for r in preds if r["infeasible"] is None)
    lines = [_assumption_line(preds[0]), "", _cluster_line(preds[0]), "",
             f"| model | GPUs: trainer + vLLM | wire | vLLM engine | worker GB | today: pull path | quantize s "
             f"| pull s | copies + fixed s | **today s** | today s, delta {preds[0]['assumptions']['delta_low']:g} "
             f"| new design: busiest / mean | **{_new_heading(first)}** |",
             "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in (r for r in preds if r["delta"] == 1):
        head = f"| {r['model']} | {_gpus(r)} | {r['quant']} | {_engine(r)}"
        if r["infeasible"]:
            lines.append(f"{head} | - | {r['infeasible']} | - | - | - | - | - | - | - |")
            continue
        d = low[(r["model"], r["gpus"], r["quant"])]
        lines.append(f"{head} x {r['replicas']} | {r['worker_bytes'] / GB:.1f} | {r['pull_path']} "
                     f"| {r['quantize_s']:.3f} | {r['pull_s']:.2f} | {r['copies_s'] + r['fixed_s']:.3f} "
                     f"| **{r['seconds']:.2f}** | {d['seconds']:.2f} | {r['new_busiest_over_mean']:.3f} "
                     f"| **{_new_s(r)}** |")
    return "\n".join(lines)


def calibration_table(rows: list[dict]) -> str:
    cal = [r for r in rows if r["kind"] == "calibration"]
    held = max(abs(r["error"]) for r in cal if r["role"] == "held out")
    x = next(r for r in rows if r["kind"] == "prediction")["rates"]
    lines = [f"Fitted on {sum(r['role'] == 'fit' for r in cal)} rows, the others held out; recorded on "
             f"{cal[0]['recorded_on']}. Link (NVLink: bytes / raw NIXL READ) {x['link'] / GB:.0f} GB/s; fixed "
             f"{x['overhead_s'] * 1e3:.2f} ms per cycle + {x['per_op_s'] * 1e6:.2f} us per op; BoxCopies "
             f"{x['box'] / GB:.0f} GB/s, strided copy_ {x['strided'] / GB:.0f} GB/s, install "
             f"{x['install'] / GB:.0f} GB/s, FP8 quantize {x['quantize'] / GB:.0f} GB/s. Largest error: "
             f"{max(abs(r['error']) for r in cal):.1%} (held out: {held:.1%}); the bar is {TOLERANCE:.0%}.", "",
             "| recorded case | role | GB | ops | scratch GB | measured warm ms (median) | model ms | error |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in cal:
        lines.append(f"| {r['label']} ({r['config']}, {r['expert_layout']}, {r['quantization']}) | {r['role']} "
                     f"| {r['bytes'] / GB:.2f} | {r['ops']} | {r['scratch_bytes'] / GB:.2f} "
                     f"| {r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | {r['error']:+.1%} |")
    return "\n".join(lines)


def anchors_table(rows: list[dict]) -> str:
    preds = {r["anchor"]: r for r in rows if r["kind"] == "prediction" and r["anchor"]}
    first = next(iter(preds.values()))
    lines = ["Published by other systems, on their own setups (not megarefit measurements), beside the model's "
             "prediction for megarefit on a like setup: today's design, and the new one (every trainer copy "
             "serves, every byte spread over all its holders).", "",
             "| published by | their setup | what they timed | their s | source | model: megarefit, GPUs, trainer, "
             "vLLM engine | model worker GB (theirs) | today: pull path | model s, today "
             f"| **model s, {_new_heading(first, '')}** |",
             "|---|---|---|---:|---|---|---:|---|---:|---:|"]
    for a in (r for r in rows if r["kind"] == "anchor"):
        p = preds[a["key"]]
        theirs = f" ({a['published_gb']:.3f})" if a["published_gb"] else ""
        t = p["trainer"]
        layout = f"pp{t['pp']} " * (t["pp"] > 1) + f"tp{t['tp']} ep{t['ep']}"
        lines.append(f"| {a['system']} | {a['setup']} | {a['timed']} | {a['seconds']} | {a['source']} "
                     f"| {p['model']}, {_gpus(p)}, trainer {layout}, {_engine(p)} x {p['replicas']}, {p['quant']} "
                     f"| {p['worker_bytes'] / GB:.3f}{theirs} | {p['pull_path']} | {p['seconds']:.2f} "
                     f"| **{_new_s(p)}** |")
    return "\n".join(lines)


def _dedup_line(r: dict) -> str:
    x = r["rates"]
    return (f"Node dedup: {NODE_GPUS} GPUs per vLLM node, one NIC each at {x['nic'] / GB:.0f} GB/s (0.80 x line); "
            f"same-host copies over NVLink at {x['link'] / GB:.0f} GB/s in and out per GPU (the calibrated link: "
            f"bytes / raw NIXL READ between two H200s, {r['calibrated_on']}). W: bytes the slowest receiver needs; "
            "S: those of them a node-mate also needs (same HF tensor, same byte region); NIC: what it pulls over "
            "its own NIC (W - S + each shared piece / its needers; W - 7/8 S when all 8 need every shared piece); "
            "NVLink: what it takes from node-mates (and gives). Seconds at NIC 0.80; 'stored' is the same design "
            "with today's store-and-forward trees.")


def _dedup_s(p: dict | None, key: str = "seconds") -> str:
    return "-" if p is None or p.get("dedup") is None else f"{p['dedup']['0.80'][key]:.2f}"


def dedup_table(rows: list[dict]) -> str:
    """Issue 60's table: now (every copy serving), with node dedup, FP8 with node dedup."""
    preds = {(r["model"], r["gpus"], r["anchor"], r["quant"]): r for r in rows
             if r["kind"] == "prediction" and r["delta"] == 1 and r["infeasible"] is None}
    lines = [_dedup_line(next(iter(preds.values()))), "",
             ("| model | GPUs: trainer + vLLM | vLLM engine | W GB | S GB | NIC GB | NVLink GB | now, every copy serving s "
              "| **with node dedup s** | **FP8 with node dedup s** | pull path, node dedup | stored: bf16 / FP8 s "
              "| issue 60 target s (bf16 / FP8) |"), "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for key in DEDUP_TABLE:
        r, q = preds[(*key, "bf16")], preds.get((*key, "fp8"))
        d = r["dedup"]["0.80"]
        target = " / ".join(f"<= {t}" if t else "-" for t in TARGETS.get(key, ("", "")))
        stored = f"{_dedup_s(r, 'store_and_forward_s')} / {_dedup_s(q, 'store_and_forward_s')}"
        lines.append(f"| {r['model']} | {_gpus(r)} | {_engine(r)} x {r['replicas']} | {d['node_bytes'] / GB:.1f} "
                     f"| {d['node_shared'] / GB:.1f} | {d['node_nic'] / GB:.1f} | {d['node_nvlink'] / GB:.1f} "
                     f"| {r['new']['0.80']['seconds']:.2f} | **{_dedup_s(r)}** | **{_dedup_s(q)}** "
                     f"| {d['pull_path']} | {stored} | {target} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the rows here (JSON lines)")
    ap.add_argument("--from-json", default=None, help="print a table of recorded rows (a --json file)")
    ap.add_argument("--summary", choices=["calibration", "anchors", "cluster", "dedup"],
                    help="that table instead of the predictions (cluster: the link term against docs/cluster_*.jsonl)")
    ap.add_argument("--cache", default=str(Path.home() / ".cache/megarefit/refit_on_paper"),
                    help="keep plans here, per megarefit source digest ('' for none)")
    ap.add_argument("--processes", type=int, default=1, help="planning processes")
    ap.add_argument("--cluster", nargs="*", default=None, metavar="JSONL",
                    help="emulated-cluster records to calibrate the NIC efficiency on (default: docs/cluster_*.jsonl)")
    ns = ap.parse_args(argv)
    cluster = ns.cluster if ns.cluster is not None else [str(f.relative_to(ROOT)) for f in
                                                        sorted(ROOT.glob(CLUSTER_GLOB))]
    if ns.summary == "cluster":
        print(cluster_table(cluster))
        return 0
    rows = load(ns.from_json) if ns.from_json else run(Path(ns.cache) if ns.cache else None, ns.processes, cluster)
    if ns.json:
        Path(ns.json).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print({"calibration": calibration_table, "anchors": anchors_table,
           "dedup": dedup_table}.get(ns.summary, predictions_table)(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
