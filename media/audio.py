"""Audio decoding (any container/codec FFmpeg reads) and Whisper log-mel features.

``load_audio`` turns user bytes or a local file into a mono float32 waveform;
``audio_features`` turns that waveform into Whisper's ``[chunks, n_mels, 3000]``
log-mel input. Every problem the user can cause surfaces as ``MediaError``.
"""

from __future__ import annotations

import functools
import math
import os
from typing import BinaryIO

import av
import av.error
import numpy as np
import torch
import torchaudio.functional as taF

from media.audio_source import OPEN_OPTIONS, open_audio_source
from media.errors import DEFAULT_LIMITS, MediaError, MediaLimits

__all__ = ["audio_features", "load_audio"]

# Whisper's front end, fixed by the pretrained models (not tunable knobs).
N_FFT = 400
HOP_LENGTH = 160

# Container formats whose demuxer reads the stream length from a header (or an
# index) instead of guessing it from the bit rate. Only for these is "decoded
# far less than declared" evidence of truncation: ADTS AAC or MP3 without a
# Xing header get bitrate estimates that can be off by 20x on a valid file, and
# WAV/Ogg derive the length from whatever bytes are present.
_HEADER_DURATION_FORMATS = frozenset({"flac", "mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm"})

# Magic bytes of containers we expect users to send. Used only after FFmpeg
# failed to open the input, to tell "a damaged media file" (400) from
# "not media at all" (415).
_MEDIA_SIGNATURES: tuple[tuple[int, bytes, str], ...] = (
    (0, b"RIFF", "WAV/RIFF"),
    (0, b"fLaC", "FLAC"),
    (0, b"OggS", "Ogg"),
    (0, b"ID3", "MP3"),
    (0, b"\x1a\x45\xdf\xa3", "Matroska/WebM"),
    (4, b"ftyp", "MP4"),
    (0, b"FORM", "AIFF"),
    (0, b"#!AMR", "AMR"),
    (0, b"caff", "CAF"),
)

# swresample normalises its downmix matrix only when asked to keep samples in
# [-1, 1]; by default float output sums stereo as 0.707 * (L + R). With
# maxval 1 it gives (L + R) / 2, the same level as `ffmpeg -ac 1` to s16 that
# Whisper's own loader uses, and loud in-phase stereo cannot clip.
_RESAMPLER_OPTIONS = {"rematrix_maxval": "1.0"}


def load_audio(
    source: str | os.PathLike[str] | bytes,
    *,
    sample_rate: int = 16000,
    limits: MediaLimits = DEFAULT_LIMITS,
) -> torch.Tensor:
    """Decode the first audio stream of ``source`` to mono float32 at ``sample_rate``.

    ``source`` is the file's bytes or a local path (never a URL: a path is
    opened by Python, so FFmpeg protocols such as ``http:`` are not reachable).
    Video files work too; only their audio track is decoded.

    Returns a 1-D float32 tensor with values in [-1, 1].

    Raises ``MediaError``: 400 empty, corrupt or truncated input; 413 file
    larger than ``limits.max_file_bytes`` or audio longer than
    ``limits.max_audio_seconds`` (detected while decoding, without decoding the
    rest); 415 not a media file, no audio stream, or an audio codec this build
    cannot decode. A missing local path raises the usual ``OSError``: paths
    come from the server, not the user.
    """
    if not isinstance(sample_rate, int) or sample_rate <= 0:
        raise ValueError(f"sample_rate must be a positive int, got {sample_rate!r}")

    fileobj = open_audio_source(source, limits)
    with fileobj:
        head = fileobj.read(16)
        fileobj.seek(0)
        container = _open_container(fileobj, head)
        with container:
            return _decode_first_audio_stream(container, sample_rate, limits)


def _open_container(fileobj: BinaryIO, head: bytes) -> av.container.InputContainer:
    try:
        return av.open(fileobj, mode="r", container_options=OPEN_OPTIONS)
    except av.error.EOFError:
        # The header itself is cut off: the format was recognised, data ran out.
        raise MediaError("The audio file is truncated.", status=400) from None
    except av.error.InvalidDataError:
        kind = _sniff_media_kind(head)
        if kind is not None:
            raise MediaError(f"The {kind} file is corrupt or truncated.", status=400) from None
        raise MediaError(
            "Unsupported or unrecognized file format; expected an audio file "
            "(e.g. WAV, MP3, FLAC, M4A/AAC, Ogg/Opus, WebM) or a video with an audio track.",
            status=415,
        ) from None
    except av.error.FFmpegError:
        # E.g. a demuxer that wanted to open another resource (blocked by the
        # protocol whitelist): a format we deliberately don't serve.
        raise MediaError("Unsupported media file.", status=415) from None


