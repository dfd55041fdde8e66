"""How a prefilled request's KV blob (``disagg.py``) travels from a prefill
worker to a decode worker.

The receiver opens every transfer: it holds a buffer of the planned size
before it asks for the KV (``open_receive`` gives a ``TransferTicket`` to send
along with the request), and waits for the bytes with a deadline. A transfer
that fails or times out is the receiver's to give up on; the sender never
waits for a receiver that is gone longer than its own deadline.

* ``SharedMemoryTransport``: the buffer is a POSIX shared-memory segment the
  receiver creates; a sender on the same host writes the blob into it (one
  copy), and the receiver reads from it straight into its pools.
* ``TorchDistributedTransport``: point-to-point over a ``torch.distributed``
  process group of two, one per (receiver, sender) pair, gloo on CPU and NCCL
  on GPU, met through a ``TCPStore`` the receiver hosts. A pair whose peer
  died is dropped and met again under a new name.

Another engine (NIXL, Mooncake's transfer engine) is a third ``KVTransport``.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import threading
import uuid
from collections import OrderedDict
from abc import ABC, abstractmethod
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import torch
import torch.distributed as dist

__all__ = ["KVTransport", "ReceiveSlot", "SharedMemoryTransport", "TorchDistributedTransport", "TransferError",
           "TransferTicket", "make_transport"]

log = logging.getLogger(__name__)
_MIN_SEGMENT = 1 << 20
_SEGMENT_PREFIX = "swallow-kv-"


class TransferError(RuntimeError):
    """The KV did not arrive (peer gone, deadline passed, bad size)."""


@dataclass(frozen=True)
class TransferTicket:
    """What the sender needs to deliver one transfer (plain fields: it travels in a message)."""

    transport: str  # "shm" | "torch"
    transfer_id: str
    nbytes: int
    address: str  # shm: the segment's name; torch: the receiver's store, host:port
    group: str = ""  # torch: the pair's group name
    tag: int = 0  # torch: this transfer's tag within the pair


class ReceiveSlot(ABC):
    """One open transfer on the receiving side."""

    def __init__(self, ticket: TransferTicket) -> None:
        self.ticket = ticket

    @abstractmethod
    def result(self, timeout: float) -> torch.Tensor:
        """The received bytes (uint8, ``ticket.nbytes``), once the sender says
        it sent them; valid until ``close``. TransferError if they do not come."""

    @abstractmethod
    def close(self) -> None:
        """Free the buffer (idempotent)."""


class KVTransport(ABC):
    name: str

    @abstractmethod
    def open_receive(self, nbytes: int, peer: str) -> ReceiveSlot:
        """A buffer for a transfer from ``peer`` (the sender's address), ready before it is asked for."""

    @abstractmethod
    def send(self, ticket: TransferTicket, blob: torch.Tensor, timeout: float) -> None:
        """Deliver ``blob`` as ``ticket`` says (TransferError if it cannot)."""

    @abstractmethod
    def buffers(self) -> dict[str, int]:
        """Receive buffers: ``in_use`` by open transfers, ``idle`` kept for the next ones."""

    def close(self) -> None:
        pass


# ------------------------------------------------------------ shared memory
def _untrack(shm: SharedMemory) -> None:
    # Python 3.11's resource tracker would unlink a segment when a process that
    # merely attached it exits; each segment here is unlinked by its receiver.
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


class _SharedMemorySlot(ReceiveSlot):
    def __init__(self, ticket: TransferTicket, shm: SharedMemory, transport: SharedMemoryTransport) -> None:
        super().__init__(ticket)
        self._shm: SharedMemory | None = shm
        self._transport = transport
        self._delivered = False

    def result(self, timeout: float) -> torch.Tensor:
        if self._shm is None:
            raise TransferError("the transfer was closed")
        # The sender's "sent" message is the only signal: its bytes are in the segment by then.
        self._delivered = True
        if not self.ticket.nbytes:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=self.ticket.nbytes)

    def close(self) -> None:
        shm, self._shm = self._shm, None
        if shm is not None:
            self._transport.give_back(shm, reusable=self._delivered)


