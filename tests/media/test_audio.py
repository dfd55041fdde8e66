"""Tests for media.audio: decoding many containers/codecs, resampling, limits,
bad input, and Whisper log-mel features against transformers' extractor.

All media is generated here with PyAV/numpy, so the tests need no fixtures.
"""

from __future__ import annotations

import io
import struct
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from media import audio as audio_mod
from media.audio import audio_features, load_audio
from media.errors import MediaError, MediaLimits

SR = 16000


# ---------------------------------------------------------------------------
# media generators


def tone(secs: float, sr: int, freq: float = 440.0, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(round(secs * sr))) / sr
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def beeps(secs: float, sr: int) -> np.ndarray:
    """440 Hz beeps, 0.25 s on / 0.25 s off: silence gaps exercise the codecs'
    low-energy paths and the log-mel floor."""
    x = tone(secs, sr)
    x[(np.arange(x.size) // (sr // 4)) % 2 == 1] = 0.0
    return x


def encode(
    channels: np.ndarray,
    sr: int,
    fmt: str,
    codec: str,
    *,
    muxer_options: dict[str, str] | None = None,
) -> bytes:
    """Encode ``channels`` ([C, N] float32) into an in-memory ``fmt`` file."""
    layout = {1: "mono", 2: "stereo"}[channels.shape[0]]
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt, options=muxer_options or {}) as out:
        stream = out.add_stream(codec, rate=sr, layout=layout)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(channels, np.float32), format="fltp", layout=layout)
        frame.sample_rate = sr
        # Encoders want their own sample format and (aac, opus) fixed frame sizes.
        frame_size = stream.codec_context.frame_size or None
        rs = av.AudioResampler(
            format=stream.codec_context.codec.audio_formats[0].name, layout=layout, rate=sr, frame_size=frame_size
        )
        for f in rs.resample(frame) + rs.resample(None):
            for p in stream.encode(f):
                out.mux(p)
        for p in stream.encode(None):
            out.mux(p)
    return buf.getvalue()


