"""A corpus of bad HTTP inputs for a live Swallow server, each with the status it must get.

Every case is one client mistake (or one valid control next to it): broken,
truncated, empty and oversized media of every container we take, sent through
every way media reaches the server (a data: URL in its own part type, a `file`
part's file_data, a multipart file part, a /v1/files upload used by id);
decompression bombs and headers that lie; bad JSON, bad UTF-8, absurd numbers,
wrong types, path traversal, broken multipart. The runner is
tests/api/test_bad_input_corpus.py; `build_corpus(limit_bytes)` is all it needs.

Media originals are generated here (PIL, PyAV, numpy, seeded) and kept small so
the whole corpus runs in about a minute.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import struct
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import av
import httpx
import numpy as np
from PIL import Image

BOUNDARY = "swallow-corpus-boundary"
Send = Callable[[httpx.Client], httpx.Response]


@dataclass(frozen=True)
class Case:
    name: str
    status: int  # the exact status the server must answer
    send: Send


# ---------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------


def post_json(path: str, body: Any) -> Send:
    return post_bytes(path, json.dumps(body).encode())


def post_bytes(path: str, content: bytes, content_type: str = "application/json") -> Send:
    return lambda client: client.post(path, content=content, headers={"content-type": content_type})


def chat_body(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": "what is this?"}, *parts]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0} | extra


@dataclass(frozen=True)
class Part:
    """One multipart part; `filename` makes it a file part."""

    name: str
    data: bytes
    filename: str | None = None
    content_type: str | None = None


def multipart_body(parts: list[Part], boundary: str = BOUNDARY, close: bool = True) -> bytes:
    out = io.BytesIO()
    for part in parts:
        disposition = f'form-data; name="{part.name}"'
        if part.filename is not None:
            disposition += f'; filename="{part.filename}"'
        out.write(f"--{boundary}\r\nContent-Disposition: {disposition}\r\n".encode("utf-8", "surrogateescape"))
        if part.content_type is not None:
            out.write(f"Content-Type: {part.content_type}\r\n".encode())
        out.write(b"\r\n" + part.data + b"\r\n")
    if close:
        out.write(f"--{boundary}--\r\n".encode())
    return out.getvalue()


def post_multipart(path: str, parts: list[Part], content_type: str = f"multipart/form-data; boundary={BOUNDARY}",
                   close: bool = True) -> Send:
    return post_bytes(path, multipart_body(parts, close=close), content_type)


def chat_multipart(body: Any, *files: Part) -> Send:
    return post_multipart("/v1/chat/completions", [Part("request", json.dumps(body).encode()), *files])


def upload_then_chat(upload: Part, use: Callable[[str], dict[str, Any]]) -> Send:
    """POST /v1/files, then a chat that refers to the new file by id, then delete it.
    The answer is the upload's when it was refused, else the chat's."""

    def send(client: httpx.Client) -> httpx.Response:
        uploaded = client.post("/v1/files", files={"file": (upload.filename, upload.data, upload.content_type)})
        if uploaded.status_code != 200:
            return uploaded
        file_id = uploaded.json()["id"]
        try:
            return client.post("/v1/chat/completions", json=use(file_id))
        finally:
            client.delete(f"/v1/files/{file_id}")

    return send


def upload_then_delete(upload: Part) -> Send:
    def send(client: httpx.Client) -> httpx.Response:
        uploaded = client.post("/v1/files", files={"file": (upload.filename, upload.data, upload.content_type)})
        if uploaded.status_code == 200:
            client.delete(f"/v1/files/{uploaded.json()['id']}")
        return uploaded

    return send


def raw_http(request_line: str) -> Send:
    """A request sent on its own socket, byte for byte: httpx normalises '..' out of paths."""

    def send(client: httpx.Client) -> httpx.Response:
        url = client.base_url
        with socket.create_connection((url.host, url.port or 80), timeout=30) as sock:
            sock.sendall(f"{request_line}\r\nHost: {url.host}\r\nConnection: close\r\n\r\n".encode())
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = [tuple(line.split(": ", 1)) for line in lines[1:] if ": " in line]
        return httpx.Response(int(lines[0].split()[1]), headers=headers, content=body)

    return send


# ---------------------------------------------------------------------------------------
# Media originals
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MediaFormat:
    name: str  # also the file extension
    kind: str  # "image" | "video" | "audio"
    mime: str
    make: Callable[[], bytes]


def _pixels(width: int, height: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _pil(fmt: str, width: int = 48, height: int = 32) -> Callable[[], bytes]:
    def make() -> bytes:
        buf = io.BytesIO()
        Image.fromarray(_pixels(width, height)).save(buf, fmt)
        return buf.getvalue()

    return make


def _video(container: str, codec: str) -> Callable[[], bytes]:
    def make() -> bytes:
        buf = io.BytesIO()
        with av.open(buf, "w", format=container) as out:
            stream = out.add_stream(codec, rate=8)
            stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
            for i in range(8):
                frame = av.VideoFrame.from_ndarray(_pixels(64, 48, seed=i), format="rgb24")
                frame.pts = i
                for packet in stream.encode(frame):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        return buf.getvalue()

    return make


def _audio(container: str, codec: str, rate: int = 16000) -> Callable[[], bytes]:
    """One second of a 440 Hz tone."""

    def make() -> bytes:
        buf = io.BytesIO()
        tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate)).astype(np.float32)[None, :]
        with av.open(buf, "w", format=container) as out:
            stream = out.add_stream(codec, rate=rate, layout="mono")
            resampler = av.AudioResampler(format=stream.format.name, layout="mono", rate=rate,
                                          frame_size=stream.frame_size or 1024)
            frame = av.AudioFrame.from_ndarray(tone, format="flt", layout="mono")
            frame.sample_rate, frame.pts = rate, 0
            for piece in [*resampler.resample(frame), *resampler.resample(None)]:
                for packet in stream.encode(piece):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        return buf.getvalue()

    return make


FORMATS: tuple[MediaFormat, ...] = (
    MediaFormat("png", "image", "image/png", _pil("PNG")),
    MediaFormat("jpg", "image", "image/jpeg", _pil("JPEG")),
    MediaFormat("gif", "image", "image/gif", _pil("GIF")),
    MediaFormat("webp", "image", "image/webp", _pil("WEBP")),
    MediaFormat("bmp", "image", "image/bmp", _pil("BMP")),
    MediaFormat("mp4", "video", "video/mp4", _video("mp4", "mpeg4")),
    MediaFormat("mov", "video", "video/quicktime", _video("mov", "mpeg4")),
    MediaFormat("mkv", "video", "video/x-matroska", _video("matroska", "mpeg4")),
    MediaFormat("webm", "video", "video/webm", _video("webm", "libvpx")),
    MediaFormat("avi", "video", "video/x-msvideo", _video("avi", "mpeg4")),
    MediaFormat("ts", "video", "video/mp2t", _video("mpegts", "mpeg2video")),
    MediaFormat("flv", "video", "video/x-flv", _video("flv", "flv")),
    # No Ogg Theora: this PyAV build has no Theora encoder.
    MediaFormat("wav", "audio", "audio/wav", _audio("wav", "pcm_s16le")),
    MediaFormat("mp3", "audio", "audio/mpeg", _audio("mp3", "libmp3lame")),
    MediaFormat("flac", "audio", "audio/flac", _audio("flac", "flac")),
    MediaFormat("opus", "audio", "audio/ogg", _audio("ogg", "libopus")),
    MediaFormat("m4a", "audio", "audio/mp4", _audio("ipod", "aac")),
    MediaFormat("aiff", "audio", "audio/aiff", _audio("aiff", "pcm_s16be")),
)


@cache
def original(name: str) -> bytes:
    return next(f for f in FORMATS if f.name == name).make()


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(n)


# ---------------------------------------------------------------------------------------
# Corruptions of one original: name -> (bytes, what the server must answer)
# ---------------------------------------------------------------------------------------

# Where a variant's status is not the rule's (valid 200, noise 400, half 400, empty 400,
# too big 413), and why. Each is deterministic: the same bytes, the same decoder.
STATUS_EXCEPTIONS: dict[tuple[str, str], int] = {
    # media.image decodes JPEG, PNG, WebP and GIF: a well-formed BMP (whole or cut, its
    # header still says BMP) is a format we do not take. Noise after its first 16 bytes
    # breaks the DIB header the sniffer checks, so that one is "declared image, is not" (400).
    ("bmp", "valid"): 415,
    ("bmp", "truncated"): 415,
    # The noise after GIF's header reads as an image descriptor of ~5.4 billion pixels:
    # refused as a decompression bomb before any decoding.
    ("gif", "random-after-magic"): 413,
    # Packet streams with no index or header length to contradict them: the first half
    # is a shorter valid stream, and decoders recover it. (audio.py trusts header
    # durations of FLAC, MP4 and Matroska only; MP4/MOV/M4A keep their index at the end,
    # Matroska/WebM state a duration, AVI and Ogg/Opus fail their own checks: those are 400.)
    ("ts", "truncated"): 200,
    ("flv", "truncated"): 200,
    ("wav", "truncated"): 200,
    ("aiff", "truncated"): 200,
    ("mp3", "truncated"): 200,
}


def variants(fmt: MediaFormat, limit_bytes: int) -> dict[str, tuple[bytes, int]]:
    data = original(fmt.name)
    by_rule = {
        "valid": (data, 200),
        # The magic (and so the sniffed kind) survives; everything after it is noise.
        "random-after-magic": (data[:16] + random_bytes(len(data) - 16, seed=len(data)), 400),
        "truncated": (data[: len(data) // 2], 400),
        "empty": (b"", 400),
        "oversized": (data + bytes(limit_bytes + (256 << 10) - len(data)), 413),
    }
    return {name: (body, STATUS_EXCEPTIONS.get((fmt.name, name), status)) for name, (body, status) in by_rule.items()}


# Variants whose refusal does not depend on how the bytes arrive: sent through fewer transports.
_FEW_TRANSPORTS = ("empty", "oversized")
_NATIVE_PART = {"image": "image_url", "video": "video_url", "audio": "input_audio"}


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def native_part(kind: str, mime: str, data: bytes, ext: str) -> dict[str, Any]:
    """The part type made for the kind: image_url / video_url with a data: URL, input_audio."""
    if kind == "audio":
        return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": ext}}
    part = _NATIVE_PART[kind]
    return {"type": part, part: {"url": data_url(mime, data)}}


def by_reference(kind: str, ref: str) -> dict[str, Any]:
    """A part naming a multipart field or an uploaded file: its url, or `file` for audio."""
    if kind == "audio":
        return {"type": "file", "file": {"file_id": ref}}
    part = _NATIVE_PART[kind]
    return {"type": part, part: {"url": ref}}


def media_cases(limit_bytes: int) -> Iterator[Case]:
    for fmt in FORMATS:
        for variant, (data, status) in variants(fmt, limit_bytes).items():
            name = f"{fmt.kind}/{fmt.name}/{variant}"
            upload = Part("file", data, f"clip.{fmt.name}", fmt.mime)
            yield Case(f"{name}/data-url", status,
                       post_json("/v1/chat/completions", chat_body(native_part(fmt.kind, fmt.mime, data, fmt.name))))
            yield Case(f"{name}/multipart", status,
                       chat_multipart(chat_body({"type": "file", "file": {"file_id": "media"}}),
                                      Part("media", data, f"clip.{fmt.name}", fmt.mime)))
            yield Case(f"{name}/files-api", status, upload_then_chat(upload, lambda i, k=fmt.kind: chat_body(
                by_reference(k, i))))
            if variant in _FEW_TRANSPORTS:
                continue
            yield Case(f"{name}/file-data", status, post_json("/v1/chat/completions", chat_body(
                {"type": "file", "file": {"file_data": data_url(fmt.mime, data)}})))
            yield Case(f"{name}/multipart-by-url", status,
                       chat_multipart(chat_body(by_reference(fmt.kind, "media")),
                                      Part("media", data, f"clip.{fmt.name}", "application/octet-stream")))


# ---------------------------------------------------------------------------------------
# Bytes that are not what they claim, bombs and lying headers
# ---------------------------------------------------------------------------------------


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_claiming(width: int, height: int, rows: bytes, bit_depth: int = 8, color: int = 2) -> bytes:
    """A PNG whose IHDR says `width`x`height`, with `rows` (filter bytes included) as its data."""
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(rows, 9))
            + _png_chunk(b"IEND", b""))


def gif_claiming(width: int, height: int) -> bytes:
    """A GIF whose screen and only image claim `width`x`height`, with one pixel of data."""
    screen = b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"
    image = b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0) + b"\x02\x02\x44\x01\x00"
    return screen + image + b"\x3b"


def jpeg_claiming(width: int, height: int) -> bytes:
    """A real small JPEG with its frame header (SOF0) patched to say `width`x`height`."""
    data = bytearray(original("jpg"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def mp4_claiming_duration(seconds: int) -> bytes:
    """The small MP4 with every duration in it claiming `seconds`: the movie, track and
    media headers (mvhd, tkhd, mdhd), the edit list (elst) and the sample table (stts),
    which FFmpeg trusts over the headers."""
    data = bytearray(original("mp4"))
    movie_timescale = _u32(data, b"mvhd", 12)  # after version+flags, creation and modification times
    _put_u32(data, b"mvhd", 16, seconds * movie_timescale)
    _put_u32(data, b"tkhd", 20, seconds * movie_timescale)
    _put_u32(data, b"elst", 8, seconds * movie_timescale)  # the first edit's segment duration
    media_timescale = _u32(data, b"mdhd", 12)
    _put_u32(data, b"mdhd", 16, seconds * media_timescale)
    entries = _u32(data, b"stts", 4)
    samples = sum(_u32(data, b"stts", 8 + 8 * i) for i in range(entries))
    for i in range(entries):
        _put_u32(data, b"stts", 12 + 8 * i, seconds * media_timescale // samples)
    return bytes(data)


def _u32(data: bytearray, box: bytes, offset: int) -> int:
    """The big-endian u32 `offset` bytes into the payload of the first `box` box."""
    at = data.index(box) + 4 + offset
    return struct.unpack(">I", data[at:at + 4])[0]


def _put_u32(data: bytearray, box: bytes, offset: int, value: int) -> None:
    at = data.index(box) + 4 + offset
    data[at:at + 4] = struct.pack(">I", min(value, 0xFFFFFFFF))


def wav_claiming(data_bytes: int) -> bytes:
    """The small WAV with its RIFF and data chunk sizes claiming `data_bytes` of samples."""
    data = bytearray(original("wav"))
    data[4:8] = struct.pack("<I", min(data_bytes + 36, 0xFFFFFFFF))
    at = data.index(b"data") + 4
    data[at:at + 4] = struct.pack("<I", data_bytes)
    return bytes(data)


def flac_claiming_samples(total: int) -> bytes:
    """The small FLAC with STREAMINFO's 36-bit total sample count set to `total`."""
    data = bytearray(original("flac"))
    at = 8 + 13  # "fLaC", block header (4), then 13 bytes before the 4 low bits + 32 bits of total samples
    data[at] = (data[at] & 0xF0) | ((total >> 32) & 0x0F)
    data[at + 1:at + 5] = struct.pack(">I", total & 0xFFFFFFFF)
    return bytes(data)