class SharedMemoryTransport(KVTransport):
    """Between processes on one host. Segments of delivered transfers are
    kept for the next ones (a fresh segment costs a page fault per page on
    both sides); one whose transfer failed is unlinked, never reused, since
    its sender may still be writing into it."""

    name = "shm"

    def __init__(self, keep_segments: int = 8, keep_attached: int = 16) -> None:
        _reap_orphans()
        self.keep_segments = keep_segments
        self._free: list[SharedMemory] = []  # receiving side: delivered segments, ready again
        self._in_use = 0
        self._attached: OrderedDict[str, SharedMemory] = OrderedDict()  # sending side: receivers' segments
        self._lock = threading.Lock()
        self._keep_attached = keep_attached

    def open_receive(self, nbytes: int, peer: str) -> ReceiveSlot:
        with self._lock:
            fits = [s for s in self._free if nbytes <= s.size <= max(2 * nbytes, _MIN_SEGMENT)]
            shm = min(fits, key=lambda s: s.size) if fits else None
            if shm is not None:
                self._free.remove(shm)
            self._in_use += 1
        if shm is None:
            size = max(_MIN_SEGMENT, 1 << max(0, nbytes - 1).bit_length())
            shm = SharedMemory(f"{_SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:16]}", create=True, size=size)
            _untrack(shm)
        return _SharedMemorySlot(TransferTicket(self.name, uuid.uuid4().hex[:16], nbytes, shm.name), shm, self)

    def give_back(self, shm: SharedMemory, reusable: bool) -> None:
        with self._lock:
            self._in_use -= 1
            if reusable and len(self._free) < self.keep_segments:
                self._free.append(shm)
                return
        _unlink(shm)

    def buffers(self) -> dict[str, int]:
        with self._lock:
            return {"in_use": self._in_use, "idle": len(self._free)}

    def send(self, ticket: TransferTicket, blob: torch.Tensor, timeout: float) -> None:
        if blob.numel() != ticket.nbytes:
            raise TransferError(f"the receiver expects {ticket.nbytes} bytes, the KV is {blob.numel()}")
        shm = self._attach(ticket.address)
        if blob.numel() > shm.size:
            raise TransferError(f"the receiver's buffer holds {shm.size} bytes, the KV is {blob.numel()}")
        if blob.numel():
            torch.frombuffer(shm.buf, dtype=torch.uint8, count=blob.numel()).copy_(blob.reshape(-1))

    def _attach(self, name: str) -> SharedMemory:
        with self._lock:
            shm = self._attached.get(name)
            if shm is not None:
                self._attached.move_to_end(name)
                return shm
        try:
            shm = SharedMemory(name)
        except FileNotFoundError as exc:
            raise TransferError("the receiver's buffer is gone (the request was aborted)") from exc
        _untrack(shm)
        with self._lock:
            self._attached[name] = shm
            while len(self._attached) > self._keep_attached:
                self._attached.popitem(last=False)[1].close()
        return shm

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
            attached, self._attached = list(self._attached.values()), OrderedDict()
        for shm in free:
            _unlink(shm)
        for shm in attached:
            shm.close()


