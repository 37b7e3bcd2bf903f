"""Under Ray: the rendezvous served from an actor, the job secret kept out of Ray's metadata, and
each actor's Ray GPUs mapped to the CUDA device index its process must use.

RL stacks (verl, NeMo-RL, SkyRL, slime) place one Ray actor per GPU in placement groups. Three
things then differ from a job megarefit launches itself::

    driver / controller                 rendezvous actor (node IP, port 0)       trainer / receiver actors
    serve_rendezvous(job) ------------> Rendezvous.serve(<node IP>, 0, secret)
      address  <-- actor call --------  RendezvousAddress(host, port, job)  (no secret in it)
      secret   <-- actor call --------  the job secret (made in the actor), or a 0600 file
    actor.setup.remote(address, secret) ------------------------------------>  address.connect(secret)
    VllmHttpRefit(url).init(**address.init_info())   (the server's workers connect to the node IP)

- **Address.** The rendezvous binds the IP of the node its actor runs on
  (``ray.util.get_node_ip_address()``), that address only: a wildcard (``0.0.0.0``) only when
  asked for by ``host=``. Other actors learn it from :meth:`RendezvousServer.address`.
- **Secret.** The actor draws the job secret itself (or takes the one given); it reaches the
  other actors through actor calls (:meth:`RendezvousServer.secret`) or a file of mode 0600
  (:func:`write_secret_file`, :func:`read_secret_file`), never through ``runtime_env``: Ray keeps
  a job's and an actor's ``runtime_env`` in its GCS tables and shows it in job metadata
  (``ray list actors --detail``, the dashboard); an ``env_vars`` entry there also reaches
  every process the actor starts. docs/ray.md says what each path exposes.
- **GPUs.** Ray hands an actor GPU ids (``ray.get_runtime_context().get_accelerator_ids()["GPU"]``:
  the node's ``CUDA_VISIBLE_DEVICES`` entries, or ``"0".."n-1"``) and sets the actor's
  ``CUDA_VISIBLE_DEVICES`` to them, so CUDA renumbers them from 0; with
  ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` (verl's colocated mode) it leaves the
  variable alone and the process sees every GPU. :func:`local_device_index` maps a Ray GPU id
  to the index ``torch.device("cuda", i)`` takes in that process, in both cases, for integer ids
  and UUIDs (``GPU-...``, ``MIG-...``). Where one side names GPUs by index and the other by UUID,
  it needs the node's UUIDs in CUDA's enumeration order (``uuids=``).
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from megarefit.errors import MegarefitError
from megarefit.online.store.rendezvous import Rendezvous

SECRET_FILE_MODE = 0o600  # owner read/write only; read_secret_file refuses group or other bits
WILDCARDS = ("0.0.0.0", "::", "")  # bind every interface: only when asked for by host=
NOSET_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"  # Ray leaves CUDA_VISIBLE_DEVICES alone


class RayPlacementError(MegarefitError):
    """A Ray GPU id is not among the devices this process sees (or is ambiguous there)."""


@dataclass(frozen=True)
class RendezvousAddress:
    """Where a job's rendezvous is served: ``host`` (the rendezvous actor's node IP), ``port``,
    ``job``. It holds no secret: pass it to any actor, print it, log it."""

    host: str
    port: int
    job: str

    def connect(self, secret: str | None = None, *, secret_file: str | os.PathLike | None = None,
                timeout: float = 300.0) -> Rendezvous:
        """Join the rendezvous with the job secret (``secret``, or read from ``secret_file``).

        Raises:
            MegarefitError: neither or both of ``secret`` / ``secret_file`` given; the file is
                unsafe (:func:`read_secret_file`).
            StoreError: the store cannot be reached or refused the secret."""
        if (secret is None) == (secret_file is None):
            raise MegarefitError("RendezvousAddress.connect needs exactly one of secret= (from "
                                 "RendezvousServer.secret()) or secret_file= (RendezvousServer(secret_file=...))")
        key = secret if secret is not None else read_secret_file(secret_file)  # type: ignore[arg-type]
        return Rendezvous.connect(self.host, self.port, job=self.job, timeout=timeout, secret=key)

    def init_info(self) -> dict[str, Any]:
        """``host``, ``port``, ``job`` for ``VllmHttpRefit.init(**address.init_info(), ...)``."""
        return {"host": self.host, "port": self.port, "job": self.job}


def write_secret_file(path: str | os.PathLike, secret: str) -> Path:
    """Write ``secret`` to a new file of mode 0600 (created so: never readable by others, not
    even for a moment). Refuses to replace an existing file or follow a symlink.

    Raises:
        MegarefitError: ``path`` exists (names the fix)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, SECRET_FILE_MODE)
    except FileExistsError:
        raise MegarefitError(f"secret file {path} exists: megarefit does not replace it (a file another process "
                             "made may be readable by others). Remove it, or pick a new path") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secret)
    return path