def image_part(mime: str, data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(mime, data)}}


def claim_cases() -> Iterator[Case]:
    chat = "/v1/chat/completions"
    noise = random_bytes(4096, seed=7)
    declared = (("image", "image/png", "png"), ("video", "video/mp4", "mp4"), ("audio", "audio/wav", "wav"))
    for kind, mime, ext in declared:
        # Pure noise that says it is media: not a valid <kind> (400), as OpenAI answers.
        yield Case(f"claims/{kind}/noise-as-{ext}/data-url", 400,
                   post_json(chat, chat_body(native_part(kind, mime, noise, ext))))
        yield Case(f"claims/{kind}/noise-as-{ext}/file-data", 400,
                   post_json(chat, chat_body({"type": "file", "file": {"file_data": data_url(mime, noise)}})))
        yield Case(f"claims/{kind}/noise-named-clip.{ext}/multipart", 400,
                   chat_multipart(chat_body({"type": "file", "file": {"file_id": "m"}}),
                                  Part("m", noise, f"clip.{ext}", "application/octet-stream")))
        yield Case(f"claims/{kind}/noise-named-clip.{ext}/files-api", 400,
                   upload_then_delete(Part("file", noise, f"clip.{ext}", "application/octet-stream")))
    # Noise nobody said anything about: we cannot tell what it is (415).
    yield Case("claims/noise-undeclared/file-data", 415, post_json(chat, chat_body(
        {"type": "file", "file": {"file_data": base64.b64encode(noise).decode()}})))
    yield Case("claims/noise-undeclared/files-api", 415,
               upload_then_delete(Part("file", noise, "blob", "application/octet-stream")))
    # Well-formed files of kinds we do not take: 415 whatever they were called.
    others = {"pdf": b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<<>>\nendobj\n", "zip": b"PK\x03\x04" + bytes(60),
              "tiff": b"II*\x00\x08\x00\x00\x00" + bytes(60), "text": b"Dear diary, today I sent a file.\n" * 8}
    for name, data in others.items():
        yield Case(f"claims/{name}-as-png/data-url", 415, post_json(chat, chat_body(image_part("image/png", data))))
        yield Case(f"claims/{name}-named-clip.mp4/multipart", 415,
                   chat_multipart(chat_body({"type": "file", "file": {"file_id": "m"}}),
                                  Part("m", data, "clip.mp4", "video/mp4")))
        yield Case(f"claims/{name}/files-api", 415, upload_then_delete(Part("file", data, f"doc.{name}", None)))
    # Media of the wrong kind for its part type.
    yield Case("claims/wav-in-image_url", 400, post_json(chat, chat_body(image_part("image/png", original("wav")))))
    yield Case("claims/png-in-input_audio", 400,
               post_json(chat, chat_body(native_part("audio", "audio/wav", original("png"), "wav"))))
    yield Case("claims/mp4-in-image_url", 400, post_json(chat, chat_body(image_part("image/png", original("mp4")))))
    yield Case("claims/png-in-video_url", 400,
               post_json(chat, chat_body(native_part("video", "video/mp4", original("png"), "mp4"))))
    # An M4A is an ISO file like an MP4, but its brand says audio: refused for a video_url before decoding.
    yield Case("claims/m4a-in-video_url", 400,
               post_json(chat, chat_body(native_part("video", "video/mp4", original("m4a"), "mp4"))))


