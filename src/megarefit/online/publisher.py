"""Publisher (trainer side): serve a rank's live shards over NIXL, no gather, no copy.

Each Megatron rank wraps its parameters once::

    pub = Publisher(dict(model.named_parameters()), hf_config, rank=(tp_rank, pp_rank, 0),
                    tp=tp, pp=pp, rendezvous=Rendezvous.connect(host, port, secret=job_secret))
    ...
    optimizer.step()
    pub.publish(version=step)          # after every optimizer step; registers nothing new

or, so that no receiver ever accepts bytes read while the step rewrites them::

    with pub.updating(version=step + 1):   # marks the rank writing first (a seqlock)
        optimizer.step()

The parameter tensors themselves are registered with a NIXL agent (their memory
must stay put: Megatron updates parameters in place) and described in a
:class:`~megarefit.transport.manifest.Manifest`. Receivers read the bytes one-sided while
the trainer does not touch the weights; bump the version only after the
optimizer step has finished.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from megarefit.errors import LayoutError, MissingParameterError, ShapeMismatchError, UnexpectedParameterError
from megarefit.layout import ExpertLayout, RankCoord, SourceLayout, virtual_stage
from megarefit.layout.dims import DEFAULT_VOCAB_DIVISOR, ModelDims, load_hf_config
from megarefit.layout.geometry import SourceTensor, global_shape, source_tensors
from megarefit.online.param_sync import check_param_sync
from megarefit.online.rendezvous import Rendezvous
from megarefit.planner import plan_megatron_to_hf
from megarefit.quant.fp8 import FP8_DTYPE, Fp8Format, resolve_quantization
from megarefit.quant.kernel import Fp8Quantizer
from megarefit.quant.planning import SCALE_SUFFIX, fp8_sources, plan_fp8
from megarefit.specs.megatron_core import MegatronCore
from megarefit.specs.table import LayerSpec, canonical_name
from megarefit.transport.checksum import frame_entries, sum_frame, tensor_checksum
from megarefit.transport.checksum_kernel import BoxSums
from megarefit.transport.cuda_ipc import export_storages
from megarefit.transport.manifest import Manifest, TensorEntry
from megarefit.transport.nixl_agent import NixlAgent, mem_type


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _entry(name: str, role: str, t: torch.Tensor, gshape: tuple[int, ...]) -> TensorEntry:
    return TensorEntry(name, role, _dtype_name(t.dtype), tuple(t.shape), gshape, t.data_ptr(),
                       t.numel() * t.element_size(), *mem_type(t))


def _most_common_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    """The dtype most of ``tensors`` have (the first seen among equals)."""
    counts: dict[torch.dtype, int] = {}
    for p in tensors:
        counts[p.dtype] = counts.get(p.dtype, 0) + 1
    return max(counts, key=counts.__getitem__)


class Publisher:
    """Serves one trainer rank's parameters; see the module docstring.

    With Megatron's interleaved pipeline (``vpp > 1``), publish each model chunk with its
    own Publisher: ``rank=(tp_rank, pp_rank, ep_rank)``, ``vp_stage=c``; it serves stage
    ``virtual_stage(pp_rank, c, pp)`` of a ``pp * vpp``-stage pipeline.

    ``snapshot=True`` (asynchronous RL): receivers read a registered copy of the rank's
    shards that every ``publish`` refreshes from the live parameters at device-copy speed
    (inside the seqlock), so training may go on writing its parameters during a pull. It
    costs one extra copy of the rank's unquantized shards (FP8 shards are already served
    from their own buffers). Allocate trainer memory that NIXL reads over a network
    (RDMA) outside PyTorch's ``expandable_segments`` (registration of VMM-mapped memory
    succeeds, but the NIC faults at transfer time): a Publisher serving CUDA tensors
    while ``PYTORCH_CUDA_ALLOC_CONF`` enables expandable segments warns.

    ``ddp``: the rank's Megatron-Core ``DistributedDataParallel`` model chunk(s). With the
    distributed optimizer and ``overlap_param_gather``, parameters are whole again only
    after the next forward's all-gather; ``publish`` / ``updating`` then wait for gathers
    in flight and refuse (``ParamSyncPendingError``) if one was not dispatched: call
    :func:`megarefit.online.param_sync.finish_param_sync` on every data-parallel rank after the step.

    ``megatron``: the trainer's Megatron-Core and the config flags that decide layouts, recorded in
    the manifest (``MegatronCore.from_config(megatron.core.__version__, model.config)``, or
    :func:`megarefit.integrations.megatron.megatron_core_of`). Default: the ``megatron.core`` this
    process imported, flags unread (enough where no flag of that release matters for the model);
    without one, megarefit's reference layout (megatron-core 0.16.1's names).

    ``ipc`` (default on): CUDA storages served are also exported for CUDA IPC (PyTorch's
    reduction; :mod:`~megarefit.transport.cuda_ipc`), so a receiver on the same GPU (colocated
    RL) reads them by device copies instead of NIXL through the host. If PyTorch cannot
    export them, a warning says so and receivers use NIXL.

    Raises (at construction):
        MissingParameterError / UnexpectedParameterError: the parameters are not
            exactly what the spec table and layout place on this rank.
        ShapeMismatchError: a parameter's shape differs from the layout's, or is
            not contiguous.
        UnverifiedMegatronError: the trainer's Megatron-Core version, or a config flag that
            matters for this model, is not one megarefit has verified.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], hf_config: Any, *, rank: tuple[int, int, int],
                 tp: int, pp: int, ep: int = 1, rendezvous: Rendezvous, layer_spec: LayerSpec = "local",
                 make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISOR,
                 first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                 etp: int | None = None, expert_layout: ExpertLayout = "sequential", mtp_layers: int = 0,
                 vpp: int = 1, vp_stage: int = 0, agent_name: str | None = None,
                 quantization: str | Fp8Format | None = "auto", snapshot: bool = False,
                 ddp: Any = None, checksums: bool = False, ipc: bool = True, megatron: MegatronCore | None = None):
        if vpp > 1:  # interleaved pipeline: this chunk is one stage of a pp*vpp-stage pipeline
            rank = (rank[0], virtual_stage(rank[1], vp_stage, pp), rank[2])
            pp *= vpp
        self.rank = RankCoord(*rank)
        cfg = load_hf_config(hf_config)
        self.dims = ModelDims.from_hf_config(cfg)
        self.quantization = resolve_quantization(quantization, cfg)
        self.layout = self._build_layout(tp, pp, ep, etp, vocab_divisor=make_vocab_size_divisible_by,
                                         first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
                                         layer_spec=layer_spec, expert_layout=expert_layout, mtp_layers=mtp_layers,
                                         megatron=megatron or MegatronCore.in_process())
        self.params = {c: p for n, p in params.items() if (c := canonical_name(n)) is not None}
        expected = self._check_params()
        self.dtype = _dtype_name(_most_common_dtype(self.params.values()))
        # FP8: the shards whose blocks lie inside this rank are served quantized, from buffers
        # allocated and registered once and re-filled by every publish() (quant/planning.py)
        self.fp8: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.quantization is not None:
            plan = plan_fp8(plan_megatron_to_hf(self.dims, self.layout, self.dtype), self.quantization)
            self.fp8 = self._fp8_buffers([ref.name for ref in fp8_sources(plan, self.rank)])
        # snapshot: receivers read a registered copy that publish() refreshes, never the live
        # parameters (training goes on during the pull: one-step off-policy RL)
        self.snapshot: dict[str, torch.Tensor] = {}
        if snapshot:
            self.snapshot = self._snapshot_buffers([n for n in expected if n not in self.fp8])
        entries, served = self._served_entries(expected)
        self._warn_expandable_segments(served)
        name = agent_name or f"megarefit-trainer-{self.rank.tp}-{self.rank.pp}-{self.rank.ep}"
        self.agent = NixlAgent(name)
        self.agent.register(served)
        self.checksums = self._checksum_buffer(served, entries) if checksums else None
        self.ipc = self._export_ipc(served) if ipc else ()
        self.manifest = self._build_manifest(name, entries)
        self.last_quantize_s = 0.0
        self.last_checksum_s = 0.0  # seconds the last publish spent computing checksums
        self._quantize = (Fp8Quantizer([(self.params[n].detach(), w, sc) for n, (w, sc) in self.fp8.items()],
                                       self.quantization) if self.fp8 else None)
        self.rendezvous = rendezvous
        self.writing = False  # inside updating(), or an update that raised (receivers wait)
        self.ddp = [] if ddp is None else (list(ddp) if isinstance(ddp, (list, tuple)) else [ddp])
        rendezvous.publish_manifest(self.manifest, self.agent.metadata)

    def _build_layout(self, tp: int, pp: int, ep: int, etp: int | None, *, vocab_divisor: int,
                      first_stage_layers: int | None, last_stage_layers: int | None, layer_spec: LayerSpec,
                      expert_layout: ExpertLayout, mtp_layers: int, megatron: MegatronCore) -> SourceLayout:
        """The trainer's source layout (``pp`` counts virtual stages), checked against the model's
        dims; ``self.rank`` must be one of its coordinates.

        Raises:
            LayoutError: the layout does not fit the model, or ``self.rank`` is not in its grid.
        """
        self.dims.check_layout(tp, pp, ep, etp)
        layout = SourceLayout.build(
            tp=tp, pp=pp, ep=ep, padded_vocab_size=self.dims.padded_vocab_size(tp, vocab_divisor),
            num_layers=self.dims.num_layers, first_stage_layers=first_stage_layers,
            last_stage_layers=last_stage_layers, layer_spec=layer_spec, etp=etp, expert_layout=expert_layout,
            mtp_layers=mtp_layers, megatron=megatron)
        if self.rank not in set(layout.ranks()):
            raise LayoutError(f"rank {self.rank} is not a coordinate of Megatron's process grid for tp={tp} "
                              f"ep={ep} etp={layout.etp} (with etp=1 < tp, tp and ep ranks are tied; "
                              f"publish from the ranks {[tuple(r) for r in layout.ranks()]} only)")
        return layout

    def _check_params(self) -> dict[str, SourceTensor]:
        """The shards the layout places on this rank (canonical name -> source tensor), checked
        against ``self.params``: the same names, the same (local) shapes, contiguous.

        Raises:
            MissingParameterError / UnexpectedParameterError / ShapeMismatchError: as the class says.
        """
        expected = source_tensors(self.dims, self.layout)[self.rank]
        missing, extra = sorted(expected.keys() - self.params.keys()), sorted(self.params.keys() - expected.keys())
        if missing:
            raise MissingParameterError(f"rank {self.rank} lacks {len(missing)} parameter(s) the layout places "
                                        f"there, e.g. {missing[:3]}")
        if extra:
            raise UnexpectedParameterError(f"rank {self.rank} has {len(extra)} parameter(s) the layout does not "
                                           f"place there, e.g. {extra[:3]}")
        for name, t in expected.items():
            p = self.params[name]
            if tuple(p.shape) != t.shape or not p.is_contiguous():
                raise ShapeMismatchError(f"parameter {name} on rank {self.rank}: expected contiguous {t.shape}, "
                                         f"got {tuple(p.shape)} contiguous={p.is_contiguous()}")
        return expected

    def _served_entries(self, expected: Mapping[str, SourceTensor]) -> tuple[list[TensorEntry], list[torch.Tensor]]:
        """Manifest entries (global shapes, addresses; region not yet known) of the tensors this
        rank serves, in layout order, and those tensors: an FP8 shard's weight and float32 scales,
        else the snapshot copy, else the live parameter."""
        entries, served = [], []
        for name, t in expected.items():
            gshape = global_shape(t.spec, self.dims, self.layout)
            if name in self.fp8:
                weight, scale = self.fp8[name]
                entries.append(_entry(name, t.spec.role.value, weight, gshape))
                entries.append(_entry(name + SCALE_SUFFIX, "fp8_scale", scale, self.quantization.scale_shape(gshape)))
                served += [weight, scale]
            else:
                tensor = self.snapshot.get(name, self.params[name])
                entries.append(_entry(name, t.spec.role.value, tensor, gshape))
                served.append(tensor)
        return entries, served

    def _warn_expandable_segments(self, served: list[torch.Tensor]) -> None:
        """Warn (at the caller of ``Publisher(...)``) when CUDA tensors are served while PyTorch's
        allocator uses expandable segments (VMM memory: RDMA NICs fault on it at transfer time)."""
        if any(t.is_cuda for t in served) and "expandable_segments:true" in (
                os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")).lower():
            warnings.warn(f"rank {self.rank}: serving CUDA memory allocated with expandable_segments; NIXL "
                          "registration of VMM-mapped memory succeeds but RDMA NICs fault at transfer time. "
                          "Unset expandable_segments for the trainer, or serve through CUDA IPC only.", stacklevel=3)

    def _export_ipc(self, served: list[torch.Tensor]) -> tuple:
        """CUDA IPC records of the served storages and the checksum block (none for host memory);
        a warning and none where PyTorch cannot export them."""
        tensors = served + ([self.checksums[0]] if self.checksums is not None else [])
        try:
            return export_storages(tensors)
        except RuntimeError as exc:
            warnings.warn(f"rank {self.rank}: cannot export CUDA IPC handles ({exc}); receivers on this GPU "
                          "read over NIXL", stacklevel=3)
            return ()

    def _build_manifest(self, agent_name: str, entries: list[TensorEntry]) -> Manifest:
        """The rank's manifest: ``entries`` with the agent's registered region of each (-1 if none)."""
        entries = [dataclasses.replace(e, region=-1 if (r := self.agent.region(e.addr, e.nbytes)) is None else r)
                   for e in entries]
        quant = None if self.quantization is None else (self.quantization.block, self.quantization.ue8m0)
        sums = None if self.checksums is None else (self.checksums[0].data_ptr(), self.checksums[0].numel() * 8,
                                                     *mem_type(self.checksums[0]))
        return Manifest(self.rank, self.dims, self.layout, agent_name, tuple(entries), dtype=self.dtype,
                        quantization=quant, checksums=sums, ipc=self.ipc)

    def _checksum_buffer(self, served: list[torch.Tensor], entries: list[TensorEntry]
                         ) -> tuple[torch.Tensor, Callable[[], None]]:
        """One registered int64 buffer holding every served tensor's checksum back to back (in
        manifest order, on the device of the first; legacy GroupedMLP tensors summed per local
        expert, :func:`~megarefit.transport.checksum.sum_frame`), and what fills it: one fused
        pass over every served tensor (:class:`~megarefit.transport.checksum_kernel.BoxSums`;
        per tensor where the tensors span devices)."""
        experts = self.dims.num_experts // self.layout.ep if self.dims.num_experts else 1
        frames = [sum_frame(t.shape, e.role, experts) for t, e in zip(served, entries, strict=True)]
        flat = torch.zeros(sum(f.numel for f in frames), dtype=torch.int64, device=served[0].device)
        self.agent.register([flat])
        boxes, starts, at = [], [], 0
        for t, f in zip(served, frames):
            boxes += frame_entries(t, f, at)
            starts.append(at)
            at += f.numel
        if all(t.device == flat.device for t in served):
            return flat, BoxSums(boxes, flat)

        def per_tensor() -> None:
            for t, f, start in zip(served, frames, starts):
                flat[start:start + f.numel].copy_(tensor_checksum(t, frame=f))

        return flat, per_tensor

    def _fp8_buffers(self, names: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """FP8 weights and float32 scales of ``names`` as views of one arena each (per device),
        back to back in layout order: registered once, and consecutive pulls of a receiver
        coalesce into few large descriptors."""
        assert self.quantization is not None
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for device in {self.params[n].device for n in names}:
            mine = [n for n in names if self.params[n].device == device]
            shapes = {n: (tuple(self.params[n].shape), self.quantization.scale_shape(tuple(self.params[n].shape)))
                      for n in mine}
            weights = torch.empty(sum(math.prod(w) for w, _ in shapes.values()), dtype=FP8_DTYPE, device=device)
            scales = torch.empty(sum(math.prod(s) for _, s in shapes.values()), dtype=torch.float32, device=device)
            at_w = at_s = 0
            for n in mine:
                w, s = shapes[n]
                out[n] = (weights[at_w:at_w + math.prod(w)].view(w), scales[at_s:at_s + math.prod(s)].view(s))
                at_w, at_s = at_w + math.prod(w), at_s + math.prod(s)
        return {n: out[n] for n in names}

    def _snapshot_buffers(self, names: list[str]) -> dict[str, torch.Tensor]:
        """One contiguous buffer per (device, dtype) holding a copy of each of ``names``,
        filled now; registered once like the FP8 arenas."""
        out: dict[str, torch.Tensor] = {}
        groups: dict[tuple[torch.device, torch.dtype], list[str]] = {}
        for n in names:
            groups.setdefault((self.params[n].device, self.params[n].dtype), []).append(n)
        for (device, dtype), group in groups.items():
            flat = torch.empty(sum(self.params[n].numel() for n in group), dtype=dtype, device=device)
            at = 0
            for n in group:
                out[n] = flat[at:at + self.params[n].numel()].view(self.params[n].shape)
                out[n].copy_(self.params[n].detach())
                at += self.params[n].numel()
        return out

    @property
    def counters(self):
        return self.agent.counters

    def publish(self, version: int) -> None:
        """Announce that the weights now hold ``version`` (call after the optimizer step).

        Receivers cannot tell a pull that overlapped the step from one that did not: use
        :meth:`updating` unless the training loop itself guarantees no refit runs during
        the step. After an update that raised, ``publish`` ends it (the rank is stable again).

        Raises:
            ShapeMismatchError: a parameter moved in memory since registration
                (e.g. re-allocated by a resharding step); create a new Publisher.
        """
        self._check_moved()
        if (self.snapshot or self._quantize is not None or self.checksums is not None) and not self.writing:
            self.rendezvous.begin_update(self.rank)  # the served buffers are rewritten below: a seqlock
            self.writing = True
        self._settle()
        if self.writing:
            self.rendezvous.end_update(self.rank, version)
            self.writing = False
        else:
            self.rendezvous.publish_version(self.rank, version)

    @contextlib.contextmanager
    def updating(self, version: int) -> Iterator[None]:
        """``with pub.updating(v + 1): optimizer.step()`` -- a seqlock around the step.

        Before the block the rank is marked writing (its update sequence turns odd), so a
        receiver whose pull overlaps the block sees the sequence change and rejects the
        pull (then retries); after the block the device is synchronized, FP8 buffers are
        re-quantized, ``version`` is published and the rank is marked stable. If the block
        raises, the rank stays marked writing: no receiver accepts its bytes until a later
        ``updating`` or ``publish`` completes.

        Raises:
            ShapeMismatchError: as :meth:`publish`.
        """
        if not self.writing:  # after a failed update the sequence is still odd
            self.rendezvous.begin_update(self.rank)
            self.writing = True
        yield
        self._check_moved()
        self._settle()
        self.rendezvous.end_update(self.rank, version)
        self.writing = False

    def wait_receivers(self, version: int, *, timeout: float = 300.0, lease: float = 10.0) -> dict[str, str]:
        """Block until every live registered receiver acknowledged ``version`` (receivers
        whose heartbeat stopped for ``lease`` seconds are dropped); then the trainer may
        write again. Returns ``{receiver id: "acked" | "dropped"}``.

        Raises:
            RendezvousTimeout: naming each live receiver that did not acknowledge in time.
        """
        return self.rendezvous.wait_receivers(version, timeout=timeout, lease=lease)

    def _check_moved(self) -> None:
        for entry in self.manifest.tensors:
            if entry.name in self.params and entry.name not in self.fp8 and entry.name not in self.snapshot and (
                    self.params[entry.name].data_ptr() != entry.addr):
                raise ShapeMismatchError(f"parameter {entry.name} on rank {self.rank} moved since registration; "
                                         "re-create the Publisher")

    def _settle(self) -> None:
        """Finish Megatron's deferred param sync, wait for the device, refresh the snapshot,
        re-quantize FP8 buffers."""
        check_param_sync(self.ddp, self.rank)
        devices = {p.device for p in self.params.values() if p.is_cuda}
        for device in devices:  # the step's kernels must have landed before the rank is declared stable
            torch.cuda.synchronize(device)
        if self.snapshot:  # live -> the registered copy receivers read (device-copy speed)
            names = list(self.snapshot)
            dst, src = [self.snapshot[n] for n in names], [self.params[n].detach() for n in names]
            if dst[0].is_cuda:
                torch._foreach_copy_(dst, src)
                torch.cuda.synchronize(dst[0].device)
            else:
                for d, x in zip(dst, src):
                    d.copy_(x)
        if self._quantize is not None:  # the new weights into the registered FP8 buffers (one launch on a GPU)
            t0 = time.perf_counter()
            self._quantize()
            weight = next(iter(self.fp8.values()))[0]
            if weight.is_cuda:
                torch.cuda.synchronize(weight.device)
            self.last_quantize_s = time.perf_counter() - t0
        if self.checksums is not None:  # what receivers check the pulled bytes against, inside the seqlock
            t0 = time.perf_counter()
            self.checksums[1]()
            if self.checksums[0].is_cuda:
                torch.cuda.synchronize(self.checksums[0].device)
            self.last_checksum_s = time.perf_counter() - t0
