"""The parallel video decode: only the packets the sampled frames need, in
keyframe-aligned chunks, one container and decoder per thread.

Decode strategy
---------------
``scan_video`` (``media.video_probe``) demuxes every packet of the stream once,
without decoding (cheap next to decoding), recording pts and keyframe flags in
decode order.
With that packet table the chosen frame of every target is known up front: the
packet with the largest pts <= target. Each chosen packet needs a decode *run*
starting at the nearest keyframe before it in decode order (one keyframe further
back if the chosen frame is a leading picture of that keyframe, e.g. a HEVC
RASL frame of an open GOP); overlapping runs merge. Packets outside any run are
never decoded (tails of GOPs after the last sample, whole GOPs with no sample:
this is what makes sparse sampling cheap). Runs are grouped into chunks balanced
by packets to decode, ~3 chunks per thread, and every chunk is decoded in its
own thread with its own container and single-threaded codec context (PyAV
releases the GIL in demux/decode/sws_scale, so chunks really run in parallel).
For H.264/HEVC, packets that cannot be a chosen frame are fed with
``skip_frame = "NONREF"`` so the decoder drops non-reference pictures (nothing
depends on them and they are never chosen).

Each chunk *verifies* the plan: every chosen pts must come out of the decoder
and the output pts must increase. If anything disagrees (odd demuxer seeking,
decoders that drop or invent frames, ...), the whole request falls back to a
plain sequential decode, which *is* the reference semantics, so results are
always exactly those of ``decode_sequential`` (``media.video_sequential``).
"""

from __future__ import annotations

import bisect
import functools
import os
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import av
import numpy as np
import torch

from media.video_container import open_video, set_decoder_threads
from media.video_frames import VideoFrames, convert_frame, output_geometry, target_pts
from media.video_probe import PacketIndex

# Decoders that honour ``skip_frame`` per packet (checked per slice / picture),
# so it can be toggled between packets. dav1d reads it only at open, vp9 only
# distinguishes key/non-key: those are decoded in full.
_SKIP_NONREF_DECODERS = frozenset({"h264", "hevc"})
# Chunks per thread: more than one so a slow chunk (complex content, I-frame
# heavy GOPs) doesn't leave the other threads idle at the end.
_CHUNKS_PER_THREAD = 3
# Between two runs of one chunk, re-seek instead of demuxing through the gap
# when the gap is longer than this many packets (demuxing is cheap, but not free
# for large packets of high-bitrate video).
_SEEK_GAP_PACKETS = 240


@dataclass
class _Run:
    """Decode packets [start, end] (decode order) continuously, then drain."""

    start: int
    end: int
    chosen: dict[int, list[int]] = field(default_factory=dict)  # pts -> output slots

    @property
    def cost(self) -> int:
        return self.end - self.start + 1


class PlanMismatch(Exception):
    """The decoder didn't behave as the packet table predicted; use the reference."""


def _plan_runs(index: PacketIndex, tps: list[int]) -> list[_Run]:
    """Chosen packet per target -> merged decode runs (see module docstring)."""
    pts = index.pkt_pts
    order = sorted(range(len(pts)), key=pts.__getitem__)
    sorted_pts = [pts[i] for i in order]
    keys = index.key_idx
    spans: dict[int, tuple[int, int]] = {}  # chosen packet -> (run start, chosen)
    chosen_slots: dict[int, list[int]] = {}
    for slot, tp in enumerate(tps):
        j = bisect.bisect_right(sorted_pts, tp) - 1
        c = order[max(j, 0)]  # before the first frame -> the first frame
        chosen_slots.setdefault(c, []).append(slot)
        if c in spans:
            continue
        kp = bisect.bisect_right(keys, c) - 1
        # A leading picture (pts before its keyframe's) depends on the previous GOP.
        while kp >= 0 and pts[keys[kp]] > pts[c]:
            kp -= 1
        if kp < 0:
            raise PlanMismatch("chosen frame precedes every keyframe")
        spans[c] = (keys[kp], c)
    runs: list[_Run] = []
    for s, c in sorted(spans.values()):
        # Merge when overlapping or adjacent: continuing costs nothing extra.
        if runs and s <= runs[-1].end + 1:
            runs[-1].end = max(runs[-1].end, c)
        else:
            runs.append(_Run(start=s, end=c))
        runs[-1].chosen[pts[c]] = chosen_slots[c]
    return runs


