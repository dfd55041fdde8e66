"""Running one engine over an expert-parallel group, SPMD.

Every rank runs the same engine on the same requests; only the routed
experts are split (``llm_core.model.expert_parallel``), and their all-gather leaves
every rank with bit-identical hidden states, so every rank samples the same
tokens. What must be kept equal is the engine's input: rank 0 (the leader)
owns the request stream, applies each call (add, abort, flush, reset) to its
own engine at once, records it, and at each step broadcasts the calls since
the last step; the followers apply them in the same order (request ids are
sequential, so they match) and step. The scheduler's clock is part of that
input -- its aging orders the queue -- so every clock reading is the
leader's, sent along. Each message also carries a digest of the leader's
previous step's tokens: a follower that disagrees stops rather than compute
with a different batch.

Messages are a JSON header plus raw tensor bytes (multimodal embeddings),
never pickle. Followers are ``python -c`` processes started by the leader on
this host (``launch_local_group``); they exit on a stop message, or when the
leader's sockets close.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from llm_core.engine import Engine, EngineConfig, TokenEvent
from llm_core.model.expert_parallel import (
    ExpertParallel,
    STORE_TIMEOUT,
    ExpertParallelError,
    all_gather,
    broadcast,
    expert_parallel_from_store,
)
from llm_core.sample.grammar import GrammarSpec
from llm_core.model.multimodal import MultimodalSpan
from llm_core.sample.params import SamplingParams

if TYPE_CHECKING:
    from llm_core.llm import LLM

__all__ = ["EPLeader", "LocalGroup", "check_engine_config", "follow", "launch_local_group"]

log = logging.getLogger(__name__)
_FAILED = -1  # the digest of a step that raised


def check_engine_config(config: EngineConfig) -> EngineConfig:
    """The engine config every rank runs: eager forwards (a MoE layer's
    collectives have data-dependent sizes, which neither torch.compile nor a
    CUDA graph captures) and no KV tiers (their asynchronous reads finish at
    different times on different ranks, and the schedule would part)."""
    if config.compile:
        raise ValueError("expert parallelism runs eager forwards: leave compile off (--no-compile)")
    if config.cuda_graph_max_batch:
        raise ValueError("expert parallelism runs eager forwards: CUDA graphs must be off (--cuda-graph-max-batch 0)")
    if config.kv_host_bytes or config.kv_disk_bytes:
        raise ValueError("expert parallelism does not take KV tiers (host or disk) yet")
    return dataclasses.replace(config, cuda_graph_max_batch=0)


# --------------------------------------------------------------- messages
class ReplayClock:
    """The scheduler's clock: the time the leader read for the current call."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class StepMessage:
    ops: list[dict[str, Any]]  # engine calls since the last step, in order
    time: float  # the clock of the step itself
    check: int  # digest of the leader's previous step
    stop: bool = False


def _encode(message: StepMessage, blobs: Sequence[bytes]) -> bytes:
    header = json.dumps(dataclasses.asdict(message)).encode()
    return len(header).to_bytes(8, "little") + header + b"".join(blobs)


def _decode(payload: bytes) -> tuple[StepMessage, memoryview]:
    size = int.from_bytes(payload[:8], "little")
    return StepMessage(**json.loads(payload[8 : 8 + size])), memoryview(payload)[8 + size :]


def _add_op(now: float, prompt: list[int], params: SamplingParams, eos_ids: Sequence[int],
            spans: Sequence[MultimodalSpan], blobs: list[bytes], offset: int) -> tuple[dict[str, Any], int]:
    """An add call as JSON; span rows appended to ``blobs`` (``offset``: the bytes before them)."""
    encoded_spans = []
    for span in spans:
        rows = span.embeddings.detach().to("cpu").contiguous()
        raw = rows.view(torch.uint8).numpy().tobytes() if rows.numel() else b""
        encoded_spans.append({"offset": span.offset, "key": span.key.hex(), "dtype": str(rows.dtype).split(".")[1],
                              "shape": list(rows.shape), "start": offset, "end": offset + len(raw)})
        blobs.append(raw)
        offset += len(raw)
    op = {"op": "add", "time": now, "prompt": list(prompt), "params": dataclasses.asdict(params),
          "eos": list(eos_ids), "spans": encoded_spans}
    return op, offset