def bomb_cases() -> Iterator[Case]:
    chat = "/v1/chat/completions"
    one_row = b"\x00" + bytes(3)
    # Decompression bombs: tiny files whose headers promise billions of pixels (413, before decoding).
    yield Case("bomb/png-100000x100000", 413,
               post_json(chat, chat_body(image_part("image/png", png_claiming(100_000, 100_000, one_row)))))
    yield Case("bomb/png-1bit-30000x30000", 413,
               post_json(chat, chat_body(image_part("image/png", png_claiming(
                   30_000, 30_000, (b"\x00" + bytes(3750)) * 30_000, bit_depth=1, color=0)))))
    yield Case("bomb/gif-65535x65535", 413,
               post_json(chat, chat_body(image_part("image/gif", gif_claiming(65535, 65535)))))
    yield Case("bomb/jpeg-65500x65500", 413,
               post_json(chat, chat_body(image_part("image/jpeg", jpeg_claiming(65500, 65500)))))
    yield Case("bomb/png-100000x100000/files-api", 413, upload_then_chat(
        Part("file", png_claiming(100_000, 100_000, one_row), "bomb.png", "image/png"),
        lambda i: chat_body(by_reference("image", i))))
    # Headers that lie about the size: the data is smaller than promised.
    yield Case("lie/png-says-96x64-holds-48x32", 400,
               post_json(chat, chat_body(image_part("image/png", png_claiming(96, 64, (b"\x00" + bytes(144)) * 32)))))
    yield Case("lie/png-zero-width", 400,
               post_json(chat, chat_body(image_part("image/png", png_claiming(0, 32, one_row)))))
    # JPEG decoders fill the rows past the end of the data (libjpeg only warns), so a frame
    # header that overstates the size gives a padded picture, not an error.
    yield Case("lie/jpeg-says-96x64-holds-48x32", 200,
               post_json(chat, chat_body(image_part("image/jpeg", jpeg_claiming(96, 64)))))
    # Durations that lie: 8 frames said to last 10 h are over the 4 h video limit (413) before
    # any decoding; said to last 1 h, they are 8 frames far apart, which is a valid video (200).
    yield Case("lie/mp4-claims-10h", 413, post_json(chat, chat_body(
        native_part("video", "video/mp4", mp4_claiming_duration(36_000), "mp4"))))
    yield Case("lie/mp4-claims-1h", 200, post_json(chat, chat_body(
        native_part("video", "video/mp4", mp4_claiming_duration(3_600), "mp4"))))
    # A WAV whose chunk sizes claim 37 hours: PCM is read as far as it goes (200).
    yield Case("lie/wav-claims-37h", 200, post_json(chat, chat_body(
        native_part("audio", "audio/wav", wav_claiming(0xFFFFFFF0), "wav"))))
    # A FLAC whose STREAMINFO claims 10 h: FLAC's header length is trusted, and is over the 1 h audio limit.
    yield Case("lie/flac-claims-10h", 413, post_json(chat, chat_body(
        native_part("audio", "audio/flac", flac_claiming_samples(16000 * 36_000), "flac"))))
    yield Case("lie/flac-claims-30min", 400, post_json(chat, chat_body(  # within the limit: truncated
        native_part("audio", "audio/flac", flac_claiming_samples(16000 * 1800), "flac"))))


