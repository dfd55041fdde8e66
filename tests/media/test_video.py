"""media.video and the media.video_* modules under it: chunked parallel decode ==
sequential reference, sampling plan, formats without index / timestamps,
rotation, and the bad-input table.

Every video here is generated with PyAV: tiny (96x64), a few seconds, with the
frame index drawn as 8 black/white bars so each decoded frame is identifiable.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from media.errors import MediaError, MediaLimits
from media.video import load_video
from media.video_probe import plan_sampling, probe_video
from media.video_probe import VideoInfo
from media.video_sequential import decode_sequential

W, H = 96, 64
BAR = W // 8  # one bar per bit of the frame counter


# ------------------------------------------------------------------ generation


def _frame_rgb(i: int) -> np.ndarray:
    a = np.zeros((H, W, 3), np.uint8)
    for b in range(8):  # top half: counter bits, MSB first
        if (i >> (7 - b)) & 1:
            a[: H // 2, b * BAR : (b + 1) * BAR] = 255
    # Bottom half: moving gradient + box, so encoders make real P/B frames.
    xs = np.arange(W)[None, :]
    a[H // 2 :, :, 1] = ((xs * 3 + i * 5) % 256).astype(np.uint8)
    x0 = (i * 3) % (W - 16)
    a[H // 2 + 4 : H // 2 + 20, x0 : x0 + 16, 2] = 200
    return a


def _read_counter(frame: np.ndarray) -> int:
    bits = [frame[4 : H // 2 - 4, b * BAR + 3 : (b + 1) * BAR - 3].mean() > 128 for b in range(8)]
    return int(sum(int(x) << (7 - k) for k, x in enumerate(bits)))


def _has_encoder(name: str) -> bool:
    return name in av.codecs_available


def write_video(
    path: Path,
    *,
    codec: str = "libx264",
    rate: int = 30,
    n: int = 90,
    pts: Sequence[int] | None = None,
    time_base: Fraction | None = None,
    fmt: str | None = None,
    container_options: dict[str, str] | None = None,
    options: dict[str, str] | None = None,
    audio: bool = False,
) -> Path:
    if not _has_encoder(codec):
        pytest.skip(f"encoder {codec} not available in this PyAV build")
    with av.open(str(path), "w", format=fmt, options=container_options or {}) as c:
        s = c.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = W, H, "yuv420p"
        if time_base is not None:  # VFR: explicit pts in this time base
            s.codec_context.time_base = time_base
            s.time_base = time_base
        # Short GOPs so a few-second clip has many chunks; x264 keeps B-frames.
        s.options = {"g": "12", **(options or {})}
        a = c.add_stream("aac", rate=16000) if audio else None
        for i in range(n):
            f = av.VideoFrame.from_ndarray(_frame_rgb(i), format="rgb24")
            f.pts = i if pts is None else pts[i]
            if time_base is not None:
                f.time_base = time_base
            for p in s.encode(f):
                c.mux(p)
            if a is not None and i % 2 == 0:  # interleaved 1024-sample audio frames
                af = av.AudioFrame.from_ndarray(
                    np.zeros((1, 1024), np.float32), format="fltp", layout="mono"
                )
                af.sample_rate, af.pts = 16000, (i // 2) * 1024
                for p in a.encode(af):
                    c.mux(p)
        for p in s.encode():
            c.mux(p)
        if a is not None:
            for p in a.encode():
                c.mux(p)
    return path


def remux(src: Path, dst: Path, rotation: float | None = None) -> Path:
    """Copy the packets into a new file (optionally with a display rotation):
    the same bitstream, so decoded pixels must be identical. (x264 with threads
    isn't bit-reproducible between two encodes, so re-encoding can't be used.)"""
    with av.open(str(src)) as i, av.open(str(dst), "w") as o:
        ist = i.streams.video[0]
        ost = o.add_stream_from_template(ist)
        if rotation is not None:
            ost.set_display_rotation(rotation)
        for p in i.demux(ist):
            if p.size:
                p.stream = ost
                o.mux(p)
    return dst


def _expected_counters(path: Path, timestamps: Sequence[float]) -> list[int]:
    """Independent statement of the semantics: the last frame with pts <= t
    (t in stream ticks from start_time), or the first frame."""
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        tb, start = s.time_base, s.start_time
        frames = [(f.pts, _read_counter(f.to_ndarray(format="rgb24"))) for f in c.decode(s)]
    out = []
    for t in timestamps:
        tp = start + math.floor(Fraction(t) / tb)
        cands = [cnt for p, cnt in frames if p <= tp]
        out.append(cands[-1] if cands else frames[0][1])
    return out


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype == torch.uint8
    assert torch.equal(a, b)


@pytest.fixture
def no_fallback(caplog: pytest.LogCaptureFixture):
    """Asserts the chunked path really ran (no silent sequential fallback)."""
    caplog.set_level(logging.WARNING, logger="media.video")
    yield
    assert not [r for r in caplog.records if "fell back" in r.getMessage()]


def _check_chunked(path: Path, fps: float, counters: bool = True) -> None:
    info = probe_video(path)
    ts = plan_sampling(info, fps=fps)
    ref = decode_sequential(path, ts, threads=1)
    for threads in (1, 4):
        got = load_video(path, fps=fps, threads=threads)
        assert got.timestamps.dtype == torch.float64
        assert got.timestamps.tolist() == ts
        _assert_same(got.frames, ref.frames)
    if counters:
        read = [_read_counter(f) for f in ref.frames.numpy()]
        assert read == _expected_counters(path, ts)


# ----------------------------------------------------------- chunked == sequential


@pytest.mark.parametrize("rate", [24, 25, 30, 60])
def test_h264_chunked_matches_sequential(tmp_path: Path, rate: int, no_fallback: None) -> None:
    path = write_video(tmp_path / f"v{rate}.mp4", rate=rate, n=rate * 4)
    for fps in (2.0, 0.5, 7.3):  # 7.3: targets land at odd places inside GOPs
        _check_chunked(path, fps)
    info = probe_video(path)
    assert info.codec == "h264" and info.frame_count == rate * 4
    assert info.duration == pytest.approx(4.0, abs=1e-6)
    assert info.fps == pytest.approx(rate)
    assert (info.width, info.height, info.rotation) == (W, H, 0)
    keys = list(info.keyframe_times)
    assert keys[0] == 0.0 and keys == sorted(keys)
    assert len(keys) >= 4 and info.seekable


@pytest.mark.parametrize(
    "codec,suffix,options",
    [
        ("libx265", "mp4", {"x265-params": "keyint=15:log-level=error"}),  # open GOP (CRA)
        ("libvpx-vp9", "webm", {"deadline": "realtime", "cpu-used": "8"}),
        ("libsvtav1", "mkv", {"preset": "12", "svtav1-params": "keyint=15"}),
    ],
)
def test_other_codecs_chunked_matches_sequential(
    tmp_path: Path, codec: str, suffix: str, options: dict[str, str], no_fallback: None
) -> None:
    path = write_video(tmp_path / f"c.{suffix}", codec=codec, n=75, options=options)
    # 30.0 = every frame, including HEVC's leading (RASL) pictures around CRAs.
    for fps in (2.0, 0.5, 9.0, 30.0):
        _check_chunked(path, fps)


def test_hevc_leading_pictures_alone(tmp_path: Path, no_fallback: None) -> None:
    """Targets that pick only open-GOP leading pictures (RASL: decoded after
    their CRA but shown before it): their run must start one GOP earlier."""
    from media.errors import DEFAULT_LIMITS
    from media.video_chunked import decode_chunked
    from media.video_probe import scan_video

    path = write_video(
        tmp_path / "open.mp4", codec="libx265", n=75,
        options={"x265-params": "keyint=15:log-level=error"},
    )
    idx = scan_video(path, DEFAULT_LIMITS)
    pts, keys = idx.pkt_pts, idx.key_idx
    leading = [
        i for i in range(len(pts))
        if any(k < i and pts[i] < pts[k] for k in keys)
    ]
    if not leading:
        pytest.skip("encoder made no leading pictures")
    ts = [float((pts[i] - idx.start_pts) * idx.time_base) for i in leading]
    ts += ts[-1:] * (len(ts) % 2)
    ref = decode_sequential(path, ts)
    for threads in (1, 4):
        _assert_same(decode_chunked(path, idx, ts, threads, None).frames, ref.frames)
    assert [_read_counter(f) for f in ref.frames.numpy()] == _expected_counters(path, ts)


def test_vfr_irregular_pts(tmp_path: Path, no_fallback: None) -> None:
    rng = np.random.default_rng(7)
    pts = np.concatenate([[0], np.cumsum(rng.integers(8, 90, 99))]).tolist()
    for suffix in ("mp4", "mkv"):
        path = write_video(tmp_path / f"vfr.{suffix}", n=100, pts=pts, time_base=Fraction(1, 1000))
        info = probe_video(path)
        assert info.frame_count == 100
        assert info.duration == pytest.approx(pts[-1] / 1000, abs=0.1)
        for fps in (2.0, 0.5, 11.0):
            _check_chunked(path, fps)


def test_matroska_without_cues(tmp_path: Path, no_fallback: None) -> None:
    # live=1: the muxer writes no Cues (no seek index), like a streamed recording.
    path = write_video(tmp_path / "nocues.mkv", n=120, container_options={"live": "1"})
    for fps in (2.0, 0.5):
        _check_chunked(path, fps)


def test_mpegts(tmp_path: Path, no_fallback: None) -> None:
    path = write_video(tmp_path / "v.ts", n=120)  # no index, starts at pts != 0
    for fps in (2.0, 0.5):
        _check_chunked(path, fps)


def test_raw_h264_annexb_without_timestamps(tmp_path: Path) -> None:
    path = write_video(tmp_path / "v.h264", fmt="h264", n=90, rate=30)
    info = probe_video(path)
    assert not info.seekable and info.frame_count == 90
    assert info.duration == pytest.approx(3.0, abs=0.05)
    for fps in (2.0, 0.5):
        ts = plan_sampling(info, fps=fps)
        got = load_video(path, fps=fps, threads=2)
        _assert_same(got.frames, decode_sequential(path, ts).frames)
        # Synthetic pts: frame i at i / 30 s.
        want = [min(89, math.floor(t * 30 + 1e-9)) for t in ts]
        assert [_read_counter(f) for f in got.frames.numpy()] == want


@pytest.mark.parametrize("suffix", ["mp4", "mkv"])
def test_with_audio_track(tmp_path: Path, suffix: str, no_fallback: None) -> None:
    path = write_video(tmp_path / f"av.{suffix}", n=120, audio=True)
    with av.open(str(path)) as c:
        assert len(c.streams.audio) == 1
    for fps in (2.0, 0.5):
        _check_chunked(path, fps)


@pytest.mark.parametrize("suffix", ["mp4", "mkv", "ts"])
def test_reseek_between_runs(
    tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch, no_fallback: None
) -> None:
    """Force a seek for every gap between runs (normally only long gaps seek)."""
    import media.video_chunked as video_chunked

    monkeypatch.setattr(video_chunked, "_SEEK_GAP_PACKETS", 0)
    path = write_video(tmp_path / f"r.{suffix}", n=150)
    for fps in (0.5, 3.0):
        ts = plan_sampling(probe_video(path), fps=fps)
        ref = decode_sequential(path, ts)
        for threads in (1, 2):
            _assert_same(load_video(path, fps=fps, threads=threads).frames, ref.frames)


def test_threads_and_size(tmp_path: Path, no_fallback: None) -> None:
    path = write_video(tmp_path / "s.mp4", n=150)
    ts = plan_sampling(probe_video(path), fps=4.0)
    ref = decode_sequential(path, ts, size=(32, 48))
    a = load_video(path, fps=4.0, threads=1, size=(32, 48))
    b = load_video(path, fps=4.0, threads=4, size=(32, 48))
    assert a.frames.shape == (len(ts), 32, 48, 3)
    _assert_same(a.frames, ref.frames)
    _assert_same(b.frames, ref.frames)
    # FFmpeg frame threading in the reference gives the same pixels too.
    _assert_same(decode_sequential(path, ts, threads=0, size=(32, 48)).frames, ref.frames)


@pytest.mark.parametrize("rotation,k", [(90, 1), (-90, 3), (180, 2)])
def test_rotation_metadata(tmp_path: Path, rotation: int, k: int, no_fallback: None) -> None:
    plain = write_video(tmp_path / "plain.mp4", n=60)
    rot = remux(plain, tmp_path / "rot.mp4", rotation=rotation)
    info = probe_video(rot)
    assert info.rotation == k * 90
    assert (info.width, info.height) == ((H, W) if k % 2 else (W, H))
    a = load_video(plain, fps=2.0)
    b = load_video(rot, fps=2.0)
    # Same bitstream; the display matrix only says how to turn it upright.
    _assert_same(b.frames, torch.rot90(a.frames, k, dims=(1, 2)).contiguous())
    ts = plan_sampling(info, fps=2.0)
    _assert_same(decode_sequential(rot, ts).frames, b.frames)
    # size is the upright size.
    c = load_video(rot, fps=2.0, size=(40, 30))
    assert c.frames.shape[1:] == (40, 30, 3)


# ------------------------------------------------------------------------- plan


def _info(duration: float) -> VideoInfo:
    return VideoInfo(
        duration=duration, fps=30.0, frame_count=int(duration * 30), width=W, height=H,
        codec="h264", rotation=0, keyframe_times=(0.0,), seekable=True, container="mp4",
    )


def test_plan_even_centred_and_capped() -> None:
    assert plan_sampling(_info(5.0), fps=2.0) == [0.25 + 0.5 * i for i in range(10)]
    # 5.3 s at 1 fps: centres 0.5 .. 4.5 -> 5 targets, odd -> last repeated.
    ts = plan_sampling(_info(5.3), fps=1.0)
    assert ts == [0.5, 1.5, 2.5, 3.5, 4.5, 4.5]
    # Tiny clip: still an even count (>= 2), targets inside the clip.
    assert plan_sampling(_info(0.1), fps=2.0) == [0.05, 0.05]
    # Cap: spread evenly over the whole duration, rounded down to even.
    ts = plan_sampling(_info(100.0), fps=2.0, max_frames=9)
    assert len(ts) == 8 and ts == pytest.approx([(i + 0.5) * 12.5 for i in range(8)])
    lim = MediaLimits(max_video_frames=6)
    assert len(plan_sampling(_info(100.0), fps=2.0, limits=lim)) == 6
    assert len(plan_sampling(_info(100.0), fps=2.0, max_frames=100, limits=lim)) == 6
    for d, fps in [(1.0, 30.0), (7.7, 0.5), (61.0, 2.0), (3.0, 0.1)]:
        ts = plan_sampling(_info(d), fps=fps)
        assert len(ts) % 2 == 0 and ts == sorted(ts) and all(0 <= t < d for t in ts)


def test_plan_rejects() -> None:
    with pytest.raises(MediaError) as e:
        plan_sampling(_info(10.0), fps=0.0)
    assert e.value.status == 400
    with pytest.raises(MediaError) as e:
        plan_sampling(_info(10.0), fps=2.0, max_frames=1)
    assert e.value.status == 400
    with pytest.raises(MediaError) as e:
        plan_sampling(_info(10.0), limits=MediaLimits(max_video_seconds=5.0))
    assert e.value.status == 413


def test_load_video_even_and_max_frames(tmp_path: Path, no_fallback: None) -> None:
    path = write_video(tmp_path / "m.mp4", n=105)  # 3.5 s: 7 targets at 2 fps -> 8
    got = load_video(path, fps=2.0)
    assert got.frames.shape[0] == 8 and torch.equal(got.frames[-1], got.frames[-2])
    assert got.timestamps[-1] == got.timestamps[-2]
    capped = load_video(path, fps=30.0, max_frames=5)
    assert capped.frames.shape[0] == 4
    ts = capped.timestamps.tolist()
    _assert_same(capped.frames, decode_sequential(path, ts).frames)


# -------------------------------------------------------------------- bad input


def _status(path: Path, limits: MediaLimits | None = None) -> int:
    kw = {"limits": limits} if limits is not None else {}
    with pytest.raises(MediaError) as e1:
        probe_video(path, **kw)
    with pytest.raises(MediaError) as e2:
        load_video(path, **kw)
    assert e1.value.status == e2.value.status
    assert str(e2.value)  # a message for the API user
    return e2.value.status


def test_bad_inputs(tmp_path: Path) -> None:
    good = write_video(tmp_path / "good.mp4", n=90)
    data = good.read_bytes()
    rng = np.random.default_rng(0)
    cases: dict[str, tuple[Path, int, MediaLimits | None]] = {}

    def case(name: str, content: bytes, status: int, limits: MediaLimits | None = None) -> None:
        p = tmp_path / name
        p.write_bytes(content)
        cases[name] = (p, status, limits)

    case("empty.mp4", b"", 400)
    case("truncated.mp4", data[: len(data) // 2], 400)  # moov (at the end) lost
    case("random.bin", rng.integers(0, 256, 20000, dtype=np.uint8).tobytes(), 415)
    case("notes.txt", b"Great video, see attached!\n" * 200, 415)
    faststart = write_video(tmp_path / "fs.mp4", n=90, container_options={"movflags": "faststart"})
    case("truncated_faststart.mp4", faststart.read_bytes()[: faststart.stat().st_size // 2], 400)
    mkv = write_video(tmp_path / "full.mkv", n=90)
    case("truncated.mkv", mkv.read_bytes()[: mkv.stat().st_size // 2], 400)
    avi = write_video(tmp_path / "full.avi", codec="mpeg4", n=30).read_bytes()
    # The container header survives, the noise after it holds no stream: corrupt, not "not a video".
    case("noise_after_header.avi", avi[:16] + rng.integers(0, 256, len(avi) - 16, dtype=np.uint8).tobytes(), 400)
    cases["too_long"] = (good, 413, MediaLimits(max_video_seconds=1.0))
    cases["too_big"] = (good, 413, MediaLimits(max_file_bytes=100))

    audio = tmp_path / "audio.wav"  # audio only: no video stream
    with av.open(str(audio), "w") as c:
        s = c.add_stream("pcm_s16le", rate=8000)
        f = av.AudioFrame.from_ndarray(np.zeros((1, 8000), np.int16), format="s16", layout="mono")
        f.sample_rate, f.pts = 8000, 0
        for p in s.encode(f):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    cases["audio.wav"] = (audio, 415, None)

    image = tmp_path / "still.png"
    with av.open(str(image), "w", format="image2") as c:
        s = c.add_stream("png", rate=1)
        s.width, s.height, s.pix_fmt = W, H, "rgb24"
        for p in s.encode(av.VideoFrame.from_ndarray(_frame_rgb(3), format="rgb24")):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    cases["still.png"] = (image, 415, None)

    got = {name: _status(p, lim) for name, (p, _, lim) in cases.items()}
    assert got == {name: st for name, (_, st, _) in cases.items()}
    with pytest.raises(MediaError) as e:
        load_video(tmp_path / "missing.mp4")
    assert e.value.status == 400
