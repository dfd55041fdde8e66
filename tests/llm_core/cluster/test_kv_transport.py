"""KV transports between processes: the bytes arrive whole, and a sender that
dies or a receiver that gave up is an error with a reason, never a hang."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from llm_core.cluster.kv_transport import (
    SharedMemoryTransport,
    TorchDistributedTransport,
    TransferError,
    TransferTicket,
    make_transport,
)

NBYTES = 3 << 20


def _blob(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _send(name: str, ticket: TransferTicket, hang: bool, device: str = "cpu") -> None:
    transport = make_transport(name, device=torch.device(device))
    if hang:  # a prefill worker that dies before it sends
        time.sleep(60)
    transport.send(ticket, _blob(), timeout=10)
    time.sleep(0.5)  # the peer reads before this process (and its gloo pair) goes away


def _sender(name: str, ticket: TransferTicket, hang: bool = False, device: str = "cpu") -> mp.Process:
    process = mp.get_context("spawn").Process(target=_send, args=(name, ticket, hang, device), daemon=True)
    process.start()
    return process


@pytest.mark.parametrize("name", ["shm", "torch"])
def test_a_blob_sent_from_another_process_arrives_whole(name: str) -> None:
    transport = SharedMemoryTransport() if name == "shm" else TorchDistributedTransport(timeout=20)
    slot = transport.open_receive(NBYTES, peer="prefill-a")
    sender = _sender(name, slot.ticket)
    if name == "shm":
        sender.join(30)  # the "sent" message: here, the sender's exit
        assert sender.exitcode == 0
    try:
        assert torch.equal(slot.result(timeout=30), _blob())
    finally:
        slot.close()
        sender.join(30)
    assert sender.exitcode == 0


def test_a_sender_killed_mid_transfer_fails_the_receive_in_time() -> None:
    transport = TorchDistributedTransport(timeout=20)
    slot = transport.open_receive(NBYTES, peer="prefill-b")
    sender = _sender("torch", slot.ticket, hang=True)
    time.sleep(3)  # it has met the receiver's store, not sent
    os.kill(sender.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TransferError):
        slot.result(timeout=5)
    assert time.monotonic() - start < 5.5
    slot.close()


def test_a_receive_nobody_answers_times_out() -> None:
    slot = TorchDistributedTransport(timeout=2).open_receive(16, peer="nobody")
    with pytest.raises(TransferError):
        slot.result(timeout=0.5)


def test_sending_into_a_closed_shared_memory_slot_is_an_error() -> None:
    transport = SharedMemoryTransport()
    slot = transport.open_receive(8, peer="p")
    slot.close()
    with pytest.raises(TransferError):
        transport.send(slot.ticket, torch.zeros(8, dtype=torch.uint8), timeout=1)
    with pytest.raises(TransferError):
        transport.send(TransferTicket("shm", "x", 4, slot.ticket.address), torch.zeros(8, dtype=torch.uint8), 1)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL point-to-point needs two CUDA devices")
def test_nccl_moves_a_blob_between_two_devices() -> None:
    transport = TorchDistributedTransport(device=torch.device("cuda:0"), timeout=60)
    assert transport.backend == "nccl"
    slot = transport.open_receive(NBYTES, peer="prefill-gpu")
    sender = _sender("torch", slot.ticket, device="cuda:1")
    try:
        assert torch.equal(slot.result(timeout=60), _blob())
    finally:
        sender.join(60)
    assert sender.exitcode == 0


def test_segments_of_a_dead_receiver_are_reaped_by_the_next_one() -> None:
    dead = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    orphan = f"/dev/shm/swallow-kv-{dead.pid}-0123456789abcdef"
    with open(orphan, "wb") as f:
        f.write(b"x")
    SharedMemoryTransport()
    assert not os.path.exists(orphan)


def test_shared_memory_buffers_are_counted_in_use_and_kept_idle_only_when_delivered() -> None:
    transport = SharedMemoryTransport(keep_segments=1)
    try:
        delivered, failed = transport.open_receive(1000, "peer"), transport.open_receive(1000, "peer")
        assert transport.buffers() == {"in_use": 2, "idle": 0}
        transport.send(delivered.ticket, torch.ones(1000, dtype=torch.uint8), 1.0)
        assert int(delivered.result(1.0).sum()) == 1000
        delivered.close()
        failed.close()
        delivered.close()  # idempotent
        assert transport.buffers() == {"in_use": 0, "idle": 1}
        assert not os.path.exists(f"/dev/shm/{failed.ticket.address}")
        assert os.path.exists(f"/dev/shm/{delivered.ticket.address}")
    finally:
        transport.close()
    assert not os.path.exists(f"/dev/shm/{delivered.ticket.address}")