# ---------------------------------------------------------------------------------------
# JSON: syntax, encoding, numbers, types
# ---------------------------------------------------------------------------------------

GOOD_MESSAGES = [{"role": "user", "content": "hello"}]


def json_syntax_cases() -> Iterator[Case]:
    for tag, path in (("chat", "/v1/chat/completions"), ("completions", "/v1/completions")):
        raw = {
            "empty-body": b"",
            "not-json": b"{nope",
            "truncated": b'{"messages": [{"role": "user", "content": "hel',
            "deep-arrays": b"[" * 100_000 + b"]" * 100_000,
            "deep-objects": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
            "deep-inside-field": b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b', "prompt": "x"}',
            "bad-utf8": b'{"messages": [{"role": "user", "content": "caf\xe9 \xff\xfe"}], "prompt": "caf\xe9"}',
            "nan-literal": b'{"messages": [{"role": "user", "content": "x"}], "prompt": "x", "temperature": NaN}',
            "infinity-literal": b'{"messages": [{"role": "user", "content": "x"}], "prompt": "x", "top_p": Infinity}',
            "huge-integer-literal": b'{"prompt": "x", "messages": [], "max_tokens": 1' + b"0" * 5000 + b"}",
            "nul-bytes": b'{"messages"\x00: []}',
            "trailing-garbage": b'{"prompt": "x", "messages": [{"role": "user", "content": "x"}]} extra',
        }
        for name, body in raw.items():
            yield Case(f"json/{tag}/{name}", 400, post_bytes(path, body))
        for name, body in {"array": [], "string": "hi", "number": 5, "null": None}.items():
            yield Case(f"json/{tag}/top-level-{name}", 400, post_json(path, body))