def _params(fields: dict[str, Any]) -> SamplingParams:
    grammar = fields.pop("grammar")
    return SamplingParams(**fields, grammar=GrammarSpec(**grammar) if grammar is not None else None)


def _spans(encoded: list[dict[str, Any]], blobs: memoryview) -> list[MultimodalSpan]:
    spans = []
    for span in encoded:
        raw = bytearray(blobs[span["start"] : span["end"]])
        dtype = getattr(torch, span["dtype"])
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
        spans.append(MultimodalSpan(span["offset"], rows.view(span["shape"]), bytes.fromhex(span["key"])))
    return spans


def _digest(events: list[TokenEvent]) -> int:
    return zlib.crc32(json.dumps([(e.request_id, e.token, e.finish_reason) for e in events]).encode())


def _send(ep: ExpertParallel, payload: bytes) -> None:
    broadcast(ep.control, torch.tensor([len(payload)], dtype=torch.int64))
    broadcast(ep.control, torch.frombuffer(bytearray(payload), dtype=torch.uint8))


def _receive(ep: ExpertParallel) -> bytes:
    size = broadcast(ep.control, torch.zeros(1, dtype=torch.int64))
    return bytes(broadcast(ep.control, torch.empty(int(size), dtype=torch.uint8)).numpy())


def handshake(ep: ExpertParallel, built: bool) -> list[int]:
    """Every rank says whether it built its engine: the ranks that did not."""
    ready = all_gather(ep.control, torch.tensor([built], dtype=torch.uint8), ep.size)
    return [rank for rank, ok in enumerate(ready) if not ok.item()]


# ----------------------------------------------------------------- leader
class EPLeader:
    """Rank 0's side: it stands in for the engine (``LLM.core``), and the
    engine calls it makes are recorded for the followers."""

    def __init__(self, ep: ExpertParallel, engine: Engine,
                 wall_clock: Callable[[], float] = time.monotonic) -> None:
        self.ep = ep
        self.wall_clock = wall_clock  # what ``clock`` reads, and the followers replay
        self.clock = ReplayClock()
        self.engine = engine
        self.rebind(engine)
        self._ops: list[dict[str, Any]] = []
        self._blobs: list[bytes] = []
        self._blob_bytes = 0
        self._last = _digest([])
        self.broken: str | None = None  # set once the group failed: nothing runs after that

    def rebind(self, engine: Engine) -> None:
        """Drive ``engine`` (a rebuilt one) from now on."""
        self.engine = engine
        engine.scheduler.clock = self.clock

    def _tick(self) -> float:
        self.clock.now = self.wall_clock()
        return self.clock.now

    def add_request(self, prompt: list[int], params: SamplingParams, eos_ids: Sequence[int] = (),
                    mm_spans: Sequence[MultimodalSpan] = (), export_kv: bool = False) -> int:
        if export_kv:
            raise ValueError("an expert-parallel engine does not export KV (disaggregation) yet")
        now = self._tick()
        request_id = self.engine.add_request(prompt, params, tuple(eos_ids), mm_spans)  # refusals are not replayed
        op, self._blob_bytes = _add_op(now, prompt, params, eos_ids, mm_spans, self._blobs, self._blob_bytes)
        self._ops.append(op)
        return request_id

    def reserve_kv(self, num_prompt_tokens: int, max_tokens: int) -> None:
        raise ValueError("an expert-parallel engine does not import KV (disaggregation) yet")

    def abort(self, request_id: int) -> bool:
        now = self._tick()
        if not self.engine.abort(request_id):
            return False  # ended already, on every rank
        self._ops.append({"op": "abort", "time": now, "id": request_id})
        return True

    def flush_cache(self) -> None:
        self._ops.append({"op": "flush", "time": self._tick()})
        self.engine.flush_cache()

    def reset(self, engine: Engine) -> None:
        """After the LLM rebuilt its engine: the followers rebuild theirs."""
        if self.broken is not None:
            raise ExpertParallelError(f"the expert-parallel group is unusable: {self.broken}")
        self._ops.append({"op": "reset", "time": self._tick()})
        self.rebind(engine)

    def step(self) -> list[TokenEvent]:
        if self.broken is not None:
            raise ExpertParallelError(f"the expert-parallel group is unusable: {self.broken}")
        now = self.wall_clock()
        self._flush_ops(StepMessage(self._ops, now, self._last))
        self.clock.now = now
        try:
            events = self.engine.step()
        except BaseException:
            self._last = _FAILED
            raise
        self._last = _digest(events)
        return events

    def _flush_ops(self, message: StepMessage) -> None:
        try:
            _send(self.ep, _encode(message, self._blobs))
        except ExpertParallelError as exc:
            self.broken = str(exc)
            raise
        finally:
            self._ops, self._blobs, self._blob_bytes = [], [], 0

    def close(self, persist: bool = True) -> None:
        """The engine's ``close``, then the followers exit."""
        self.engine.close(persist)
        self.stop()

    def stop(self) -> None:
        """Followers exit (after the calls not yet sent)."""
        if self.broken is None:
            self._flush_ops(StepMessage(self._ops, self.wall_clock(), self._last, stop=True))
            self.broken = "stopped"


