"""``megarefit demo``: a real Megatron-Core -> HF transformers refit on CPU.

1. trainer: ``tp * pp`` gloo processes build a real Megatron-Core GPTModel (MambaModel for
   hybrid Mamba configs, :mod:`megarefit.demo.megatron_mamba`) from
   the HF config (random init), run a forward pass, and hand over their local
   shards (no gather);
2. plan: the slice plan from shapes alone, validated;
3. refit: ``run_refit_cycle`` streams ``(hf_name, tensor)`` pairs through the
   local transport into an HF transformers model (the ``load_weights`` role);
4. check: HF logits on the same tokens vs the Megatron forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable

import torch

from megarefit.errors import MegarefitError, UnsupportedModelError
from megarefit.layout import SourceLayout
from megarefit.layout.dims import ModelDims, load_hf_config
from megarefit.layout.megatron_model import check_stated
from megarefit.layout.shards import resolve_layer_spec
from megarefit.plan import Plan
from megarefit.planner import plan_megatron_to_hf
from megarefit.quant import dequantize_state, resolve_quantization
from megarefit.quant.planning import plan_fp8, quantize_sources, where_quantized
from megarefit.specs import family_for_config
from megarefit.transport.execute import RefitStats, run_refit_cycle
from megarefit.transport.local import LocalTransport

TOLERANCE = 1e-4  # max |logit difference| in fp32
FP8_TOLERANCE = 0.2  # block FP8 vs fp32 (information): max |logit difference| / max |logit|
FP8_COSINE = 0.99  # ... and the cosine similarity of the logits (information)
# With --quantization fp8 the verdict is the refit against a reference: the same Megatron weights,
# unquantized, each quantized WHOLE (quantize_fp8 on the full HF tensor, dequantized), in an HF
# model of their own. A refit that quantizes on the trainers per shard (blocks inside one shard)
# and on the receiver (blocks that straddle shards) must give the same FP8 values, so the two
# models' logits must agree like the fp32 check (TOLERANCE). FP8's own error against the fp32
# Megatron forward grows with depth and width on random weights (0.06-0.2 of the logit scale on
# the shrunk configs, 0.37 on the whole 28-layer Qwen3-0.6B): reported, not judged.


def default_config() -> dict[str, Any]:
    import json

    return json.loads(resources.files("megarefit.configs").joinpath("qwen3-tiny.json").read_text())


@dataclass
class DemoResult:
    config: dict[str, Any]
    dims: ModelDims
    plan: Plan
    stats: RefitStats
    max_logit_diff: float
    logit_scale: float
    loaded: int
    stages: dict[str, float] = field(default_factory=dict)
    quantization: Any = None  # Fp8Format, or None for the model dtype
    where: dict[str, str] = field(default_factory=dict)  # FP8: HF weight -> "trainer" / "receiver: reason"
    cosine: float = 1.0
    unquantized_bytes: int = 0  # bytes the same refit moves without quantization (the shards' dtype, fp32 here)
    notes: list[str] = field(default_factory=list)  # what shrinking the config changed (demo/shrink.py)
    reference_diff: float | None = None  # FP8: max |logit diff| against whole-tensor quantization of the weights

    @property
    def relative_error(self) -> float:
        return self.max_logit_diff / self.logit_scale if self.logit_scale else float("inf")

    @property
    def passed(self) -> bool:
        if self.quantization is not None:
            return self.reference_diff is not None and self.reference_diff < TOLERANCE and self.logit_scale > 0
        return self.max_logit_diff < TOLERANCE and self.logit_scale > 0


def check_memory(dims: ModelDims, tp: int, pp: int) -> None:
    """Refuse configs whose fp32 copies (Megatron shards, results, HF model) would not fit in RAM."""
    import os

    layout = SourceLayout.build(tp=tp, pp=pp, padded_vocab_size=dims.padded_vocab_size(tp), num_layers=dims.num_layers,
                                etp=dims.default_etp(tp))
    need = 4 * plan_megatron_to_hf(dims, layout, "float32").nbytes  # shards, their pickled copies, HF model, grads-free
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > have:
        raise MegarefitError(
            f"the demo builds the model in fp32 on CPU: ~{need / 1e9:.1f} GB needed, {have / 1e9:.1f} GB free; "
            "shrink the config (hidden_size, num_hidden_layers, vocab_size) or use `megarefit plan` for full sizes"
        )


def check_expert_layout(expert_layout: str, dims: ModelDims) -> None:
    """Raise :class:`MegarefitError` for an expert layout the CPU harness cannot build.

    ``te_grouped`` (``TEGroupedMLP``) needs Transformer Engine's grouped GEMM, a GPU package;
    a non-sequential layout on a dense config has no experts to lay out.
    """
    if expert_layout == "te_grouped":
        raise MegarefitError("--expert-layout te_grouped builds Transformer Engine's TEGroupedMLP, which needs TE and "
                             "a GPU; the CPU demo builds sequential or legacy_grouped (`megarefit plan "
                             "--expert-layout te_grouped` plans te_grouped from shapes)")
    if expert_layout not in ("sequential", "legacy_grouped"):
        raise MegarefitError(f"--expert-layout {expert_layout!r}: use sequential or legacy_grouped")
    if expert_layout != "sequential" and not dims.num_experts:
        raise MegarefitError(f"--expert-layout {expert_layout} needs an MoE config; this one has no experts")
    dims.check_expert_layout(expert_layout)


def run_demo(config: Any = None, *, tp: int = 2, pp: int = 1, ep: int = 1, etp: int | None = None, seq: int = 16,
             batch: int = 2, expert_layout: str = "sequential", seed: int = 1234, quantization: str = "none",
             shrink: bool = True, status: Callable[[str], None] = lambda _: None) -> DemoResult:
    """Run the demo end to end and return what happened (the CLI prints it).

    ``shrink`` (default): a config larger than a CPU demo is shrunk to a model of the same
    architecture first (:func:`~megarefit.demo.shrink.shrink_config`; ``result.notes`` says
    what changed). ``ep``: Megatron expert-parallel size (MoE configs; ``tp * pp * ep``
    processes, experts split over ``ep`` with expert-TP ``tp``). ``expert_layout``: the
    Megatron experts module the trainers build, ``"sequential"`` (``SequentialMLP``, one
    ``local_experts.{i}`` pair per expert) or ``"legacy_grouped"`` (``GroupedMLP``: every
    local expert in one ``weight1`` [hidden, experts*2*ffn] and ``weight2``
    [experts*ffn, hidden]); ``"te_grouped"`` needs Transformer Engine and is refused.

    ``quantization="fp8"``: the trainers quantize their shards to block FP8 where the
    blocks allow, the rest is quantized after the pull (:mod:`megarefit.quant`); the HF
    model gets the dequantized weights and its logits are compared with the fp32
    Megatron forward (relative error and cosine).

    Raises:
        MegarefitError: the config or layout is unsupported (``te_grouped`` experts included),
            or this install cannot build it (transformers without its ``model_type``, a hybrid
            config without triton); all before any process starts.
        RuntimeError: a trainer worker failed (its traceback is included).
    """
    from megarefit.demo.trainer_jobs import TrainerCase
    from megarefit.integrations.hf import hf_logits

    setup = prepare_demo(config, tp=tp, pp=pp, ep=ep, etp=etp, expert_layout=expert_layout, shrink=shrink,
                         status=status)
    dims, cfg = setup.dims, setup.cfg
    tokens = torch.randint(0, dims.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    stages: dict[str, float] = {}
    status(_trainer_line(dims, tp, pp, ep))
    shards, megatron_logits, read = _train(TrainerCase("demo", cfg, tp, pp, tokens, seed, ep, setup.etp, expert_layout),
                                           stages)
    status("plan: building and validating the slice plan")
    plain_plan, plan, fmt = _plan(setup, shards, read, quantization, stages)
    pulled = shards
    if fmt is not None:
        status("trainers: quantizing their shards to block FP8 where the blocks allow")
        t0 = time.perf_counter()
        pulled = quantize_sources(plan, shards, fmt)
        stages["trainer-side FP8 quantization"] = time.perf_counter() - t0
    stats = RefitStats()
    model, report = _refit(setup.hf_cfg, plan, pulled, fmt, stats, status, stages)
    status("check: HF forward vs Megatron forward")
    t0 = time.perf_counter()
    got = hf_logits(model, tokens)
    stages["HF forward"] = time.perf_counter() - t0
    want = megatron_logits[..., :dims.vocab_size]
    diff, cosine = (got - want).abs().max().item(), torch.cosine_similarity(got.flatten(), want.flatten(), 0).item()
    reference = None
    if fmt is not None:
        status("check: against the same weights quantized whole")
        ref = _whole_tensor_fp8_logits(setup.hf_cfg, plain_plan, shards, fmt, where_quantized(plan), tokens)
        reference = (got - ref).abs().max().item()
    where = where_quantized(plan) if fmt is not None else {}
    return DemoResult(cfg, dims, plan, stats, diff, want.abs().max().item(), len(report.loaded), stages, fmt, where,
                      cosine, plain_plan.nbytes, setup.notes, reference)


def _trainer_line(dims: ModelDims, tp: int, pp: int, ep: int) -> str:
    """The progress line before the trainers spawn (the longest stage: seconds per process)."""
    model_class = "MambaModel" if dims.layer_pattern else "GPTModel"
    return (f"trainer: spawning {tp * pp * ep} gloo process(es) (tp={tp}, pp={pp}, ep={ep}) that build a Megatron-Core "
            f"{model_class} and run its forward")


@dataclass(frozen=True)
class DemoSetup:
    """What :func:`prepare_demo` checked: the trainers' config, the HF model's config (the same,
    or with the ``model_type`` transformers builds the architecture as), dims, expert TP and notes."""

    cfg: dict[str, Any]
    hf_cfg: dict[str, Any]
    dims: ModelDims
    tp: int
    pp: int
    ep: int
    etp: int
    notes: list[str]


def prepare_demo(config: Any = None, *, tp: int = 2, pp: int = 1, ep: int = 1, etp: int | None = None,
                 expert_layout: str = "sequential", shrink: bool = True,
                 status: Callable[[str], None] = lambda _: None) -> DemoSetup:
    """Load (and shrink) ``config`` and check everything the demo needs before any process starts
    (``status``: unused here, kept for callers; the check is quick, and a refusal stays one line).

    Raises:
        MegarefitError: the config, layout or expert layout is unsupported, the model would not
            fit in RAM, transformers cannot build the architecture, or a package the trainers
            import is missing (each in one line naming the fix).
    """
    from megarefit.demo.shrink import shrink_config
    from megarefit.demo.trainer_jobs import check_buildable, is_hybrid

    cfg = dict(load_hf_config(config)) if config is not None else default_config()
    check_demo_family(cfg)
    notes: list[str] = []
    if shrink:
        cfg, notes = shrink_config(cfg)
    dims = ModelDims.from_hf_config(cfg)
    etp = etp or dims.default_etp(tp)
    dims.check_layout(tp, pp, ep, etp)
    if ep > 1 and (not dims.num_experts or dims.num_experts % ep):
        raise MegarefitError(f"--ep {ep} needs an MoE config whose experts ({dims.num_experts}) divide by it")
    check_buildable(cfg, tp)  # fail early on what the CPU harness cannot build
    check_expert_layout(expert_layout, dims)
    check_memory(dims, tp, pp)
    if is_hybrid(cfg):
        check_triton()
    hf_cfg = hf_buildable_config(cfg, notes)
    return DemoSetup(cfg, hf_cfg, dims, tp, pp, ep, etp, notes)


def check_demo_family(cfg: dict[str, Any]) -> None:
    """Raise :class:`UnsupportedModelError` for a family no Megatron-Core release builds (DeepSeek-V4: only
    Megatron-LM's dev branch has its modules), so the demo's trainers cannot run it on CPU."""
    if family_for_config(cfg).hyper_connections:
        raise UnsupportedModelError(
            "megarefit demo cannot train DeepSeek-V4 on CPU: no Megatron-Core release (0.16-0.19) builds it, only "
            "Megatron-LM's dev branch; its tables are checked against vLLM's own loader and Megatron-Bridge 0.6.2's "
            "names instead (megarefit plan --config ... --quantization none plans it)")


def check_triton() -> None:
    """Raise :class:`MegarefitError` when ``triton`` or ``einops`` does not import: Megatron-Core's
    ``mamba_mixer`` (the hybrid configs' ``MambaModel``) needs both, though the CPU harness runs
    none of triton's kernels (the SSD scan runs in torch)."""
    for name in ("triton", "einops"):
        try:
            __import__(name)
        except ImportError as exc:
            raise MegarefitError(f"the hybrid Mamba demo needs {name} ({exc}): Megatron-Core's Mamba layers import "
                                 f"it; pip install {name} (or pip install 'megarefit[demo]')") from None


def hf_buildable_config(cfg: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """``cfg`` as transformers builds it: unchanged when transformers knows its ``model_type``;
    else with the ``model_type`` of its architecture (``architectures[0]``, e.g. Kimi-K2's
    ``kimi_k2`` ships DeepSeek-V3's code and is built as ``deepseek_v3``), said in ``notes``.

    Raises:
        DependencyError: transformers' model classes do not import in this install.
        MegarefitError: transformers has neither the ``model_type`` nor the architecture.
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from megarefit.integrations.hf import auto_model_class

    auto_model_class()  # a broken install is one line here, not a traceback after the trainers ran
    model_type = cfg.get("model_type")
    if model_type in CONFIG_MAPPING_NAMES:
        return cfg
    arch = (cfg.get("architectures") or [None])[0]
    same = [t for t, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if name == arch and t in CONFIG_MAPPING_NAMES]
    if len(same) > 1:  # several types share the class (deepseek_v3, sarvam_mla): the one whose config it names
        same = [t for t in same if arch and CONFIG_MAPPING_NAMES[t] == arch.replace("ForCausalLM", "Config")]
    if len(same) != 1:
        raise MegarefitError(f"transformers {transformers.__version__} has no model_type {model_type!r} and no "
                             f"single model type for its architecture {arch!r}: the demo cannot build the HF model "
                             "(`megarefit plan` plans this config from shapes alone)")
    notes.append(f"HF model built as model_type {same[0]} ({arch}): transformers {transformers.__version__} has no "
                 f"{model_type}, whose checkpoints ship that architecture's code")
    return cfg | {"model_type": same[0]}


def _train(case: Any, stages: dict[str, float]) -> tuple[dict, torch.Tensor, SourceLayout]:
    """Run the trainer processes: (shards by rank coordinate, Megatron logits, the layout every
    rank read from Megatron as ``Publisher.from_megatron`` does); the seconds go to ``stages``.

    Raises:
        RuntimeError: a worker failed, the trainers' parameters disagree with the spec table, or
            the ranks read different layouts or coordinates other than their own."""
    from megarefit.demo.trainer_jobs import trainer_job
    from megarefit.demo.workers import run_workers

    t0 = time.perf_counter()
    world = case.tp * case.pp * case.ep
    per_rank = [r["demo"] for r in run_workers(trainer_job, world_size=world, args=([case],)) if r["demo"]]
    stages["trainer (spawn, build, forward)"] = time.perf_counter() - t0
    problems = [p for r in per_rank for p in r["problems"]]
    if problems:
        raise RuntimeError("classifier disagrees with the spec table:\n" + "\n".join(problems))
    shards = {tuple(r["coord"]): r["params"] for r in per_rank}
    logits = next(r["logits"] for r in per_rank if r["logits"] is not None)
    read = {SourceLayout.from_dict(r["read"]["layout"]) for r in per_rank}
    if len(read) != 1 or any(tuple(r["read"]["rank"])[:3] != tuple(r["coord"]) for r in per_rank):  # (any copy)
        raise RuntimeError(f"the trainer ranks read {len(read)} layouts from Megatron, at ranks "
                           f"{[r['read']['rank'] for r in per_rank]} (their coordinates: {list(shards)})")
    return shards, logits, read.pop()


def _plan(setup: DemoSetup, shards: dict, read: SourceLayout, quantization: str,
          stages: dict[str, float]) -> tuple[Plan, Plan, Any]:
    """(the plain fp32 plan, the plan refit: FP8 or the same, the FP8 format or ``None``),
    checked against the trainers' shards. The layout is the one the trainers ``read`` from
    Megatron (``Publisher.from_megatron``), which must equal the one stated by hand (the demo's
    sizes, the spelling and expert layout found from the shards' names).

    Raises:
        LayoutError: the read and the stated layout differ (naming each field)."""
    from megarefit.translate import check_shapes

    t0 = time.perf_counter()
    plan_megatron_to_hf.cache_clear()
    dims = setup.dims
    base = SourceLayout.build(tp=setup.tp, pp=setup.pp, ep=setup.ep, etp=setup.etp,
                              padded_vocab_size=dims.padded_vocab_size(setup.tp), num_layers=dims.num_layers,
                              megatron=read.megatron)
    layout = resolve_layer_spec(dims, base, {r: list(p) for r, p in shards.items()})
    check_stated(read, layout)
    plain = plan_megatron_to_hf(dims, layout, "float32")
    check_shapes(plain, shards)
    fmt = resolve_quantization(quantization, setup.cfg)
    plan = plan_fp8(plain, fmt) if fmt is not None else plain
    stages["plan + validate"] = time.perf_counter() - t0
    return plain, plan, fmt


def _refit(hf_cfg: dict[str, Any], plan: Plan, shards: dict, fmt: Any, stats: RefitStats,
           status: Callable[[str], None], stages: dict[str, float]) -> tuple[torch.nn.Module, Any]:
    """One refit cycle into a fresh HF model (through a checkpoint where transformers fuses the
    per-expert tensors itself): (the model, the install report)."""
    from megarefit.integrations.hf import build_hf_model, install_weights, load_through_checkpoint, needs_conversion

    model = build_hf_model(hf_cfg)
    names = [r.name for r in plan.targets if r not in plan.staging and not r.name.endswith("_scale_inv")]
    convert = needs_conversion(model, names)
    status("refit: streaming weights into an HF transformers model" + (
        " (through a checkpoint: transformers fuses the per-expert tensors itself)" if convert else ""))
    t0 = time.perf_counter()
    weights = run_refit_cycle(plan, LocalTransport(shards), stats=stats)
    if fmt is not None:  # the HF model computes in fp32: dequantize each FP8 weight with its block scales
        weights = iter(dequantize_state(dict(weights), fmt, torch.float32).items())
    if convert:
        model, report = load_through_checkpoint(hf_cfg, weights)
    else:
        report = install_weights(model, weights)
    stages["refit cycle (pull + install)"] = time.perf_counter() - t0
    return model, report


def _whole_tensor_fp8_logits(cfg: dict[str, Any], plan: Plan, shards: dict, fmt: Any, where: dict[str, str],
                             tokens: torch.Tensor) -> torch.Tensor:
    """HF logits of the unquantized refit with every weight in ``where`` quantized whole
    (``quantize_fp8`` on the full HF tensor) and dequantized: the reference of an FP8 refit."""
    from megarefit.integrations.hf import build_hf_model, hf_logits, install_weights, load_through_checkpoint
    from megarefit.quant.fp8 import quantize_fp8

    state = {name: t.clone() for name, t in run_refit_cycle(plan, LocalTransport(shards))}
    for name in where:
        q, scale_inv = quantize_fp8(state[name], fmt)
        state[name] = dequantize_state({name: q, name + "_scale_inv": scale_inv}, fmt, torch.float32)[name]
    model = build_hf_model(cfg)
    if set(state) <= {n for n, _ in model.named_parameters()}:
        install_weights(model, state.items())
    else:
        model, _ = load_through_checkpoint(cfg, state.items())
    return hf_logits(model, tokens)