def _split_chunks(runs: list[_Run], n_chunks: int) -> list[list[_Run]]:
    """Consecutive runs in n_chunks groups of about equal decode cost (packets)."""
    n_chunks = max(1, min(n_chunks, len(runs)))
    if n_chunks == 1:
        return [runs]
    prefix = [0]
    for r in runs:
        prefix.append(prefix[-1] + r.cost)
    total = prefix[-1]
    cuts = [0]
    for k in range(1, n_chunks):
        ideal = total * k / n_chunks
        i = bisect.bisect_left(prefix, ideal)
        # Closest run boundary to the ideal split, keeping every chunk non-empty.
        if i > 0 and (i >= len(prefix) or ideal - prefix[i - 1] < prefix[i] - ideal):
            i -= 1
        i = min(max(i, cuts[-1] + 1), len(runs) - (n_chunks - k))
        cuts.append(i)
    cuts.append(len(runs))
    return [runs[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]


class _Cursor:
    """Demux position over the packet table: ``goto(i)`` makes packet i (decode
    order) the next one, by reading forward or by seeking; ``next()`` returns it."""

    def __init__(
        self,
        container: av.container.InputContainer,
        stream: av.video.stream.VideoStream,
        index: PacketIndex,
        pos_of: dict[int, int],
    ) -> None:
        self.container = container
        self.stream = stream
        self.index = index
        self.pos_of = pos_of
        self.it = container.demux(stream)
        self.pending: av.Packet | None = None
        self.next_pos = 0  # decode-order index the next read would return (hint)
        self.fresh = True  # nothing read yet: the demuxer is at the file start

    def _read(self) -> tuple[av.Packet, int] | None:
        if self.pending is not None:
            p, self.pending = self.pending, None
        else:
            p = None
            for q in self.it:
                if q.size:
                    p = q
                    break
            if p is None:
                return None
        i = self.pos_of.get(p.pts) if p.pts is not None else None
        if i is None:
            raise PlanMismatch("demuxed a packet that the scan did not see")
        return p, i

    def _seek(self, i: int) -> None:
        pts, dts = self.index.pkt_pts[i], self.index.pkt_dts[i]
        # MP4 seeks on dts, Matroska/TS on pts; dts <= pts, so seeking to the
        # smaller can only land early (read forward), not late.
        target = pts if dts is None else min(pts, dts)
        self.container.seek(target, stream=self.stream, backward=True, any_frame=False)
        self.it = self.container.demux(self.stream)
        self.pending = None

    def goto(self, i: int) -> None:
        fresh, self.fresh = self.fresh, False
        if fresh and i == 0:
            pass  # already at the start
        elif fresh or i < self.next_pos or i - self.next_pos > _SEEK_GAP_PACKETS:
            keys = self.index.key_idx
            kp = bisect.bisect_left(keys, i)  # i is a keyframe index
            for attempt in range(3):
                self._seek(keys[max(kp - attempt, 0)])
                got = self._read()
                if got is None:
                    raise PlanMismatch("seek ran past the end")
                if got[1] <= i:
                    self.pending = got[0]
                    break
            else:
                raise PlanMismatch("seek keeps landing after the target")
        while True:  # read forward to packet i
            got = self._read()
            if got is None:
                raise PlanMismatch("stream ended before a planned packet")
            p, j = got
            if j == i:
                self.pending = p
                self.next_pos = i
                return
            if j > i:
                raise PlanMismatch("demuxer skipped a planned packet")

    def next(self) -> tuple[av.Packet, int] | None:
        got = self._read()
        if got is not None:
            self.next_pos = got[1] + 1
        return got


def _decode_chunk(
    path: str | os.PathLike[str],
    index: PacketIndex,
    runs: list[_Run],
    pos_of: dict[int, int],
    out: np.ndarray,
    conv: tuple[int, int],
    dec_threads: int,
    skip_nonref: bool,
    cancel: threading.Event,
) -> int:
    """Decode one chunk's runs into ``out``; returns packets fed to the decoder."""
    container = open_video(path)
    fed = 0
    try:
        stream = container.streams[index.stream_index]
        cc = stream.codec_context
        set_decoder_threads(cc, dec_threads)
        cursor = _Cursor(container, stream, index, pos_of)
        conv_w, conv_h = conv
        pts_tab = index.pkt_pts
        for run in runs:
            if cancel.is_set():
                return fed
            cursor.goto(run.start)
            start_pts = pts_tab[run.start]
            remaining = set(run.chosen)
            last = start_pts - 1
            skipping = False

            def handle(frames: list[av.VideoFrame]) -> None:
                nonlocal last
                for f in frames:
                    fp = f.pts
                    if fp is None:
                        raise PlanMismatch("decoder produced a frame without pts")
                    if fp < start_pts:
                        continue  # leading picture of the run's keyframe: not ours
                    if fp <= last:
                        raise PlanMismatch("decoder output pts not increasing")
                    last = fp
                    if fp in remaining:
                        arr = convert_frame(f, conv_w, conv_h, index.rot_k)
                        for slot in run.chosen[fp]:
                            out[slot] = arr
                        remaining.discard(fp)

            for _ in range(run.cost):
                got = cursor.next()
                if got is None:
                    raise PlanMismatch("stream ended inside a run")
                p, _j = got
                if skip_nonref:
                    # A packet that isn't a chosen frame is never output to the
                    # user; if it's also non-reference nothing needs it at all.
                    want_skip = p.pts not in run.chosen
                    if want_skip != skipping:
                        cc.skip_frame = "NONREF" if want_skip else "DEFAULT"
                        skipping = want_skip
                handle(cc.decode(p))
                fed += 1
            if skipping:
                cc.skip_frame = "DEFAULT"
            handle(cc.decode(None))  # drain: the run's last frames are buffered
            cc.flush_buffers()  # resets the drained decoder for the next run
            if remaining:
                raise PlanMismatch(f"{len(remaining)} planned frames were not output")
        return fed
    finally:
        container.close()


def decode_chunked(
    path: str | os.PathLike[str],
    index: PacketIndex,
    timestamps: list[float],
    threads: int,
    size: tuple[int, int] | None,
    skip_nonref: bool | None = None,
) -> VideoFrames:
    tps = [target_pts(t, index.time_base, index.start_pts) for t in timestamps]
    runs = _plan_runs(index, tps)
    n_chunks = 1 if threads == 1 else threads * _CHUNKS_PER_THREAD
    chunks = _split_chunks(runs, n_chunks)
    # Too few chunks to keep every thread busy (e.g. one long GOP): give each
    # chunk's decoder FFmpeg threads instead. Output is identical either way.
    dec_threads = max(1, threads // len(chunks))
    if skip_nonref is None:
        skip_nonref = index.decoder in _SKIP_NONREF_DECODERS
    out_h, out_w, conv_w, conv_h = output_geometry(
        index.frame_width, index.frame_height, index.rot_k, size
    )
    out = np.empty((len(timestamps), out_h, out_w, 3), dtype=np.uint8)
    pos_of = {p: i for i, p in enumerate(index.pkt_pts)}
    cancel = threading.Event()
    run_chunk = functools.partial(
        _decode_chunk, path, index, pos_of=pos_of, out=out, conv=(conv_w, conv_h),
        dec_threads=dec_threads, skip_nonref=skip_nonref, cancel=cancel,
    )
    if len(chunks) == 1:
        run_chunk(chunks[0])
    else:
        with ThreadPoolExecutor(max_workers=min(threads, len(chunks))) as pool:
            futs = [pool.submit(run_chunk, ch) for ch in chunks]
            wait(futs, return_when=FIRST_EXCEPTION)
            errors = [f.exception() for f in futs if f.done() and f.exception() is not None]
            if errors:
                cancel.set()  # stop the other chunks at their next run
                wait(futs)
                # A MediaError/FFmpeg error (bad data) beats a plan mismatch:
                # the reference decode would hit the same bad data.
                for e in errors:
                    if not isinstance(e, PlanMismatch):
                        raise e
                raise errors[0]
    return VideoFrames(
        frames=torch.from_numpy(out),
        timestamps=torch.tensor(timestamps, dtype=torch.float64),
    )