def _sniff_media_kind(head: bytes) -> str | None:
    for offset, magic, kind in _MEDIA_SIGNATURES:
        if head[offset : offset + len(magic)] == magic:
            return kind
    # MPEG audio / ADTS frame sync: 11 set bits.
    if len(head) >= 2 and head[0] == 0xFF and (head[1] & 0xE0) == 0xE0:
        return "MP3/AAC"
    return None


def _decode_first_audio_stream(
    container: av.container.InputContainer, sample_rate: int, limits: MediaLimits
) -> torch.Tensor:
    if not container.streams.audio:
        what = "video file has no audio track" if container.streams.video else "file has no audio stream"
        raise MediaError(f"The {what}.", status=415)
    stream = container.streams.audio[0]
    if stream.codec_context is None:
        # FFmpeg parsed the container but has no decoder for this codec.
        raise MediaError("The audio codec of this file is not supported.", status=415)

    declared_s = _declared_seconds(container, stream)
    if declared_s is not None and declared_s > limits.max_audio_seconds + 1.0:
        # Cheap early reject for formats whose header length we trust; the
        # decode loop below enforces the limit for everything else.
        raise _too_long(limits)

    # Output samples allowed; ceil so audio exactly at the limit passes.
    max_samples = math.ceil(limits.max_audio_seconds * sample_rate)
    pieces: list[np.ndarray] = []
    total = 0
    decoded_s = 0.0  # input-side seconds, for the truncation check
    resampler: av.AudioResampler | None = None
    resampler_key: tuple[str, str, int] | None = None

    def take(frames: list[av.AudioFrame]) -> None:
        nonlocal total
        for out in frames:
            samples = out.to_ndarray().reshape(-1)  # flt mono: (1, n) -> (n,)
            pieces.append(samples)
            total += samples.shape[0]
        if total > max_samples:
            raise _too_long(limits)

    try:
        for packet in container.demux(stream):
            for frame in packet.decode():
                decoded_s += frame.samples / frame.sample_rate
                key = (frame.format.name, frame.layout.name, frame.sample_rate)
                if key != resampler_key:
                    # Streams may change rate/layout mid-way (ADTS, MP3
                    # concatenations); a resampler graph is fixed to its first
                    # frame's parameters, so drain it and start a new one.
                    if resampler is not None:
                        take(resampler.resample(None))
                    resampler = av.AudioResampler(
                        format="flt", layout="mono", rate=sample_rate, options=_RESAMPLER_OPTIONS
                    )
                    resampler_key = key
                # Timestamps play no part in the output; dropping them keeps
                # the filter graph from reacting to gaps or jumps in them.
                frame.pts = None
                take(resampler.resample(frame))
        if resampler is not None:
            take(resampler.resample(None))  # flush the resampler's delay line
    except MediaError:
        raise
    except (av.error.FFmpegError, ValueError) as e:
        # Bad packets, decoder errors or frames the filter graph rejects. We
        # fail rather than return the part decoded so far.
        raise MediaError(f"The audio data is corrupt and could not be decoded ({_reason(e)}).", status=400) from None

    if total == 0:
        raise MediaError("The file's audio stream contains no samples.", status=400)
    if declared_s is not None and declared_s - decoded_s > max(0.5, 0.05 * declared_s):
        raise MediaError(
            f"The audio file is truncated (decoded {decoded_s:.1f} s of {declared_s:.1f} s).", status=400
        )

    waveform = np.concatenate(pieces) if len(pieces) > 1 else pieces[0].copy()
    # Float sources (pcm_f32 WAV, decoder overshoot, resampler ringing) can
    # leave [-1, 1] or carry NaN/inf; the contract is finite values in range.
    np.nan_to_num(waveform, copy=False, nan=0.0, posinf=1.0, neginf=-1.0)
    np.clip(waveform, -1.0, 1.0, out=waveform)
    return torch.from_numpy(waveform)


def _declared_seconds(container: av.container.InputContainer, stream: av.AudioStream) -> float | None:
    """The audio length the file's header states, or None when unknown or only
    estimated (see ``_HEADER_DURATION_FORMATS``)."""
    if container.format.name not in _HEADER_DURATION_FORMATS:
        return None
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    # Matroska stores one duration for the whole segment; it is the audio's
    # only if there is nothing else in the file (a video track may be longer).
    if len(container.streams) == 1 and container.duration is not None:
        return container.duration / av.time_base
    return None


def _too_long(limits: MediaLimits) -> MediaError:
    return MediaError(f"The audio is longer than the limit of {limits.max_audio_seconds:g} seconds.", status=413)


