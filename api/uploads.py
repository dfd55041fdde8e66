"""Streaming uploads of large media: multipart bodies spooled to disk.

Videos of hundreds of MB must not pass through memory (nor through base64), so
request bodies are fed chunk by chunk into python_multipart's streaming parser
and every file part is written to its own file in a spool directory as its
bytes arrive. Size limits are checked on every chunk, so an oversized upload is
refused while it is still arriving instead of after it has filled the disk.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

MEDIA_KINDS = ("image", "video", "audio")

# Enough for every signature below; MPEG-TS needs a second sync byte at 188
# (192 + 4 for M2TS), the rest fit in the first 64 bytes.
SNIFF_BYTES = 512

# Spooled files carry this prefix so leftovers of a crashed server are ours to delete.
_SPOOL_PREFIX = "upload-"

# Room for the multipart framing and the `purpose` field around a /v1/files upload.
_FORM_OVERHEAD_BYTES = 64 << 10


class UploadError(Exception):
    """An upload refused with an HTTP status (400 / 413 / 415) and a message for the user.

    `close_connection` is set when the request body was abandoned part-way: the
    response should then carry `headers` (Connection: close), otherwise uvicorn
    keeps reading, and discarding, the rest of a possibly huge body.
    """

    def __init__(self, status: int, message: str, *, close_connection: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.close_connection = close_connection

    @property
    def headers(self) -> dict[str, str]:
        return {"Connection": "close"} if self.close_connection else {}


# --------------------------------------------------------------------------- sniffing

_ISO_AUDIO_BRANDS = frozenset({b"M4A ", b"M4B ", b"M4P ", b"F4A ", b"F4B "})
# HEIF/AVIF stills are ISO BMFF too; calling them "video" would route photos to the video decoder.
_ISO_IMAGE_BRANDS = frozenset({b"heic", b"heix", b"heim", b"heis", b"mif1", b"msf1", b"avif", b"avis"})
# Old QuickTime files may start with another top-level atom instead of 'ftyp'.
_QUICKTIME_ATOMS = frozenset({b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot"})
_BMP_DIB_HEADER_SIZES = frozenset({12, 16, 40, 52, 56, 64, 108, 124})


def sniff_media_kind(head: bytes) -> str | None:
    """"image" / "video" / "audio" from the magic bytes at the start of a file, else None."""
    for sniff in (_sniff_image, _sniff_container, _sniff_audio_stream):
        kind = sniff(head)
        if kind is not None:
            return kind
    return None


def _sniff_image(head: bytes) -> str | None:
    if head.startswith((b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a")):
        return "image"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image"
    # "BM" alone is too weak (plain text may start with it): also require a known DIB header size.
    if head[:2] == b"BM" and len(head) >= 18 and int.from_bytes(head[14:18], "little") in _BMP_DIB_HEADER_SIZES:
        return "image"
    return None


def _sniff_container(head: bytes) -> str | None:
    box = head[4:8]
    if box == b"ftyp":
        brand = head[8:12]
        if brand in _ISO_AUDIO_BRANDS:
            return "audio"
        return "image" if brand in _ISO_IMAGE_BRANDS else "video"
    if box in _QUICKTIME_ATOMS:
        return "video"
    if head[:4] == b"RIFF":
        return {b"AVI ": "video", b"WAVE": "audio"}.get(head[8:12])
    if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
        return "audio"
    if head[:4] == b"OggS":
        # Ogg is usually Vorbis/Opus audio; a Theora stream header makes it video.
        return "video" if b"\x80theora" in head[:SNIFF_BYTES] else "audio"
    if head.startswith((b"\x1a\x45\xdf\xa3", b"FLV\x01", b"\x00\x00\x01\xba")):
        return "video"
    if _is_mpeg_ts(head):
        return "video"
    if head.startswith((b"fLaC", b"#!AMR", b"caff", b"ID3")):
        return "audio"
    return None


def _is_mpeg_ts(head: bytes) -> bool:
    # One sync byte is common in arbitrary data; two a packet apart is not.
    ts = len(head) > 188 and head[0] == 0x47 and head[188] == 0x47
    m2ts = len(head) > 196 and head[4] == 0x47 and head[196] == 0x47  # 4-byte timestamp before each packet
    return ts or m2ts


def _sniff_audio_stream(head: bytes) -> str | None:
    """Raw MP3 / AAC ADTS streams, recognised by their 11/12-bit frame sync."""
    if len(head) < 3 or head[0] != 0xFF:
        return None
    b1, b2 = head[1], head[2]
    if b1 & 0xF6 == 0xF0:  # ADTS: 12-bit sync, layer 00 (0xFFF1 / 0xFFF9 and their CRC variants)
        return "audio"
    layer = (b1 >> 1) & 0b11
    bitrate, sample_rate = b2 >> 4, (b2 >> 2) & 0b11
    if b1 & 0xE0 == 0xE0 and layer != 0 and bitrate != 0xF and sample_rate != 0b11:
        return "audio"
    return None


# --------------------------------------------------------------------------- stored files


@dataclass(frozen=True)
class StoredFile:
    id: str  # "file-<hex>" for /v1/files uploads; the form field name for parts of one multipart request
    path: Path
    filename: str
    bytes: int
    media_kind: str | None  # sniffed; None = not a media type we know
    created_at: int
    purpose: str = "user_data"

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
        }


@dataclass
class MultipartForm:
    fields: dict[str, str] = field(default_factory=dict)  # non-file parts, decoded utf-8
    files: dict[str, StoredFile] = field(default_factory=dict)  # file parts by form field name

    def cleanup(self) -> None:
        """Delete the spooled files of this form; safe to call more than once."""
        for stored in self.files.values():
            stored.path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- multipart parsing


def format_size(n: int) -> str:
    """1048576 -> "1 MB", 1536 -> "1.5 KB": limits as users read them."""
    for unit, shift in (("GB", 30), ("MB", 20), ("KB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} bytes"


@dataclass
class _Part:
    """The part being parsed: its headers, then either a field value or an open spool file."""

    header_field: bytearray = field(default_factory=bytearray)
    header_value: bytearray = field(default_factory=bytearray)
    headers: dict[str, bytes] = field(default_factory=dict)
    name: str = ""
    filename: str | None = None  # None for a plain field
    value: bytearray = field(default_factory=bytearray)
    path: Path | None = None
    file: BinaryIO | None = None
    size: int = 0
    head: bytearray = field(default_factory=bytearray)


class _FormBuilder:
    """python_multipart callbacks that build a MultipartForm, spooling file parts to disk.

    The callbacks run inside `parser.write` on the event loop, so they only queue
    file writes; `flush` performs them afterwards on a worker thread, keeping
    slow disks from stalling every other request on the loop.
    """

    def __init__(self, spool_dir: Path, max_field_bytes: int, max_parts: int) -> None:
        self.spool_dir = spool_dir
        self.max_field_bytes = max_field_bytes
        self.max_parts = max_parts
        self.form = MultipartForm()
        self.ended = False
        self._parts_seen = 0
        self._part: _Part | None = None
        self._pending_writes: list[tuple[BinaryIO, memoryview]] = []
        self._pending_closes: list[BinaryIO] = []
        self._spooled: list[Path] = []  # every file created, finished or not, for cleanup

    def callbacks(self) -> dict[str, Callable[..., None]]:
        return {
            "on_part_begin": self._on_part_begin,
            "on_header_field": self._on_header_field,
            "on_header_value": self._on_header_value,
            "on_header_end": self._on_header_end,
            "on_headers_finished": self._on_headers_finished,
            "on_part_data": self._on_part_data,
            "on_part_end": self._on_part_end,
            "on_end": self._on_end,
        }

    def _on_part_begin(self) -> None:
        self._parts_seen += 1
        if self._parts_seen > self.max_parts:
            raise UploadError(400, f"multipart body has more than {self.max_parts} parts", close_connection=True)
        self._part = _Part()

    def _on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._current().header_field += data[start:end]

    def _on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._current().header_value += data[start:end]

    def _on_header_end(self) -> None:
        part = self._current()
        part.headers[part.header_field.decode("latin-1").strip().lower()] = bytes(part.header_value)
        part.header_field.clear()
        part.header_value.clear()

    def _on_headers_finished(self) -> None:
        part = self._current()
        part.name, part.filename = _form_names(part.headers.get("content-disposition"))
        if part.name in self.form.fields or part.name in self.form.files:
            raise UploadError(400, f"form field '{part.name}' appears more than once", close_connection=True)
        if part.filename is not None:
            fd, path = tempfile.mkstemp(prefix=_SPOOL_PREFIX, dir=self.spool_dir)
            part.path = Path(path)
            self._spooled.append(part.path)
            part.file = os.fdopen(fd, "wb")

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        part = self._current()
        if part.file is None:
            if len(part.value) + end - start > self.max_field_bytes:
                raise UploadError(
                    413, f"form field '{part.name}' exceeds the {format_size(self.max_field_bytes)} limit",
                    close_connection=True,
                )
            part.value += data[start:end]
            return
        # A view, not a copy: the chunk stays alive until flush() has written it.
        self._pending_writes.append((part.file, memoryview(data)[start:end]))
        if len(part.head) < SNIFF_BYTES:
            part.head += data[start:min(end, start + SNIFF_BYTES - len(part.head))]
        part.size += end - start

    def _on_part_end(self) -> None:
        part = self._current()
        self._part = None
        if part.file is None:
            self.form.fields[part.name] = _decode_field(part.name, part.value)
            return
        assert part.path is not None and part.filename is not None
        self._pending_closes.append(part.file)
        self.form.files[part.name] = StoredFile(
            id=part.name,
            path=part.path,
            filename=part.filename,
            bytes=part.size,
            media_kind=sniff_media_kind(bytes(part.head)),
            created_at=int(time.time()),
        )

    def _on_end(self) -> None:
        self.ended = True

    def _current(self) -> _Part:
        if self._part is None:  # python_multipart always begins a part first; guard against surprises
            raise UploadError(400, "malformed multipart body", close_connection=True)
        return self._part

    def has_pending_io(self) -> bool:
        return bool(self._pending_writes or self._pending_closes)

    def flush(self) -> None:
        """Write queued file data and close finished files (blocking: run on a worker thread)."""
        writes, self._pending_writes = self._pending_writes, []
        closes, self._pending_closes = self._pending_closes, []
        for file, data in writes:
            file.write(data)
        for file in closes:
            file.close()

    def discard(self) -> None:
        """Close and delete every file this form spooled, finished or partial."""
        self._pending_writes.clear()
        open_files = self._pending_closes + ([self._part.file] if self._part and self._part.file else [])
        for file in open_files:
            file.close()
        self._pending_closes.clear()
        for path in self._spooled:
            path.unlink(missing_ok=True)


def _form_names(disposition: bytes | None) -> tuple[str, str | None]:
    """(field name, filename or None) from a part's Content-Disposition header."""
    if disposition is None:
        raise UploadError(400, "multipart part without a Content-Disposition header", close_connection=True)
    kind, options = parse_options_header(disposition.decode("latin-1"))
    name = options.get(b"name")
    if kind != b"form-data" or not name:
        raise UploadError(400, "multipart part without a form field name", close_connection=True)
    filename = options.get(b"filename")
    # Browsers send UTF-8 names raw (RFC 7578); the filename is metadata only, never a path we open.
    return (
        name.decode("utf-8", errors="replace"),
        None if filename is None else _basename(filename.decode("utf-8", errors="replace")),
    )