def _reap_orphans() -> None:
    """Unlink the segments of receivers that died without closing them (a
    killed decode worker): a segment's name starts with its creator's pid."""
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return
    for name in names:
        if not name.startswith(_SEGMENT_PREFIX):
            continue
        pid = name[len(_SEGMENT_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(shm: SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:
        log.warning("a KV transfer buffer was still in use at close")
    try:  # not shm.unlink(): the resource tracker no longer knows the segment
        os.unlink(f"/dev/shm/{shm.name.lstrip('/')}")
    except FileNotFoundError:
        pass


# ------------------------------------------------------- torch.distributed
class _PairGroups:
    """Two-rank process groups by name, each created once both sides joined
    (meeting blocks: one pair waiting for its peer holds up no other pair)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, name: str, store: dist.Store, rank: int, timeout: float) -> dist.ProcessGroup:
        with self._lock:
            lock = self._locks.setdefault(name, threading.Lock())
        with lock:
            group = self._groups.get(name)
            if group is None:
                prefixed = dist.PrefixStore(name, store)
                if self.backend == "nccl":
                    group = dist.ProcessGroupNCCL(prefixed, rank, 2)
                else:
                    group = dist.ProcessGroupGloo(prefixed, rank, 2, datetime.timedelta(seconds=timeout))
                self._groups[name] = group
            return group

    def drop(self, name: str) -> None:
        with self._lock:
            self._groups.pop(name, None)
            self._locks.pop(name, None)


class _TorchSlot(ReceiveSlot):
    def __init__(self, ticket: TransferTicket, buffer: torch.Tensor, transport: TorchDistributedTransport) -> None:
        super().__init__(ticket)
        self._buffer = buffer
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._transport = transport
        self._closed = False
        threading.Thread(target=self._receive, name="swallow-kv-recv", daemon=True).start()

    def _receive(self) -> None:
        t = self._transport
        try:
            group = t.groups.get(self.ticket.group, t.store, 0, t.timeout)
            if self.ticket.nbytes:
                group.recv([self._buffer], 1, self.ticket.tag).wait(datetime.timedelta(seconds=t.timeout))
        except BaseException as exc:  # noqa: BLE001 - reported to whoever waits on the result
            t.groups.drop(self.ticket.group)
            t.forget_peer(self.ticket.group)
            self._error = exc
        finally:
            self._done.set()

    def result(self, timeout: float) -> torch.Tensor:
        if not self._done.wait(timeout):
            raise TransferError(f"the KV did not arrive within {timeout:.1f} s")
        if self._error is not None:
            raise TransferError(f"the KV transfer failed: {self._error}") from self._error
        return self._buffer if self._buffer.device.type == "cpu" else self._buffer.cpu()

    def close(self) -> None:
        # The receiving thread ends with the transfer or its deadline; the buffer is the GC's.
        if not self._closed:
            self._closed = True
            self._transport.slot_closed()


class TorchDistributedTransport(KVTransport):
    """``torch.distributed`` point-to-point: gloo (host buffers) or NCCL (device buffers)."""

    name = "torch"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, backend: str | None = None,
                 device: torch.device | None = None, timeout: float = 30.0) -> None:
        """Hosts this process's ``TCPStore`` (where senders meet it) on ``port``
        (0: a free one). ``timeout``: how long a pair waits to meet and a
        transfer to finish."""
        self.device = device or torch.device("cpu")
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.timeout = timeout
        span = datetime.timedelta(seconds=timeout)
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=span)
        self.address = f"{host}:{self.store.port}"
        self.groups = _PairGroups(self.backend)
        self._incarnation = uuid.uuid4().hex[:8]
        self._pairs: dict[str, str] = {}  # sender address -> its group name
        self._epoch = itertools.count()
        self._tags = itertools.count()
        self._stores: dict[str, dist.Store] = {}  # receivers' stores, by address (sending side)
        self._lock = threading.Lock()
        self._in_use = 0

    def _pair(self, peer: str) -> str:
        with self._lock:
            name = self._pairs.get(peer)
            if name is None:
                name = self._pairs[peer] = f"kv/{self._incarnation}/{peer}/{next(self._epoch)}"
            return name

    def forget_peer(self, group: str) -> None:
        """A failed pair is met again under a new name (its peer may have restarted)."""
        with self._lock:
            for peer, name in list(self._pairs.items()):
                if name == group:
                    del self._pairs[peer]

    def open_receive(self, nbytes: int, peer: str) -> ReceiveSlot:
        ticket = TransferTicket(self.name, uuid.uuid4().hex[:16], nbytes, self.address, self._pair(peer),
                                next(self._tags) % (1 << 31))
        with self._lock:
            self._in_use += 1
        return _TorchSlot(ticket, torch.empty(nbytes, dtype=torch.uint8, device=self.device), self)

    def slot_closed(self) -> None:
        with self._lock:
            self._in_use -= 1

    def buffers(self) -> dict[str, int]:
        with self._lock:
            return {"in_use": self._in_use, "idle": 0}

    def _store_of(self, address: str) -> dist.Store:
        with self._lock:
            store = self._stores.get(address)
            if store is None:
                host, port = address.rsplit(":", 1)
                store = self._stores[address] = dist.TCPStore(
                    host, int(port), is_master=False, timeout=datetime.timedelta(seconds=self.timeout))
            return store

    def send(self, ticket: TransferTicket, blob: torch.Tensor, timeout: float) -> None:
        if blob.numel() != ticket.nbytes:
            raise TransferError(f"the receiver expects {ticket.nbytes} bytes, the KV is {blob.numel()}")
        if not blob.numel():
            return
        try:
            group = self.groups.get(ticket.group, self._store_of(ticket.address), 1, self.timeout)
            group.send([blob.to(self.device).contiguous()], 0, ticket.tag).wait(datetime.timedelta(seconds=timeout))
        except TransferError:
            raise
        except Exception as exc:  # noqa: BLE001 - the pair is broken: meet again next time
            self.groups.drop(ticket.group)
            raise TransferError(f"sending the KV failed: {exc}") from exc


def make_transport(name: str, host: str = "127.0.0.1", device: torch.device | None = None,
                   timeout: float = 30.0) -> KVTransport:
    if name == "shm":
        return SharedMemoryTransport()
    if name == "torch":
        return TorchDistributedTransport(host, 0, device=device, timeout=timeout)
    raise ValueError(f"unknown KV transport {name!r}; choose shm or torch")