def read_secret_file(path: str | os.PathLike) -> str:
    """The secret in ``path``, which must be a regular file owned by this user with no group or
    other permission bits (as ssh checks its keys).

    Raises:
        MegarefitError: the file is missing, a symlink, not ours, or readable by others."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise MegarefitError(f"secret file {path} does not exist on this node ({ray.util.get_node_ip_address()}): "
                             "a file path reaches only actors on the node that wrote it (or a shared "
                             "filesystem); pass the secret through an actor call instead") from None
    except OSError as exc:
        raise MegarefitError(f"secret file {path} cannot be opened ({exc}); a symlink is refused") from None
    with os.fdopen(fd, encoding="utf-8") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise MegarefitError(f"secret file {path} is mode {stat.filemode(info.st_mode)} owned by uid "
                                 f"{info.st_uid}: expected a regular file of mode 0600 owned by uid {os.geteuid()}. "
                                 f"Fix: chmod 600 {path} (and check who could have read it)")
        return f.read().strip()


class RendezvousServer:
    """The body of the rendezvous actor (:data:`RendezvousActor`, or :func:`serve_rendezvous`):
    serves :meth:`Rendezvous.serve <megarefit.online.store.rendezvous.Rendezvous.serve>` on this
    node's IP, port chosen by the OS, for as long as the actor lives.

    Args:
        job: the job name (the store's key prefix).
        host: the address to bind; default this node's IP (``ray.util.get_node_ip_address()``).
            ``"0.0.0.0"`` binds every interface (then :meth:`address` still gives the node IP).
        secret: the job secret (at least 16 bytes); default a new random one, made here.
        secret_file: also write the secret to this path, mode 0600, on this actor's node.
        timeout: seconds the actor's own reads wait (:meth:`wait_receivers` takes its own).
    """

    def __init__(self, job: str = "default", *, host: str | None = None, secret: str | None = None,
                 secret_file: str | None = None, timeout: float = 300.0) -> None:
        self._node = ray.util.get_node_ip_address()
        bind = self._node if host is None else host
        self._secret = secret if secret is not None else secrets.token_hex(32)
        self._rdzv = Rendezvous.serve(bind, 0, job=job, timeout=timeout, secret=self._secret)
        self._address = RendezvousAddress(self._node if bind in WILDCARDS else bind, self._rdzv.port, job)
        self.bound = bind
        if secret_file is not None:
            write_secret_file(secret_file, self._secret)

    def address(self) -> RendezvousAddress:
        """Where the other actors connect (holds no secret)."""
        return self._address

    def secret(self) -> str:
        """The job secret, for the caller to pass on through actor calls (never ``runtime_env``)."""
        return self._secret

    def write_secret(self, path: str) -> str:
        """Write the secret to ``path`` (mode 0600) on this actor's node; returns the path."""
        return str(write_secret_file(path, self._secret))

    def bound_host(self) -> str:
        """The address the store's socket is bound to."""
        return self.bound

    def wait_receivers(self, version: int, timeout: float = 300.0, lease: float = 10.0) -> dict[str, str]:
        """:meth:`Rendezvous.wait_receivers`, for a controller that holds no secret."""
        return self._rdzv.wait_receivers(version, timeout=timeout, lease=lease)

    def mark_consumed(self, version: int) -> None:
        """:meth:`Rendezvous.mark_consumed`: the trainers may overwrite ``version``'s weights."""
        self._rdzv.mark_consumed(version)

    def receivers(self) -> list[str]:
        return self._rdzv.receivers()


# num_cpus=0: the store server is a small asyncio process; it takes no CPU slot from trainers
RendezvousActor = ray.remote(num_cpus=0)(RendezvousServer)


def serve_rendezvous(job: str = "default", **options: Any) -> tuple[Any, RendezvousAddress]:
    """Start a :data:`RendezvousActor` and return ``(its handle, its address)``. ``options``:
    :class:`RendezvousServer`'s arguments (``host``, ``secret``, ``secret_file``, ``timeout``).
    Keep the handle: the store lives as long as the actor (``ray.kill(handle)`` ends it); for a
    named or detached actor use ``RendezvousActor.options(name=..., lifetime=...).remote(...)``."""
    handle = RendezvousActor.remote(job, **options)
    return handle, ray.get(handle.address.remote())


# ---- GPUs ---------------------------------------------------------------------------------------


def _kind(entry: str) -> str:
    """``"index"`` (a CUDA ordinal), ``"uuid"`` (``GPU-...`` / ``MIG-...``) or ``"invalid"``."""
    if entry.isdigit():
        return "index"
    if entry[:4].upper() in ("GPU-", "MIG-") and len(entry) > 4:
        return "uuid"
    return "invalid"


def visible_entries(cuda_visible_devices: str | None) -> list[str] | None:
    """The device entries a process sees, as CUDA reads ``CUDA_VISIBLE_DEVICES``: comma
    separated, blanks ignored, parsing stops at the first entry that is neither an index nor a
    UUID (``-1`` hides everything after it). ``None``: unset, every device is visible.

    Raises:
        RayPlacementError: an entry appears twice (CUDA's behaviour is then undefined)."""
    if cuda_visible_devices is None:
        return None
    out: list[str] = []
    for raw in cuda_visible_devices.split(","):
        entry = raw.strip()
        if _kind(entry) == "invalid":
            break
        out.append(entry)
    keys = [_key(e) for e in out]
    if len(set(keys)) != len(keys):
        raise RayPlacementError(f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} names a device twice")
    return out


def _key(entry: str) -> str:
    """A comparable form: an index without leading zeros, a UUID lower-cased with its prefix."""
    return str(int(entry)) if entry.isdigit() else entry.lower()


def _uuid_form(uuid: str) -> str:
    """``GPU-<uuid>`` lower-cased (torch's ``get_device_properties(d).uuid`` has no prefix)."""
    return _key(uuid if _kind(uuid) == "uuid" else "GPU-" + uuid)


def _as_uuid(entry: str, uuids: Sequence[str] | None, what: str) -> str:
    if _kind(entry) == "uuid":
        return _key(entry)
    if uuids is None:
        raise RayPlacementError(f"{what} names GPU {entry!r} by index while the other side names GPUs by UUID: "
                                "pass uuids= (the node's GPU UUIDs in CUDA's enumeration order: nvidia-smi "
                                "--query-gpu=uuid --format=csv,noheader with CUDA_DEVICE_ORDER=PCI_BUS_ID set)")
    if int(entry) >= len(uuids):
        raise RayPlacementError(f"{what} names GPU {entry!r}, but uuids= lists {len(uuids)} GPUs")
    return _uuid_form(uuids[int(entry)])


def _same(ray_id: str, entry: str, uuids: Sequence[str] | None, where: str) -> bool:
    if _kind(ray_id) == _kind(entry) == "index":
        return int(ray_id) == int(entry)
    a, b = _as_uuid(ray_id, uuids, "Ray"), _as_uuid(entry, uuids, where)
    return a.startswith(b) or b.startswith(a)  # CUDA accepts a unique UUID prefix


def local_device_index(ray_gpu_id: str, cuda_visible_devices: str | None, *,
                       uuids: Sequence[str] | None = None) -> int:
    """The CUDA device index (``torch.device("cuda", index)``) of Ray GPU ``ray_gpu_id`` in a
    process whose ``CUDA_VISIBLE_DEVICES`` is ``cuda_visible_devices`` (``None``: unset).

    Examples (node ``CUDA_VISIBLE_DEVICES="2,3,5"``, an actor given GPU ``"5"``)::

        local_device_index("5", "5")      == 0   # Ray set the actor's variable: renumbered from 0
        local_device_index("5", "2,3,5")  == 2   # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1
        local_device_index("GPU-8f2c", "GPU-11aa,GPU-8f2c41d0") == 1   # UUIDs, unique prefixes
        local_device_index("1", "GPU-b", uuids=["GPU-a", "GPU-b"]) == 0  # index vs UUID

    Args:
        ray_gpu_id: one of ``ray.get_runtime_context().get_accelerator_ids()["GPU"]``.
        cuda_visible_devices: the process's ``CUDA_VISIBLE_DEVICES``.
        uuids: the node's GPU UUIDs in CUDA's enumeration order, needed only where one side
            names a GPU by index and the other by UUID.

    Raises:
        RayPlacementError: the GPU is not visible to the process, matches several entries, or
            needs ``uuids`` (each names the variable, the id and the fix)."""
    ray_gpu_id = ray_gpu_id.strip()
    if _kind(ray_gpu_id) == "invalid":
        raise RayPlacementError(f"Ray GPU id {ray_gpu_id!r} is neither a CUDA index nor a GPU-/MIG- UUID")
    entries = visible_entries(cuda_visible_devices)
    if entries is None:  # unset: every GPU, in CUDA's order
        if _kind(ray_gpu_id) == "index":
            return int(ray_gpu_id)
        if uuids is None:
            raise RayPlacementError(f"CUDA_VISIBLE_DEVICES is unset and Ray names GPU {ray_gpu_id!r} by UUID: pass "
                                    "uuids= (the node's GPU UUIDs in CUDA's enumeration order)")
        entries = [str(i) for i in range(len(uuids))]
    hits = [i for i, e in enumerate(entries) if _same(ray_gpu_id, e, uuids, "CUDA_VISIBLE_DEVICES")]
    if len(hits) != 1:
        seen = "none" if not hits else f"entries {hits}"
        raise RayPlacementError(
            f"Ray GPU {ray_gpu_id!r} matches {seen} of this process's CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} "
            f"(visible: {entries}). Ray sets the variable to an actor's own GPUs unless {NOSET_ENV}=1; a process "
            "that changed it, or a child started with another value, must map the GPU itself. Fix: give the "
            "process the entries Ray assigned (child_visible_devices), or request the GPU with num_gpus")
    return hits[0]


def local_device_indices(ray_gpu_ids: Sequence[str], cuda_visible_devices: str | None, *,
                         uuids: Sequence[str] | None = None) -> list[int]:
    """:func:`local_device_index` of each id, in Ray's order."""
    return [local_device_index(g, cuda_visible_devices, uuids=uuids) for g in ray_gpu_ids]


def child_visible_devices(ray_gpu_ids: Sequence[str], cuda_visible_devices: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a process an actor starts (e.g. ``vllm serve``) so it sees
    exactly the actor's Ray GPUs, in Ray's order, named as the actor's own variable names them.

    Raises:
        RayPlacementError: as :func:`local_device_index`."""
    entries = visible_entries(cuda_visible_devices)
    if entries is None:
        return ",".join(g.strip() for g in ray_gpu_ids)
    return ",".join(entries[i] for i in local_device_indices(ray_gpu_ids, cuda_visible_devices))


def actor_gpu_ids() -> list[str]:
    """This actor's (or task's) Ray GPU ids (``[]``: it asked for no GPU)."""
    return [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


def actor_device_indices(uuids: Sequence[str] | None = None) -> list[int]:
    """The CUDA device indices of this actor's Ray GPUs in this process (a receiver or trainer
    built here uses ``torch.device("cuda", actor_device_indices()[0])``).

    Raises:
        RayPlacementError: as :func:`local_device_index`."""
    return local_device_indices(actor_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"), uuids=uuids)


__all__ = ["NOSET_ENV", "SECRET_FILE_MODE", "RayPlacementError", "RendezvousActor", "RendezvousAddress",
           "RendezvousServer", "actor_device_indices", "actor_gpu_ids", "child_visible_devices",
           "local_device_index", "local_device_indices", "read_secret_file", "serve_rendezvous",
           "visible_entries", "write_secret_file"]