def _basename(filename: str) -> str:
    return filename.replace("\\", "/").rsplit("/", 1)[-1]


def _decode_field(name: str, value: bytearray) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise UploadError(400, f"form field '{name}' is not valid UTF-8") from None


def _boundary(request: Request) -> bytes:
    content_type, options = parse_options_header(request.headers.get("content-type"))
    boundary = options.get(b"boundary")
    if content_type != b"multipart/form-data" or not boundary:
        raise UploadError(400, "expected a multipart/form-data body with a boundary", close_connection=True)
    return boundary


def _check_declared_length(request: Request, max_bytes: int) -> None:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise UploadError(413, f"upload exceeds the {format_size(max_bytes)} limit", close_connection=True)


async def parse_multipart(
    request: Request,
    spool_dir: Path,
    max_bytes: int,
    *,
    max_field_bytes: int = 1 << 20,
    max_parts: int = 64,
) -> MultipartForm:
    """Stream a multipart/form-data body: fields into memory, file parts into `spool_dir`.

    Raises UploadError (400 malformed / too many parts / client gone, 413 too
    large) after deleting whatever was already spooled. On success the caller
    owns the files and must call `MultipartForm.cleanup()` (or move them).
    """
    boundary = _boundary(request)
    _check_declared_length(request, max_bytes)
    spool_dir.mkdir(parents=True, exist_ok=True)
    builder = _FormBuilder(spool_dir, max_field_bytes, max_parts)
    try:
        parser = MultipartParser(boundary, builder.callbacks())  # type: ignore[arg-type]
        await _feed(request, parser, builder, max_bytes)
    except (FormParserError, ClientDisconnect) as exc:
        builder.discard()
        raise _upload_error_for(exc) from exc
    except BaseException:  # UploadError, cancellation, disk full...: never leave partial files behind
        builder.discard()
        raise
    return builder.form