# Sampling values the engine must refuse up front, whatever endpoint and stream mode.
BAD_SAMPLING: dict[str, dict[str, Any]] = {
    "max_tokens-10**100": {"max_tokens": 10**100},
    "max_tokens-1e400": {"max_tokens": 1e400},
    "max_tokens-negative": {"max_tokens": -5},
    "max_tokens-zero": {"max_tokens": 0},
    "max_tokens-float": {"max_tokens": 1.5},
    "max_tokens-string": {"max_tokens": "10"},
    "max_tokens-bool": {"max_tokens": True},
    "temperature-1e400": {"temperature": 1e400},
    "temperature-NaN": {"temperature": float("nan")},  # json.dumps writes the NaN literal
    "top_p-Infinity": {"top_p": float("inf")},
    "temperature--Infinity": {"temperature": float("-inf")},
    "temperature-10**400-int": {"temperature": 10**400},
    "temperature-1e-300": {"temperature": 1e-300},
    "temperature-1e-38": {"temperature": 1e-38},
    "temperature-negative": {"temperature": -1},
    "temperature-string": {"temperature": "hot"},
    "top_p-zero": {"top_p": 0},
    "top_p-negative": {"top_p": -0.5},
    "top_p-above-one": {"top_p": 1.5},
    "top_k-10**12": {"top_k": 10**12, "temperature": 1},
    "top_k-zero": {"top_k": 0},
    "top_k-negative": {"top_k": -7},
    "seed-2**70": {"seed": 2**70, "temperature": 1},
    "seed--2**70": {"seed": -(2**70), "temperature": 1},
    "seed-float": {"seed": 1.5},
    "stop_token_ids-out-of-vocabulary": {"stop_token_ids": [10**9]},
    "stop_token_ids-2**70": {"stop_token_ids": [2**70]},
    "stop_token_ids-negative": {"stop_token_ids": [-1]},
    "stop_token_ids-string": {"stop_token_ids": "1,2"},
    "stop-number": {"stop": 5},
    "stop-empty-string": {"stop": [""]},
    "n-17": {"n": 17},
    "n-zero": {"n": 0},
    "n-string": {"n": "2"},
    "presence_penalty-3": {"presence_penalty": 3},
    "frequency_penalty-string": {"frequency_penalty": "high"},
    "repetition_penalty-zero": {"repetition_penalty": 0},
    "repetition_penalty-denormal": {"repetition_penalty": 5e-324},
    "stream_options-string": {"stream_options": "usage"},
    "include_usage-string": {"stream_options": {"include_usage": "yes"}},
    "ignore_eos-string": {"ignore_eos": "false"},
    "ignore_eos-number": {"ignore_eos": 1},
}


