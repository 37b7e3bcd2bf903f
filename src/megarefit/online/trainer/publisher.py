"""Publisher (trainer side): serve a rank's live shards over NIXL, no gather, no copy.

Each Megatron rank wraps its model once; Megatron itself says where the rank sits
(``parallel_state``, each chunk's ``TransformerConfig``; see
:mod:`megarefit.layout.megatron_model`)::

    pub = Publisher.from_megatron(model, hf_config, rendezvous=Rendezvous.connect(host, port, job=job))
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
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from megarefit.errors import (
    LayoutError,
    MegarefitError,
    MissingParameterError,
    ShapeMismatchError,
    UnexpectedParameterError,
    UnsupportedAdapterError,
)
from megarefit.layout import RankCoord, SourceLayout
from megarefit.layout.dims import ModelDims, load_hf_config
from megarefit.layout.geometry import SourceTensor, global_shape, source_tensors
from megarefit.layout.megatron_model import check_stated, read_chunks
from megarefit.online.delta.log import DeltaLog, DeltaOptions, DeltaStats
from megarefit.online.delta.track import ChangeTracker
from megarefit.online.store.rendezvous import Rendezvous
from megarefit.online.trainer.moved import MoveStats, reregister
from megarefit.online.trainer.param_sync import check_param_sync
from megarefit.online.trainer.served import (
    checksum_buffer,
    export_ipc,
    fp8_buffers,
    refresh_snapshot,
    snapshot_buffers,
    warn_expandable_segments,
)
from megarefit.planner import plan_megatron_to_hf
from megarefit.quant.fp8 import Fp8Format, resolve_quantization
from megarefit.quant.kernel import Fp8Quantizer
from megarefit.quant.planning import SCALE_SUFFIX, fp8_sources, plan_fp8
from megarefit.specs.lora import WRAPPED, is_adapter
from megarefit.specs.table import canonical_name
from megarefit.transport.manifest import LoraInfo, Manifest, TensorEntry
from megarefit.transport.nixl_agent import NixlAgent, mem_type


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_entry(name: str, role: str, t: torch.Tensor, gshape: tuple[int, ...]) -> TensorEntry:
    return TensorEntry(name, role, _dtype_name(t.dtype), tuple(t.shape), gshape, t.data_ptr(),
                       t.numel() * t.element_size(), *mem_type(t))


def _most_common_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    """The dtype most of ``tensors`` have (the first seen among equals)."""
    counts: dict[torch.dtype, int] = {}
    for p in tensors:
        counts[p.dtype] = counts.get(p.dtype, 0) + 1
    return max(counts, key=counts.__getitem__)


def _checked_layout(layout: SourceLayout, dims: ModelDims, rank: RankCoord) -> SourceLayout:
    """``layout`` checked against the model's dims; ``rank`` must be one of its coordinates.

    Raises:
        LayoutError: the layout does not fit the model, or ``rank`` is not in its grid.
    """
    if not isinstance(layout, SourceLayout):
        raise LayoutError(f"layout must be a SourceLayout (megarefit.layout.megatron_model.source_layout builds "
                          f"one), got {type(layout).__name__}")
    dims.check_layout(layout.tp, layout.pp, layout.ep, layout.etp)
    if layout.num_layers != dims.num_layers or layout.padded_vocab_size < dims.vocab_size:
        raise LayoutError(f"layout holds {layout.num_layers} layers and {layout.padded_vocab_size} vocab rows; "
                          f"the HF config has {dims.num_layers} layers and vocab_size={dims.vocab_size}")
    if rank not in set(layout.all_ranks()):
        raise LayoutError(f"rank {rank} is not a coordinate of Megatron's process grid for tp={layout.tp} "
                          f"pp={layout.pp} ep={layout.ep} etp={layout.etp} (with etp=1 < tp, tp and ep ranks "
                          f"are tied; publish from the ranks {[tuple(r) for r in layout.ranks()]} only; copies 0 .. "
                          f"{layout.copies - 1} of each at dp={layout.dp})")
    return layout


def _delta_sources(expected: Iterable[str], params: Mapping[str, torch.Tensor],
                   fp8: Mapping[str, Any]) -> list[torch.Tensor | None]:
    """Per served tensor, the live parameter it holds bit for bit (None for FP8 weights and scales)."""
    return [s for name in expected for s in ([None, None] if name in fp8 else [params[name]])]


class VersionOrderError(MegarefitError):
    """A Publisher was asked to publish a version older than the last one it published."""


class Publisher:
    """Serves one trainer rank's parameters (one model chunk); see the module docstring.

    Build it with :meth:`from_megatron`, which reads the layout from Megatron. The constructor is the explicit form:
    ``params`` (Megatron's local names, e.g. :func:`refit_tensors` of the model), the rank's coordinate ``rank = (tp
    rank, stage, ep rank)`` and the whole trainer's ``layout`` (a :class:`~megarefit.layout.SourceLayout`, e.g. from
    :func:`~megarefit.layout.megatron_model.source_layout`). With Megatron's interleaved pipeline (``vpp > 1``)
    ``layout.pp`` counts ``pp * vpp`` virtual stages and chunk ``c`` of pipeline rank ``p`` is stage
    ``virtual_stage(p, c, pp)``, one Publisher per chunk (:class:`PublisherGroup`).

    ``snapshot=True`` (asynchronous RL): receivers read a registered copy of the rank's shards that every
    ``publish`` refreshes from the live parameters at device-copy speed (inside the seqlock), so training may go on
    writing its parameters during a pull. It costs one extra copy of the rank's unquantized shards (FP8 shards are
    already served from their own buffers). Allocate trainer memory that NIXL reads over a network (RDMA) outside
    PyTorch's ``expandable_segments`` (registration of VMM-mapped memory succeeds, but the NIC faults at transfer
    time): a Publisher serving CUDA tensors while ``PYTORCH_CUDA_ALLOC_CONF`` enables expandable segments warns.

    ``ddp``: the rank's Megatron-Core ``DistributedDataParallel`` model chunk(s) (found by :meth:`from_megatron` in
    the wrappers). With the distributed optimizer and ``overlap_param_gather``, parameters are whole again only
    after the next forward's all-gather; ``publish`` / ``updating`` then wait for gathers in flight and refuse
    (``ParamSyncPendingError``) if one was not dispatched: call
    :func:`megarefit.online.trainer.param_sync.finish_param_sync` on every data-parallel rank after the step.

    ``ipc`` (default on): CUDA storages served are also exported for CUDA IPC (PyTorch's reduction;
    :mod:`~megarefit.transport.cuda_ipc`), so a receiver on the same GPU (colocated RL) reads them by device copies
    instead of NIXL through the host. If PyTorch cannot export them, a warning says so and receivers use NIXL.

    ``delta`` (``True`` or :class:`~megarefit.online.delta.log.DeltaOptions`): every publish also packs the elements
    that changed since the previous published version into registered host slots and publishes them
    (:mod:`~megarefit.online.delta.log`), so receivers holding that version pull only those (a delta refit). Costs a
    host copy of the served tensors and ``keep`` slots; ``last_delta`` reports each publish's changed fraction and
    seconds. ``tracker`` (a :class:`~megarefit.online.delta.track.ChangeTracker`, from
    :func:`~megarefit.online.delta.track.track_changes` of the Megatron optimizer on every data-parallel rank): the
    changes of every parameter it tracks come from the optimizer's main-to-model copy instead, so only untracked
    tensors (FP8 buffers, parameters the optimizer does not copy) keep a mirror.



    Raises (at construction):
        LayoutError: ``layout`` does not fit the model, or ``rank`` is not in its grid.
        MissingParameterError / UnexpectedParameterError: the parameters are not exactly what the spec table and
            layout place on this rank.
        ShapeMismatchError: a parameter's shape differs from the layout's, or is not contiguous.
        UnverifiedMegatronError: the trainer's Megatron-Core version (``layout.megatron``), or a
            config flag that matters for this model, is not one megarefit has verified.
    """

    lora: LoraInfo | None = None  # what the manifest says of a LoRA adapter (None: the model's weights)
    # what each served tensor is (checked against the layout), its entries and tensors (LoraPublisher: adapters)
    def _expected(self) -> dict[str, Any]:
        return _checked_params(self)

    def _served(self, expected: Mapping[str, Any]) -> tuple[list[TensorEntry], list[torch.Tensor]]:
        return _served_entries(self, expected)

    def __init__(self, params: Mapping[str, torch.Tensor], hf_config: Any, *, rank: tuple[int, int, int],
                 layout: SourceLayout, rendezvous: Rendezvous, agent_name: str | None = None,
                 quantization: str | Fp8Format | None = "auto", snapshot: bool = False,
                 ddp: Any = None, checksums: bool = False, ipc: bool = True,
                 delta: bool | DeltaOptions = False, tracker: ChangeTracker | None = None):
        self.rank = RankCoord(*rank)
        cfg = load_hf_config(hf_config)
        self.dims = ModelDims.from_hf_config(cfg)
        self.quantization = resolve_quantization(quantization, cfg)
        self.layout = _checked_layout(layout, self.dims, self.rank)
        self.params = {c: p for n, p in params.items() if (c := canonical_name(n)) is not None}
        expected = self._expected()
        self.dtype = _dtype_name(_most_common_dtype(self.params.values()))
        # FP8: the shards whose blocks lie inside this rank served quantized, from buffers re-filled by every publish()
        self.fp8: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.quantization is not None:
            plan = plan_fp8(plan_megatron_to_hf(self.dims, self.layout, self.dtype), self.quantization)
            self.fp8 = fp8_buffers(self.params, [ref.name for ref in fp8_sources(plan, self.rank.first)], self.quantization)
        # snapshot: receivers read a copy publish() refreshes, not the live parameters (training goes on during a pull)
        self.snapshot: dict[str, torch.Tensor] = {}
        if snapshot:
            self.snapshot = snapshot_buffers(self.params, [n for n in expected if n not in self.fp8])
        entries, served = self._served(expected)
        warn_expandable_segments(served, f"rank {self.rank}")
        name = agent_name or (f"megarefit-trainer-{self.rank.tp}-{self.rank.pp}-{self.rank.ep}"
                               + (f"-{self.rank.copy}" if self.rank.copy else ""))
        self.agent = NixlAgent(name, device=served[0].device if served else None)  # the shards' GPU's NIC
        self.agent.register(served)
        self.checksums = _checksum_buffer(self, served, entries) if checksums else None
        self.ipc_enabled = ipc
        self.ipc = export_ipc(served + ([self.checksums[0]] if self.checksums is not None else []),
                              f"rank {self.rank}") if ipc else ()
        self.manifest = self._build_manifest(name, entries)
        self.last_quantize_s = 0.0
        self.last_checksum_s = 0.0  # seconds the last publish spent computing checksums
        self._quantize = (Fp8Quantizer([(self.params[n].detach(), w, sc) for n, (w, sc) in self.fp8.items()],
                                       self.quantization) if self.fp8 else None)
        self.rendezvous = rendezvous
        self.writing = False  # inside updating(), or an update that raised (receivers wait)
        self.ddp = [] if ddp is None else (list(ddp) if isinstance(ddp, (list, tuple)) else [ddp])
        if delta and tracker is not None and tracker.deferred_gather and not self.ddp:
            raise MegarefitError("a tracker of a distributed optimizer with overlap_param_gather needs ddp= (the "
                                 "DDP model chunks): a publish must wait for the all-gather before it reads the marks")
        self.delta = (DeltaLog(served, self.agent, rendezvous, self.rank, DeltaOptions() if delta is True else delta,
                               tracker, _delta_sources(expected, self.params, self.fp8), [e.name for e in entries])
                      if delta else None)
        self.version: int | None = None  # the last version published
        self.last_move: MoveStats | None = None  # what the last declared move re-registered
        rendezvous.publish_manifest(self.manifest, self.agent.metadata)

    @classmethod
    def from_megatron(cls, model: torch.nn.Module | Sequence[torch.nn.Module], hf_config: Any, *,
                      rendezvous: Rendezvous, layout: SourceLayout | None = None, serve_copies: bool = True,
                      **options: Any) -> Publisher | PublisherGroup:
        """Serve this rank's Megatron-Core model, its layout read from Megatron itself.

        ``model``: the rank's model (``GPTModel`` / ``MambaModel``), or its list of model chunks
        with an interleaved pipeline (Megatron's ``model`` list, virtual-stage order); each may
        be wrapped in Megatron-Core ``DistributedDataParallel`` / ``Float16Module`` or torch DDP.
        Read from ``megatron.core.parallel_state`` and each chunk's ``TransformerConfig``: TP/PP/EP/
        ETP/VPP ranks and sizes, the (uneven) stage split as Megatron builds it, ``mtp_num_layers``,
        the padded vocab (``model.vocab_size``), the layer spec and expert layout (from the
        parameter names), and the Megatron-Core version and layout flags
        (:mod:`megarefit.layout.megatron_model`). ``layout``: what the caller expects, checked.

        Returns a :class:`Publisher` for one chunk, a :class:`PublisherGroup` (same methods) for
        several. Every process serves, data-parallel copies too (``RankCoord.copy``), so receivers
        spread their reads over every holder (:mod:`megarefit.planner.holders`): publish on every
        rank after the step (distributed optimizer: after its parameter all-gather). A copy costs
        what copy 0 costs (its NIXL registration; where asked FP8 buffers, snapshot, checksums).
        ``serve_copies=False``: copy 0 alone serves (a one-copy layout is published); the others
        get an empty ``PublisherGroup`` whose ``publish`` / ``updating`` do nothing.

        Raises:
            LayoutError: Megatron's parallel state is not initialized; config and process grid
                disagree; the model's layers or vocab do not fit ``hf_config``; ``layout`` differs
                from the model's (naming each field, stated vs read).
            TypeError: ``model`` is not a Megatron-Core model.
            and what the constructor raises.
        """
        cfg = load_hf_config(hf_config)
        chunks = read_chunks(model, ModelDims.from_hf_config(cfg))
        check_stated(chunks[0].layout, layout)
        if not serve_copies and chunks[0].replica:  # a data-parallel copy: copy 0 serves these bytes
            return PublisherGroup([], rendezvous, chunks[0].layout)
        chunks = chunks if serve_copies else [_one_copy(c) for c in chunks]  # receivers read copy 0 alone
        ddp = options.pop("ddp", None)
        pubs = [cls(c.params, cfg, rank=c.rank, layout=c.layout, rendezvous=rendezvous, ddp=ddp or c.ddp, **options)
                for c in chunks]
        return pubs[0] if len(pubs) == 1 else PublisherGroup(pubs, rendezvous, chunks[0].layout)

    def _build_manifest(self, agent_name: str, entries: list[TensorEntry]) -> Manifest:
        """The rank's manifest: ``entries`` with the agent's registered region of each (-1 if none)."""
        entries = [dataclasses.replace(e, region=-1 if (r := self.agent.region(e.addr, e.nbytes)) is None else r)
                   for e in entries]
        quant = None if self.quantization is None else (self.quantization.block, self.quantization.ue8m0)
        sums = None if self.checksums is None else (self.checksums[0].data_ptr(), self.checksums[0].numel() * 8,
                                                     *mem_type(self.checksums[0]))
        return Manifest(self.rank, self.dims, self.layout, agent_name, tuple(entries), dtype=self.dtype,
                        quantization=quant, checksums=sums, ipc=self.ipc, lora=self.lora)

    @property
    def counters(self):
        return self.agent.counters

    @property
    def last_delta(self) -> DeltaStats | None:
        """``delta=True``: what the last publish found and packed; else ``None``."""
        return None if self.delta is None else self.delta.last

    @property
    def serving(self) -> bool:
        """Always ``True`` (a :class:`PublisherGroup` on a data-parallel copy is not)."""
        return True

    def publish(self, version: int) -> None:
        """Announce that the weights now hold ``version`` (call after the optimizer step).

        Receivers cannot tell a pull that overlapped the step from one that did not: use
        :meth:`updating` unless the training loop itself guarantees no refit runs during
        the step. After an update that raised, ``publish`` ends it (the rank is stable again).

        Versions only move forward. The same version again is for the same weights (a retry, a
        step that changed nothing): with ``delta`` the publisher checks that, without it receivers
        that already hold the version keep what they pulled, so publish new weights as a new version.

        Raises:
            ShapeMismatchError: a parameter moved in memory since registration and no move was
                declared (:meth:`moving` / :meth:`params_moved`; names the tensor and both addresses).
            VersionOrderError: ``version`` is older than the last one published (nothing changes).
            RepublishError: ``delta``, the last version again with other weights; the rank stays
                marked writing until a newer version is published.
        """
        _check_order(self.rank, self.version, version)
        _check_moved(self)
        if (self.snapshot or self._quantize is not None or self.checksums is not None or self.delta is not None) \
                and not self.writing:
            self.rendezvous.begin_update(self.rank)  # the served buffers are rewritten below: a seqlock
            self.writing = True
        self._settle(version)
        if self.writing:
            self.rendezvous.end_update(self.rank, version)
            self.writing = False
        else:
            self.rendezvous.publish_version(self.rank, version)
        self.version = version

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
            ShapeMismatchError / VersionOrderError / RepublishError: as :meth:`publish` (the order
            is checked before the block).
        """
        _check_order(self.rank, self.version, version)
        if not self.writing:  # after a failed update the sequence is still odd
            self.rendezvous.begin_update(self.rank)
            self.writing = True
        yield
        _check_moved(self)
        self._settle(version)
        self.rendezvous.end_update(self.rank, version)
        self.writing = False
        self.version = version

    @contextlib.contextmanager
    def moving(self, *, remapped: bool | Iterable[str] = False,
               params: Mapping[str, torch.Tensor] | None = None) -> Iterator[None]:
        """``with pub.moving(): offload(model); ...; reload(model)`` -- a declared move.

        Before the block the rank is marked writing (its update sequence turns odd: no receiver
        accepts bytes read while its memory is freed); after it, :meth:`params_moved`. It stays
        writing until the next :meth:`publish` / :meth:`updating` (the same version again where the
        reloaded weights are that version's); if the block raises, nothing is re-registered.

        Raises: what :meth:`params_moved` raises."""
        if not self.writing:
            self.rendezvous.begin_update(self.rank)
            self.writing = True
        yield
        self.params_moved(remapped=remapped, params=params)

    def params_moved(self, *, remapped: bool | Iterable[str] = False,
                     params: Mapping[str, torch.Tensor] | None = None) -> MoveStats:
        """The trainer brought its parameters back at new addresses (verl's offload: storages
        resized to 0 and re-allocated), or re-mapped in place (``remapped``: ``True`` for every
        parameter, or their names; torch_memory_saver): re-register only the moved buffers with
        NIXL and republish this rank's manifest and metadata, signed (:mod:`~megarefit.online.
        trainer.moved`). Receivers keep their plans and caches. ``params``: the trainer's tensors
        now, where the move replaced tensor objects (``refit_tensors(model)`` after ``model.to``).

        Marks the rank writing (until the next ``publish``) if :meth:`moving` did not: outside it,
        only when no receiver reads during the move (after :meth:`wait_receivers`). Returns a ``MoveStats``.

        Raises:
            MegarefitError: a ``remapped`` name not served; a delta log that cannot follow (``moved.follow_delta``).
            MissingParameterError / ShapeMismatchError: ``params`` lacks a served tensor or changes one."""
        if not self.writing:
            self.rendezvous.begin_update(self.rank)
            self.writing = True
        self.last_move = reregister(self, remapped, params)
        return self.last_move

    def wait_receivers(self, version: int, *, timeout: float = 300.0, lease: float = 10.0) -> dict[str, str]:
        """Block until every live registered receiver acknowledged ``version`` (receivers
        whose heartbeat stopped for ``lease`` seconds are dropped); then the trainer may
        write again. Returns ``{receiver id: "acked" | "dropped"}``.

        Raises:
            RendezvousTimeout: naming each live receiver that did not acknowledge in time.
        """
        return self.rendezvous.wait_receivers(version, timeout=timeout, lease=lease)

    def _settle(self, version: int) -> None:
        """Finish Megatron's deferred param sync, wait for the device, refresh the snapshot,
        re-quantize FP8 buffers, record the delta into ``version``, fill the checksums."""
        check_param_sync(self.ddp, self.rank)
        devices = {p.device for p in self.params.values() if p.is_cuda}
        for device in devices:  # the step's kernels must have landed before the rank is declared stable
            torch.cuda.synchronize(device)
        if self.snapshot:  # live -> the registered copy receivers read (device-copy speed)
            refresh_snapshot(self.snapshot, self.params)
        if self._quantize is not None:  # the new weights into the registered FP8 buffers (one launch on a GPU)
            t0 = time.perf_counter()
            self._quantize()
            weight = next(iter(self.fp8.values()))[0]
            if weight.is_cuda:
                torch.cuda.synchronize(weight.device)
            self.last_quantize_s = time.perf_counter() - t0
        if self.delta is not None:  # what changed since the last version, packed for delta receivers
            self.delta.record(version)
        if self.checksums is not None:  # what receivers check the pulled bytes against, inside the seqlock
            t0 = time.perf_counter()
            self.checksums[1]()
            if self.checksums[0].is_cuda:
                torch.cuda.synchronize(self.checksums[0].device)
            self.last_checksum_s = time.perf_counter() - t0


def _checked_params(pub: Publisher) -> dict[str, SourceTensor]:
    """The shards the layout places on ``pub``'s rank (canonical name -> source tensor), checked
    against ``pub.params``: the same names, the same (local) shapes, contiguous.

    Raises:
        MissingParameterError / UnexpectedParameterError / ShapeMismatchError: as the class says.
        UnsupportedAdapterError: the parameters are a LoRA-wrapped model's (``to_wrap`` bases, adapters).
    """
    expected = source_tensors(pub.dims, pub.layout)[pub.rank.first]
    missing, extra = sorted(expected.keys() - pub.params.keys()), sorted(pub.params.keys() - expected.keys())
    lora = [n for n in extra if is_adapter(n) or WRAPPED in n]
    if lora:
        raise UnsupportedAdapterError(f"rank {pub.rank} serves a LoRA-wrapped model (Megatron-Bridge LoRA: "
                                      f"{lora[:2]}): serve the adapter merged in (MergedLoRA(...).served, "
                                      "docs/lora.md) or the adapter alone (LoraPublisher, the adapter-only refit)")
    if missing:
        raise MissingParameterError(f"rank {pub.rank} lacks {len(missing)} parameter(s) the layout places "
                                    f"there, e.g. {missing[:3]}")
    if extra:
        raise UnexpectedParameterError(f"rank {pub.rank} has {len(extra)} parameter(s) the layout does not "
                                       f"place there, e.g. {extra[:3]}")
    for name, t in expected.items():
        p = pub.params[name]
        if tuple(p.shape) != t.shape or not p.is_contiguous():
            raise ShapeMismatchError(f"parameter {name} on rank {pub.rank}: expected contiguous {t.shape}, "
                                     f"got {tuple(p.shape)} contiguous={p.is_contiguous()}")
    return expected


def _served_entries(pub: Publisher, expected: Mapping[str, SourceTensor]
                    ) -> tuple[list[TensorEntry], list[torch.Tensor]]:
    """Manifest entries (global shapes, addresses; region not yet known) of the tensors ``pub``'s
    rank serves, in layout order, and those tensors: an FP8 shard's weight and float32 scales,
    else the snapshot copy, else the live parameter."""
    entries, served = [], []
    for name, t in expected.items():
        gshape = global_shape(t.spec, pub.dims, pub.layout)
        if name in pub.fp8:
            weight, scale = pub.fp8[name]
            entries.append(tensor_entry(name, t.spec.role.value, weight, gshape))
            entries.append(tensor_entry(name + SCALE_SUFFIX, "fp8_scale", scale, pub.quantization.scale_shape(gshape)))
            served += [weight, scale]
        else:
            tensor = pub.snapshot.get(name, pub.params[name])
            entries.append(tensor_entry(name, t.spec.role.value, tensor, gshape))
            served.append(tensor)
    return entries, served


def _one_copy(chunk: Any) -> Any:
    """``chunk`` with a one-copy layout (``serve_copies=False``: copy 0 alone serves)."""
    return dataclasses.replace(chunk, layout=dataclasses.replace(chunk.layout, dp=0))


def _checksum_buffer(pub: Publisher, served: list[torch.Tensor], entries: list[TensorEntry]
                     ) -> tuple[torch.Tensor, Callable[[], None]]:
    """The registered checksum buffer of the tensors ``pub`` serves and what fills it (:func:`checksum_buffer`)."""
    experts = pub.dims.num_experts // pub.layout.ep if pub.dims.num_experts else 1
    flat, fill = checksum_buffer(served, entries, experts)
    pub.agent.register([flat])
    return flat, fill


def _check_order(rank: RankCoord, last: int | None, version: int) -> None:
    """Raises VersionOrderError when ``version`` is older than ``last``, the one published last."""
    if last is not None and version < last:
        raise VersionOrderError(f"rank {rank}: version {version} is older than version {last}, published last; "
                                "versions only move forward (receivers wait for newer ones only). A trainer "
                                "restarted from an older checkpoint creates a new Publisher")


def _check_moved(pub: Publisher) -> None:
    """Raises ShapeMismatchError when a live parameter ``pub`` serves moved since registration."""
    for entry in pub.manifest.tensors:
        if entry.name in pub.params and entry.name not in pub.fp8 and entry.name not in pub.snapshot and (
                pub.params[entry.name].data_ptr() != entry.addr):
            raise ShapeMismatchError(f"parameter {entry.name} on rank {pub.rank} moved since registration (registered "
                                     f"at {entry.addr:#x}, now at {pub.params[entry.name].data_ptr():#x}) and no move "
                                     "was declared: wrap the offload and reload in `with pub.moving():`, or call "
                                     "pub.params_moved() once the parameters are back (receivers keep their plans); "
                                     "or re-create the Publisher")


class PublisherGroup:
    """The Publishers of one rank's model chunks (interleaved pipeline: one per virtual stage),
    driven together: what :meth:`Publisher.from_megatron` returns for several chunks, and (empty,
    ``serving`` false) on a data-parallel copy, whose bytes another process serves.

    ``publish`` / ``updating`` / ``wait_receivers`` act on every chunk; a receiver reads each
    chunk as its own (virtual-stage) rank. ``publishers[c]`` is chunk ``c``'s Publisher.
    """

    def __init__(self, publishers: Sequence[Publisher], rendezvous: Rendezvous, layout: SourceLayout):
        self.publishers = list(publishers)
        self.rendezvous = rendezvous
        self.layout = layout

    @property
    def serving(self) -> bool:
        """Whether this process serves any bytes (``False`` on a data-parallel copy)."""
        return bool(self.publishers)

    def __iter__(self) -> Iterator[Publisher]:
        return iter(self.publishers)

    def __len__(self) -> int:
        return len(self.publishers)

    def publish(self, version: int) -> None:
        """:meth:`Publisher.publish` on every chunk, in order."""
        for pub in self.publishers:
            pub.publish(version)

    @contextlib.contextmanager
    def updating(self, version: int) -> Iterator[None]:
        """:meth:`Publisher.updating` around the block for every chunk (all marked writing first)."""
        with contextlib.ExitStack() as stack:
            for pub in self.publishers:
                stack.enter_context(pub.updating(version))
            yield

    @contextlib.contextmanager
    def moving(self, *, remapped: bool | Iterable[str] = False) -> Iterator[None]:
        """:meth:`Publisher.moving` around the block for every chunk (all marked writing first)."""
        with contextlib.ExitStack() as stack:
            for pub in self.publishers:
                stack.enter_context(pub.moving(remapped=remapped))
            yield

    def params_moved(self, *, remapped: bool | Iterable[str] = False) -> list[MoveStats]:
        """:meth:`Publisher.params_moved` on every chunk, in order."""
        return [pub.params_moved(remapped=remapped) for pub in self.publishers]

    def wait_receivers(self, version: int, *, timeout: float = 300.0, lease: float = 10.0) -> dict[str, str]:
        """:meth:`Publisher.wait_receivers` (receivers acknowledge a version for every rank at once)."""
        return self.rendezvous.wait_receivers(version, timeout=timeout, lease=lease)