def make_video(*, with_audio: bool, secs: float = 1.0) -> bytes:
    """A tiny MP4: 64x48 h264 video, optionally with a mono 440 Hz AAC track."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        v = out.add_stream("libx264", rate=10, options={"preset": "ultrafast"})
        v.width, v.height, v.pix_fmt = 64, 48, "yuv420p"
        a = out.add_stream("aac", rate=SR, layout="mono") if with_audio else None
        for i in range(int(secs * 10)):
            img = np.full((48, 64, 3), i * 20 % 255, np.uint8)
            for p in v.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(p)
        for p in v.encode(None):
            out.mux(p)
        if a is not None:
            frame = av.AudioFrame.from_ndarray(tone(secs, SR)[None], format="fltp", layout="mono")
            frame.sample_rate = SR
            for p in a.encode(frame) + a.encode(None):
                out.mux(p)
    return buf.getvalue()


def peak_hz(wave: torch.Tensor, sr: int = SR) -> float:
    x = wave.numpy().astype(np.float64)
    spectrum = np.abs(np.fft.rfft(x * np.hanning(x.size)))
    return float(np.fft.rfftfreq(x.size, 1.0 / sr)[np.argmax(spectrum)])


# ---------------------------------------------------------------------------
# decoding


# (container, codec, source rate, length tolerance in seconds). Lossy codecs
# add priming/padding samples, so their lengths are only approximately exact.
FORMATS = [
    ("wav", "pcm_s16le", 44100, 0.0),
    ("flac", "flac", 44100, 0.0),
    ("mp3", "libmp3lame", 44100, 0.1),
    ("mp4", "aac", 44100, 0.1),
    ("ipod", "aac", 44100, 0.1),  # .m4a
    ("ogg", "libopus", 48000, 0.1),
    ("webm", "libopus", 48000, 0.1),
]


@pytest.mark.parametrize(("fmt", "codec", "src_sr", "tol_s"), FORMATS, ids=[f"{f}-{c}" for f, c, _, _ in FORMATS])
def test_formats_stereo_to_mono_16k(fmt: str, codec: str, src_sr: int, tol_s: float) -> None:
    secs = 1.0
    x = tone(secs, src_sr)
    data = encode(np.stack([x, x]), src_sr, fmt, codec)

    wave = load_audio(data)

    assert wave.dtype == torch.float32 and wave.dim() == 1
    if tol_s == 0.0:
        assert wave.numel() == int(secs * SR)
    else:
        assert abs(wave.numel() / SR - secs) <= tol_s
    assert abs(peak_hz(wave) - 440.0) < 2.0
    assert wave.abs().max() <= 1.0
    # Identical channels downmix to the same level (mean, not 0.707 * sum).
    rms = wave[SR // 10 : -SR // 10].pow(2).mean().sqrt().item()
    assert rms == pytest.approx(0.5 / np.sqrt(2), rel=0.1)


def test_downmix_is_channel_mean() -> None:
    x = tone(0.5, 44100, amp=0.8)
    wave = load_audio(encode(np.stack([x, np.zeros_like(x)]), 44100, "wav", "pcm_s16le"))
    assert wave.numel() == SR // 2
    # Left-only 0.8 tone -> mono 0.4 tone (as `ffmpeg -ac 1` does for Whisper).
    assert wave[1000:-1000].abs().max().item() == pytest.approx(0.4, abs=0.01)


def test_other_target_rate_and_exact_samples() -> None:
    x = beeps(1.0, 44100)
    wave = load_audio(encode(x[None], 44100, "flac", "flac"), sample_rate=22050)
    assert wave.numel() == 22050
    assert abs(peak_hz(wave, 22050) - 440.0) < 2.0


def test_path_inputs(tmp_path: Path) -> None:
    data = encode(beeps(0.5, SR)[None], SR, "wav", "pcm_s16le")
    path = tmp_path / "clip.wav"
    path.write_bytes(data)
    by_str = load_audio(str(path))
    by_path = load_audio(path)
    by_bytes = load_audio(data)
    assert by_str.numel() == SR // 2
    # Mono 16 kHz s16 needs only a format conversion: exact to 16-bit precision.
    np.testing.assert_allclose(by_bytes.numpy(), beeps(0.5, SR), atol=1 / 32768 + 1e-7)
    assert torch.equal(by_str, by_path) and torch.equal(by_str, by_bytes)


def test_bytes_like_inputs() -> None:
    data = encode(tone(0.25, SR)[None], SR, "flac", "flac")
    ref = load_audio(data)
    assert torch.equal(load_audio(bytearray(data)), ref)  # type: ignore[arg-type]
    assert torch.equal(load_audio(memoryview(data)), ref)  # type: ignore[arg-type]


def test_audio_track_of_video() -> None:
    wave = load_audio(make_video(with_audio=True, secs=1.0))
    assert abs(wave.numel() / SR - 1.0) < 0.1
    assert abs(peak_hz(wave) - 440.0) < 2.0


def test_float_wav_is_clamped() -> None:
    x = np.full(SR // 4, 3.0, np.float32)
    x[::7] = -5.0
    wave = load_audio(encode(x[None], SR, "wav", "pcm_f32le"))
    assert wave.abs().max().item() == 1.0
    assert torch.isfinite(wave).all()


def test_sample_rate_change_mid_stream() -> None:
    # Two ADTS AAC streams back to back: the decoder switches from 16 kHz to
    # 44.1 kHz mid-stream, so the resampler must be rebuilt, not crash.
    first = encode(tone(1.0, 16000)[None], 16000, "adts", "aac")
    second = encode(tone(1.0, 44100)[None], 44100, "adts", "aac")
    wave = load_audio(first + second)
    assert abs(wave.numel() / SR - 2.0) < 0.2
    assert abs(peak_hz(wave[: SR - 2000]) - 440.0) < 3.0
    assert abs(peak_hz(wave[-SR + 2000 :]) - 440.0) < 3.0


def test_long_audio_stops_decoding_early(monkeypatch: pytest.MonkeyPatch) -> None:
    # WAV declares no trusted length, so only the decode loop can catch it.
    data = encode(np.zeros((1, 8000 * 60), np.float32), 8000, "wav", "pcm_s16le")
    fed: list[int] = []
    real = av.AudioResampler

    class CountingResampler:
        def __init__(self, **kwargs: object) -> None:
            self._inner = real(**kwargs)

        def resample(self, frame: av.AudioFrame | None) -> list[av.AudioFrame]:
            if frame is not None:
                fed.append(frame.samples)
            return self._inner.resample(frame)

    monkeypatch.setattr(audio_mod.av, "AudioResampler", CountingResampler)
    with pytest.raises(MediaError) as err:
        load_audio(data, limits=MediaLimits(max_audio_seconds=1.0))
    assert err.value.status == 413
    assert sum(fed) < 8000 * 2  # stopped right after 1 s of 60 s


def test_audio_at_the_limit_passes() -> None:
    data = encode(tone(2.0, SR)[None], SR, "wav", "pcm_s16le")
    assert load_audio(data, limits=MediaLimits(max_audio_seconds=2.0)).numel() == 2 * SR


# ---------------------------------------------------------------------------
# bad input


def _unknown_codec_wav() -> bytes:
    data = bytearray(encode(tone(0.2, SR)[None], SR, "wav", "pcm_s16le"))
    i = data.find(b"fmt ")
    data[i + 8 : i + 10] = struct.pack("<H", 0x1234)  # wFormatTag no decoder knows
    return bytes(data)


def _truncated(fmt: str, codec: str) -> bytes:
    data = encode(beeps(2.0, 48000)[None], 48000, fmt, codec)
    return data[: len(data) // 2]


BAD_INPUTS = {
    "zero-bytes": (lambda: b"", 400),
    "truncated-mp4": (lambda: _truncated("mp4", "aac"), 400),  # moov atom is at the end
    "truncated-flac": (lambda: _truncated("flac", "flac"), 400),
    "truncated-webm": (lambda: _truncated("webm", "libopus"), 400),  # header says 2 s
    "header-only-ogg": (lambda: encode(tone(0.5, 48000)[None], 48000, "ogg", "libopus")[:40], 400),
    "random-bytes": (lambda: np.random.default_rng(0).bytes(4096), 415),
    "text": (lambda: b"This is a text file, not audio.\n" * 40, 415),
    "video-without-audio": (lambda: make_video(with_audio=False), 415),
    "unknown-codec": (_unknown_codec_wav, 415),
    # A concat script would make FFmpeg open files named inside user data.
    "ffconcat-script": (lambda: b"ffconcat version 1.0\nfile clip.wav\n", 415),
    "too-long-decoded": (lambda: encode(tone(3.0, SR)[None], SR, "wav", "pcm_s16le"), 413),
    "too-long-declared": (lambda: encode(tone(3.0, SR)[None], SR, "flac", "flac"), 413),
    "too-large-file": (lambda: b"\0" * 4097, 413),
}
CASE_LIMITS = {
    "too-long-decoded": MediaLimits(max_audio_seconds=1.0),
    "too-long-declared": MediaLimits(max_audio_seconds=1.0),
    "too-large-file": MediaLimits(max_file_bytes=4096),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input(name: str) -> None:
    make, status = BAD_INPUTS[name]
    limits = CASE_LIMITS.get(name, MediaLimits())
    with pytest.raises(MediaError) as err:
        load_audio(make(), limits=limits)
    assert err.value.status == status, str(err.value)
    assert str(err.value)  # a message the API can show


def test_text_file_path(tmp_path: Path) -> None:
    # By path FFmpeg could pick a demuxer from the extension (.txt -> tty);
    # we open the file ourselves, so it is still "not audio".
    path = tmp_path / "notes.txt"
    path.write_text("hello, not audio\n" * 100)
    with pytest.raises(MediaError) as err:
        load_audio(path)
    assert err.value.status == 415


def test_empty_file_path(tmp_path: Path) -> None:
    path = tmp_path / "empty.mp3"
    path.write_bytes(b"")
    with pytest.raises(MediaError) as err:
        load_audio(path)
    assert err.value.status == 400


# ---------------------------------------------------------------------------
# Whisper log-mel features


def _speechlike(secs: float) -> torch.Tensor:
    """Tones, beeps, hard silence and noise: covers the 1e-10 clamp and the
    max - 8 floor, not just a flat spectrum."""
    rng = np.random.default_rng(1)
    n = int(secs * SR)
    t = np.arange(n) / SR
    x = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 1234.5 * t) * (np.sin(2 * np.pi * 0.5 * t) > 0)
    x += 0.05 * rng.standard_normal(n)
    x[SR : 2 * SR] = 0.0
    return torch.from_numpy(x.astype(np.float32))


@pytest.fixture(scope="module")
def whisper_extractor():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    cache: dict[int, object] = {}

    def get(n_mels: int):  # type: ignore[no-untyped-def]
        if n_mels not in cache:
            cache[n_mels] = transformers.WhisperFeatureExtractor(feature_size=n_mels, sampling_rate=SR)
        return cache[n_mels]

    return get


# Measured max abs diff vs the extractor: ~4e-6 (80 mels) and ~2.5e-5 (128
# mels, float32 torchaudio filterbank vs transformers' float64 one). 1e-4 is
# well below anything that changes Whisper's output.
FEATURE_ATOL = 1e-4


@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("secs", [7.3, 65.0])
def test_features_match_whisper_extractor(whisper_extractor, n_mels: int, secs: float) -> None:  # type: ignore[no-untyped-def]
    wave = _speechlike(secs)
    ours = audio_features(wave, n_mels=n_mels)

    fe = whisper_extractor(n_mels)
    pieces = [wave[i : i + 30 * SR] for i in range(0, wave.numel(), 30 * SR)]
    ref = torch.cat([fe(p.numpy(), sampling_rate=SR, return_tensors="pt").input_features for p in pieces])

    assert ours.shape == (len(pieces), n_mels, 3000) == ref.shape
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() <= FEATURE_ATOL


def test_features_from_decoded_audio(whisper_extractor) -> None:  # type: ignore[no-untyped-def]
    wave = load_audio(encode(beeps(3.0, 44100)[None], 44100, "mp3", "libmp3lame"))
    ref = whisper_extractor(80)(wave.numpy(), sampling_rate=SR, return_tensors="pt").input_features
    assert (audio_features(wave) - ref).abs().max().item() <= FEATURE_ATOL


def test_feature_chunking_boundaries() -> None:
    exact = torch.zeros(30 * SR)
    exact[::100] = 0.5
    assert audio_features(exact).shape == (1, 80, 3000)
    longer = torch.cat([exact, torch.full((1,), 0.5)])
    feats = audio_features(longer)
    assert feats.shape == (2, 80, 3000)
    # The first chunk does not see the extra sample (chunks are independent).
    assert torch.equal(feats[0], audio_features(exact)[0])
    # float64 input is accepted and computed in float32.
    assert torch.allclose(audio_features(exact.double()), audio_features(exact))


def test_feature_constants_cached_per_config() -> None:
    cpu = torch.device("cpu")
    w80, fb80 = audio_mod._mel_constants(80, SR, cpu)
    w80b, fb80b = audio_mod._mel_constants(80, SR, cpu)
    _, fb128 = audio_mod._mel_constants(128, SR, cpu)
    assert fb80 is fb80b and w80 is w80b
    assert fb80.shape == (80, 201) and fb128.shape == (128, 201)
    # Interleaving configs gives the same answers as running each alone.
    wave = _speechlike(2.0)
    a80 = audio_features(wave, n_mels=80)
    audio_features(wave, n_mels=128)
    assert torch.equal(audio_features(wave, n_mels=80), a80)


def test_filterbank_matches_transformers() -> None:
    audio_utils = pytest.importorskip("transformers.audio_utils")
    for n_mels in (80, 128):
        ref = audio_utils.mel_filter_bank(
            num_frequency_bins=201,
            num_mel_filters=n_mels,
            min_frequency=0.0,
            max_frequency=8000.0,
            sampling_rate=SR,
            norm="slaney",
            mel_scale="slaney",
        )
        ours = audio_mod._mel_constants(n_mels, SR, torch.device("cpu"))[1].T.double().numpy()
        assert ((ours > 0) == (ref > 0)).all()  # same triangles
        np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-7)  # float32 rounding only


@pytest.mark.parametrize(
    "bad",
    [torch.zeros(2, 100), torch.zeros(100, dtype=torch.int16), torch.zeros(0)],
    ids=["2-D", "int", "empty"],
)
def test_features_reject_bad_waveforms(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError):
        audio_features(bad)