def sampling_cases() -> Iterator[Case]:
    for name, values in BAD_SAMPLING.items():
        for stream in (False, True):
            mode = "stream" if stream else "plain"
            chat = {"messages": GOOD_MESSAGES, "max_tokens": 2, "stream": stream} | values
            yield Case(f"sampling/chat/{mode}/{name}", 400, post_json("/v1/chat/completions", chat))
            completion = {"prompt": [5, 6, 7], "max_tokens": 2, "stream": stream} | values
            yield Case(f"sampling/completions/{mode}/{name}", 400, post_json("/v1/completions", completion))
    for name, stream in {"string": "false", "number": 0, "list": [True]}.items():
        yield Case(f"sampling/chat/stream-{name}", 400,
                   post_json("/v1/chat/completions", {"messages": GOOD_MESSAGES, "stream": stream}))
        yield Case(f"sampling/completions/stream-{name}", 400,
                   post_json("/v1/completions", {"prompt": "x", "stream": stream}))
    too_long = {"messages": [{"role": "user", "content": "word " * 20_000}], "max_tokens": 2}
    yield Case("sampling/chat/prompt-over-context", 400, post_json("/v1/chat/completions", too_long))
    yield Case("sampling/completions/prompt-ids-out-of-vocabulary", 400,
               post_json("/v1/completions", {"prompt": [1, 2, 10**12], "max_tokens": 2}))
    yield Case("sampling/completions/prompt-ids-negative", 400,
               post_json("/v1/completions", {"prompt": [1, -2], "max_tokens": 2}))


def _with_content(content: Any, role: Any = "user") -> dict[str, Any]:
    return {"messages": [{"role": role, "content": content}], "max_tokens": 1}


def _with_image_url(url: Any) -> dict[str, Any]:
    return _with_content([{"type": "image_url", "image_url": {"url": url}}])