# --------------------------------------------------------------- follower
def follow(llm: LLM) -> None:
    """A follower's loop: apply the leader's calls and step, until told to stop."""
    ep = llm.ep
    assert ep is not None and not ep.leader
    clock = ReplayClock()
    llm.engine.scheduler.clock = clock
    last = _digest([])
    while True:
        message, blobs = _decode(_receive(ep))
        for op in message.ops:
            clock.now = op["time"]
            _apply(llm, op, blobs, clock)
        if message.stop:
            return
        if message.check != last:
            raise ExpertParallelError(f"rank {ep.rank} computed other tokens than the leader in the last step: "
                                      "the ranks' engines have parted")
        clock.now = message.time
        try:
            with torch.inference_mode():
                events = llm.engine.step()
        except Exception:  # noqa: BLE001 - the leader failed the same way, and decides (it resets)
            log.exception("expert-parallel rank %d: an engine step failed", ep.rank)
            last = _FAILED
            continue
        last = _digest(events)


def _apply(llm: LLM, op: dict[str, Any], blobs: memoryview, clock: ReplayClock) -> None:
    kind = op["op"]
    if kind == "add":
        llm.engine.add_request(op["prompt"], _params(op["params"]), tuple(op["eos"]), _spans(op["spans"], blobs))
    elif kind == "abort":
        llm.engine.abort(op["id"])
    elif kind == "flush":
        llm.engine.flush_cache()
    elif kind == "reset":
        llm.reset_engine()
        llm.engine.scheduler.clock = clock
    else:
        raise ExpertParallelError(f"unknown expert-parallel message {kind!r}")


# ---------------------------------------------------------------- launch
@dataclass
class LocalGroup:
    """Rank 0's group on this host, with its follower processes."""

    ep: ExpertParallel
    followers: list[subprocess.Popen[bytes]]

    def close(self, timeout: float = 30.0) -> None:
        """Wait for the followers (told to stop already), killing those that do not exit."""
        deadline = time.monotonic() + timeout
        for process in self.followers:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


_FOLLOWER = "import sys; from llm_core.ep_follower import follower_main; sys.exit(follower_main(sys.argv[1:]))"


def launch_local_group(size: int, model: str | Path, device: str, dtype: str, engine_options: dict[str, Any],
                       backend: str | None = None, quantization: str = "auto") -> LocalGroup:
    """Start ranks 1..size-1 as processes on this host and join them as rank 0.
    Followers use ``cuda:RANK`` on CUDA, and this process's torch thread count
    (ranks must compute the replicated parts bit for bit alike)."""
    if size < 2:
        raise ValueError(f"an expert-parallel group needs at least 2 ranks, got {size}")
    store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=STORE_TIMEOUT, wait_for_workers=False)
    spec = json.dumps({"model": str(model), "device": device, "dtype": dtype, "quantization": quantization,
                       "engine_options": engine_options,
                       "threads": torch.get_num_threads(), "backend": backend,
                       "init_method": f"tcp://127.0.0.1:{store.port}", "size": size})
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    # Their stdout is this process's stderr: a command's stdout stays its own output.
    followers = [subprocess.Popen([sys.executable, "-c", _FOLLOWER, str(rank), spec], env=env, stdout=2)
                 for rank in range(1, size)]
    try:
        ep = expert_parallel_from_store(store, size, 0, backend, _rank_device(device, 0))
    except BaseException:
        for process in followers:
            process.kill()
        raise
    return LocalGroup(ep, followers)


def _rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else device