async def _feed(request: Request, parser: MultipartParser, builder: _FormBuilder, max_bytes: int) -> None:
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > max_bytes:
            raise UploadError(413, f"upload exceeds the {format_size(max_bytes)} limit", close_connection=True)
        parser.write(chunk)
        if builder.has_pending_io():
            await asyncio.to_thread(builder.flush)
    parser.finalize()
    if not builder.ended:
        raise UploadError(400, "malformed multipart body: it ends before the closing boundary")


def _upload_error_for(exc: FormParserError | ClientDisconnect) -> UploadError:
    if isinstance(exc, ClientDisconnect):
        return UploadError(400, "client disconnected during the upload", close_connection=True)
    return UploadError(400, f"malformed multipart body: {exc}", close_connection=True)


# --------------------------------------------------------------------------- /v1/files


class FileStore:
    """Uploaded files (POST /v1/files) kept on disk for later requests."""

    def __init__(self, root: Path, max_file_bytes: int) -> None:
        self.root = root
        self.max_file_bytes = max_file_bytes
        self._files: dict[str, StoredFile] = {}
        root.mkdir(parents=True, exist_ok=True)

    async def save_upload(self, request: Request) -> StoredFile:
        """Store the `file` part of a multipart upload (with an optional `purpose` field)."""
        form = await parse_multipart(request, self.root, self.max_file_bytes + _FORM_OVERHEAD_BYTES)
        try:
            upload = self._validated_upload(form)
            file_id = f"file-{secrets.token_hex(12)}"
            path = self.root / file_id
            os.replace(upload.path, path)  # same directory: a rename, no copy
        except BaseException:
            form.cleanup()
            raise
        form.files.pop("file")
        form.cleanup()  # any other file parts were not asked for
        purpose = form.fields.get("purpose", "").strip() or "user_data"
        stored = StoredFile(
            id=file_id, path=path, filename=upload.filename, bytes=upload.bytes,
            media_kind=upload.media_kind, created_at=upload.created_at, purpose=purpose,
        )
        self._files[file_id] = stored
        return stored

    def _validated_upload(self, form: MultipartForm) -> StoredFile:
        upload = form.files.get("file")
        if upload is None:
            raise UploadError(400, "the upload has no 'file' part")
        if upload.bytes == 0:
            raise UploadError(400, f"the uploaded file '{upload.filename}' is empty")
        if upload.bytes > self.max_file_bytes:
            raise UploadError(413, f"upload exceeds the {format_size(self.max_file_bytes)} limit")
        if upload.media_kind is None:
            raise UploadError(
                415, f"unsupported media type: '{upload.filename}' is not an image, video or audio format we recognize"
            )
        return upload

    def get(self, file_id: str) -> StoredFile | None:
        return self._files.get(file_id)

    def delete(self, file_id: str) -> bool:
        stored = self._files.pop(file_id, None)
        if stored is None:
            return False
        stored.path.unlink(missing_ok=True)
        return True

    def list(self) -> list[StoredFile]:
        return list(self._files.values())

    def close(self) -> None:
        """Delete every stored file and any spool leftovers (server shutdown)."""
        for file_id in list(self._files):
            self.delete(file_id)
        for leftover in self.root.glob(f"{_SPOOL_PREFIX}*"):
            leftover.unlink(missing_ok=True)