def type_cases() -> Iterator[Case]:
    chat = "/v1/chat/completions"
    bad_chat: dict[str, Any] = {
        "messages-missing": {"max_tokens": 1},
        "messages-empty": {"messages": []},
        "messages-object": {"messages": {"role": "user", "content": "x"}},
        "messages-string": {"messages": "hello"},
        "messages-null": {"messages": None},
        "message-number": {"messages": [5]},
        "message-null": {"messages": [None]},
        "message-list": {"messages": [["user", "hi"]]},
        "role-missing": {"messages": [{"content": "x"}]},
        "role-number": _with_content("x", role=5),
        "role-unknown": _with_content("x", role="robot"),
        "role-tool": _with_content("x", role="tool"),
        "role-empty": _with_content("x", role=""),
        "content-missing": {"messages": [{"role": "user"}]},
        "content-number": _with_content(5),
        "content-object": _with_content({"type": "text", "text": "x"}),
        "content-null": _with_content(None),
        "part-number": _with_content([5]),
        "part-string": _with_content(["hello"]),
        "part-type-missing": _with_content([{"text": "x"}]),
        "part-type-number": _with_content([{"type": 5}]),
        "part-type-unknown": _with_content([{"type": "hologram"}]),
        "part-type-image": _with_content([{"type": "image", "image": "x"}]),
        "part-type-empty": _with_content([{"type": ""}]),
        "text-number": _with_content([{"type": "text", "text": 5}]),
        "text-missing": _with_content([{"type": "text"}]),
        "image_url-number": _with_content([{"type": "image_url", "image_url": 5}]),
        "image_url-missing": _with_content([{"type": "image_url"}]),
        "image_url-url-number": _with_image_url(5),
        "image_url-url-empty": _with_image_url(""),
        "image_url-not-base64-data-url": _with_image_url("data:image/png,abc"),
        "image_url-bad-base64": _with_image_url("data:image/png;base64,@@@"),
        "image_url-https": _with_image_url("https://example.com/a.png"),
        "image_url-unknown-id": _with_image_url("file-doesnotexist"),
        "video_url-number": _with_content([{"type": "video_url", "video_url": 5}]),
        "input_audio-string": _with_content([{"type": "input_audio", "input_audio": "x"}]),
        "input_audio-data-number": _with_content([{"type": "input_audio", "input_audio": {"data": 5}}]),
        "input_audio-bad-base64": _with_content([{"type": "input_audio",
                                                   "input_audio": {"data": "!!", "format": "wav"}}]),
        "file-number": _with_content([{"type": "file", "file": 5}]),
        "file-empty-object": _with_content([{"type": "file", "file": {}}]),
        "file-id-number": _with_content([{"type": "file", "file": {"file_id": 5}}]),
        "file-data-bad-base64": _with_content([{"type": "file", "file": {"file_data": "%%%"}}]),
        "media-in-assistant-message": _with_content(
            [{"type": "image_url", "image_url": {"url": data_url("image/png", original("png"))}}], role="assistant"),
        "media-in-system-message": _with_content(
            [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}], role="system"),
    }
    for name, body in bad_chat.items():
        yield Case(f"types/chat/{name}", 400, post_json(chat, body))
    bad_prompts: dict[str, Any] = {
        "missing": None, "number": 5, "empty-list": [], "empty-nested": [[]], "float-ids": [1.5, 2.0],
        "mixed": ["a", 1], "object": {"text": "x"}, "bool-ids": [True, False], "nested-strings": [["a"]],
    }
    for name, prompt in bad_prompts.items():
        body = {"max_tokens": 1} if prompt is None else {"prompt": prompt, "max_tokens": 1}
        yield Case(f"types/completions/prompt-{name}", 400, post_json("/v1/completions", body))
    # Odd but valid: an empty string or an empty content list is a (short) prompt.
    yield Case("types/chat/content-empty-string", 200, post_json(chat, _with_content("")))
    yield Case("types/chat/content-empty-list", 200, post_json(chat, _with_content([])))
    yield Case("types/chat/text-with-nul-and-controls", 200, post_json(chat, _with_content("a\x00b\x1b[31mc\u202e")))
    yield Case("types/chat/lone-surrogate", 400, post_json(chat, _with_content("\ud800 x")))
    yield Case("types/chat/lone-surrogate-in-part", 400,
               post_json(chat, _with_content([{"type": "text", "text": "\udfff"}])))
    yield Case("types/completions/lone-surrogate", 400,
               post_json("/v1/completions", {"prompt": "x\ud800", "max_tokens": 1}))


# ---------------------------------------------------------------------------------------
# Files: ids, names, traversal
# ---------------------------------------------------------------------------------------

TRAVERSAL_IDS = ("..%2F..%2Fetc%2Fpasswd", "%2e%2e%2f%2e%2e%2fetc%2fpasswd", "%2Fetc%2Fpasswd", "file-%00",
                 "..", "%2e%2e", "file-" + "a" * 5000, "C:%5CWindows%5Cwin.ini", "%252e%252e%252f")


def file_cases() -> Iterator[Case]:
    for i, file_id in enumerate(TRAVERSAL_IDS):
        path = f"/v1/files/{file_id}"
        yield Case(f"files/get/{i}-{file_id[:24]}", 404, lambda c, p=path: c.get(p))
        yield Case(f"files/delete/{i}-{file_id[:24]}", 404, lambda c, p=path: c.delete(p))
    yield Case("files/get/raw-dot-segments", 404, raw_http("GET /v1/files/../../etc/passwd HTTP/1.1"))
    yield Case("files/delete/raw-dot-segments", 404, raw_http("DELETE /v1/files/../../../etc/passwd HTTP/1.1"))
    yield Case("files/get/raw-absolute-url", 404, raw_http("GET /v1/files//etc/passwd HTTP/1.1"))
    refs = ("../../etc/passwd", "/etc/passwd", "file:///etc/passwd", "file-\x00", "..\\..\\boot.ini", "~/.ssh/id_rsa")
    for ref in refs:
        yield Case(f"files/ref/image_url/{ref!r}", 400,
                   post_json("/v1/chat/completions", chat_body({"type": "image_url", "image_url": {"url": ref}})))
        yield Case(f"files/ref/file_id/{ref!r}", 400,
                   post_json("/v1/chat/completions", chat_body({"type": "file", "file": {"file_id": ref}})))
    # File names are metadata only: a valid image under any name is stored (and the name cut to its base).
    for name in ("../../etc/passwd", "/etc/passwd", "..\\..\\windows\\win.ini", "a\x00b.png", "%2e%2e%2fx.png",
                 "." * 300, "ünïcødé 😀.png"):
        yield Case(f"files/upload-name/{name[:32]!r}", 200,
                   upload_then_delete(Part("file", original("png"), name, "image/png")))
    yield Case("files/chat-part-named-../../etc/passwd", 200, chat_multipart(
        chat_body({"type": "file", "file": {"file_id": "media"}}),
        Part("media", original("png"), "../../etc/passwd", "image/png")))
    yield Case("files/method-put", 405, lambda c: c.put("/v1/files/file-x", content=b"x"))
    yield Case("files/unknown-route", 404, lambda c: c.get("/v1/nothing-here"))
    yield Case("chat/method-get", 405, lambda c: c.get("/v1/chat/completions"))