def _reason(e: Exception) -> str:
    # FFmpegError carries a readable strerror; fall back to the exception text.
    return getattr(e, "strerror", None) or str(e)


# ---------------------------------------------------------------------------
# Whisper log-mel features


@functools.lru_cache(maxsize=16)
def _mel_constants(n_mels: int, sample_rate: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Hann window and transposed mel filterbank ``[n_mels, n_fft // 2 + 1]``.

    Keyed by every argument, so configurations never share state; the tensors
    are never written to after creation.
    """
    window = torch.hann_window(N_FFT, periodic=True, dtype=torch.float32, device=device)
    # Slaney scale + Slaney (area) norm from 0 Hz to Nyquist: librosa's
    # `filters.mel` defaults, which Whisper and transformers'
    # WhisperFeatureExtractor (max_frequency=8000 at 16 kHz) use.
    fbank = taF.melscale_fbanks(
        n_freqs=N_FFT // 2 + 1,
        f_min=0.0,
        f_max=sample_rate / 2,
        n_mels=n_mels,
        sample_rate=sample_rate,
        norm="slaney",
        mel_scale="slaney",
    )
    return window, fbank.T.contiguous().to(device=device, dtype=torch.float32)


# Chunks per STFT call: bounds the complex intermediate (~5 MB per chunk)
# for hour-long inputs while keeping the batching benefit.
_CHUNKS_PER_BATCH = 16


def audio_features(
    waveform: torch.Tensor,
    *,
    sample_rate: int = 16000,
    n_mels: int = 80,
    chunk_seconds: float = 30.0,
) -> torch.Tensor:
    """Whisper log-mel spectrogram of a mono waveform, one row per 30 s chunk.

    The audio is cut into ``chunk_seconds`` chunks, the last zero-padded to
    full length (Whisper pads every input to 30 s), and each chunk gets the
    Whisper recipe on its own: STFT (n_fft 400, hop 160, periodic Hann,
    reflect-padded centre frames), power spectrum without the last frame,
    Slaney mel filterbank, ``log10(clamp(x, 1e-10))``, floor at the chunk's
    max - 8, then ``(x + 4) / 4``. This equals transformers'
    ``WhisperFeatureExtractor`` applied to each chunk.

    Returns float32 ``[num_chunks, n_mels, chunk_samples // 160]`` (3000
    frames for 30 s at 16 kHz) on ``waveform``'s device.
    """
    if waveform.dim() != 1:
        raise ValueError(f"waveform must be 1-D (mono), got shape {tuple(waveform.shape)}")
    if not waveform.is_floating_point():
        raise ValueError(f"waveform must be floating point, got {waveform.dtype}")
    if waveform.numel() == 0:
        raise ValueError("waveform is empty")
    if n_mels <= 0:
        raise ValueError(f"n_mels must be positive, got {n_mels}")
    chunk_samples = round(chunk_seconds * sample_rate)
    if chunk_samples < N_FFT:
        raise ValueError(f"chunk_seconds={chunk_seconds} is shorter than one {N_FFT}-sample window")

    device = waveform.device
    window, fbank_t = _mel_constants(n_mels, sample_rate, device)

    num_chunks = -(-waveform.numel() // chunk_samples)
    padded = torch.zeros(num_chunks * chunk_samples, dtype=torch.float32, device=device)
    padded[: waveform.numel()] = waveform
    chunks = padded.view(num_chunks, chunk_samples)

    # Dropping the last STFT frame (as Whisper does) leaves chunk_samples // hop.
    num_frames = chunk_samples // HOP_LENGTH
    out = torch.empty(num_chunks, n_mels, num_frames, dtype=torch.float32, device=device)
    for start in range(0, num_chunks, _CHUNKS_PER_BATCH):
        batch = chunks[start : start + _CHUNKS_PER_BATCH]
        stft = torch.stft(batch, N_FFT, HOP_LENGTH, window=window, center=True, return_complex=True)
        # |X|^2 via abs()**2 like Whisper/transformers (not re^2 + im^2) so
        # rounding matches; contiguous keeps the matmul on the fast path.
        power = (stft[..., :num_frames].abs() ** 2).contiguous()
        log_spec = torch.clamp(fbank_t @ power, min=1e-10).log10()
        # The dynamic range floor is per chunk, as when each 30 s window is
        # fed to Whisper separately.
        peak = log_spec.amax(dim=(1, 2), keepdim=True)
        log_spec = torch.maximum(log_spec, peak - 8.0)
        out[start : start + batch.shape[0]] = (log_spec + 4.0) / 4.0
    return out