# ---------------------------------------------------------------------------------------
# Multipart framing
# ---------------------------------------------------------------------------------------


def multipart_cases(limit_bytes: int) -> Iterator[Case]:
    chat, files = "/v1/chat/completions", "/v1/files"
    request = Part("request", json.dumps(chat_body()).encode())
    png = Part("file", original("png"), "a.png", "image/png")
    many = [request] + [Part(f"f{i}", b"x", f"{i}.png", "image/png") for i in range(10_000)]
    yield Case("multipart/chat/10000-parts", 400, post_multipart(chat, many))
    yield Case("multipart/files/10000-parts", 400, post_multipart(files, [png, *many[1:]]))
    for tag, path, parts in (("chat", chat, [request]), ("files", files, [png])):
        body = multipart_body(parts)
        yield Case(f"multipart/{tag}/missing-boundary", 400, post_bytes(path, body, "multipart/form-data"))
        yield Case(f"multipart/{tag}/empty-boundary", 400, post_bytes(path, body, "multipart/form-data; boundary="))
        yield Case(f"multipart/{tag}/wrong-boundary", 400,
                   post_bytes(path, body, "multipart/form-data; boundary=somethingelse"))
        yield Case(f"multipart/{tag}/truncated", 400, post_bytes(
            path, body[: len(body) // 2], f"multipart/form-data; boundary={BOUNDARY}"))
        yield Case(f"multipart/{tag}/no-closing-boundary", 400, post_multipart(path, parts, close=False))
        yield Case(f"multipart/{tag}/empty-body", 400,
                   post_bytes(path, b"", f"multipart/form-data; boundary={BOUNDARY}"))
        yield Case(f"multipart/{tag}/garbage", 400, post_bytes(
            path, random_bytes(2048, seed=3), f"multipart/form-data; boundary={BOUNDARY}"))
        yield Case(f"multipart/{tag}/duplicate-field", 400, post_multipart(path, [*parts, *parts]))
        no_name = f"--{BOUNDARY}\r\nContent-Disposition: form-data\r\n\r\nx\r\n--{BOUNDARY}--\r\n".encode()
        yield Case(f"multipart/{tag}/part-without-name", 400,
                   post_bytes(path, no_name, f"multipart/form-data; boundary={BOUNDARY}"))
        oversized = [*parts, Part("pad", bytes(limit_bytes + (256 << 10)), "pad.bin")]
        yield Case(f"multipart/{tag}/oversized", 413, post_multipart(path, oversized))
    yield Case("multipart/chat/no-request-part", 400, post_multipart(chat, [png]))
    yield Case("multipart/chat/request-not-utf8", 400,
               post_multipart(chat, [Part("request", b'{"messages": "\xff\xfe"}')]))
    yield Case("multipart/chat/request-deep-json", 400,
               post_multipart(chat, [Part("request", b"[" * 100_000 + b"]" * 100_000)]))
    yield Case("multipart/chat/request-nan", 400, post_multipart(chat, [Part("request", b'{"temperature": NaN}')]))
    yield Case("multipart/chat/request-not-json", 400, post_multipart(chat, [Part("request", b"{nope")]))
    yield Case("multipart/chat/request-field-over-1MB", 413,
               post_multipart(chat, [Part("request", b'"' + b"a" * (1 << 20) + b'"')]))
    yield Case("multipart/chat/unknown-part-reference", 400,
               chat_multipart(chat_body({"type": "file", "file": {"file_id": "nope"}}), png))
    yield Case("multipart/files/no-file-part", 400, post_multipart(files, [Part("purpose", b"vision")]))
    yield Case("multipart/files/file-as-field", 400, post_multipart(files, [Part("file", original("png"))]))
    yield Case("multipart/files/not-multipart", 400, post_bytes(files, original("png"), "image/png"))
    yield Case("multipart/files/json-body", 400, post_json(files, {"file": "x"}))


def build_corpus(limit_bytes: int) -> list[Case]:
    """Every case, for a server started with `--max-upload-mb` = limit_bytes / 1 MiB."""
    cases = [
        *media_cases(limit_bytes),
        *claim_cases(),
        *bomb_cases(),
        *json_syntax_cases(),
        *sampling_cases(),
        *type_cases(),
        *file_cases(),
        *multipart_cases(limit_bytes),
    ]
    duplicates = sorted(name for name, n in Counter(c.name for c in cases).items() if n > 1)
    assert not duplicates, f"duplicate case names: {duplicates}"
    return cases
