"""Streaming uploads of large media: multipart bodies spooled to disk.

Videos of hundreds of MB must not pass through memory (nor through base64), so
request bodies are fed chunk by chunk into python_multipart's streaming parser
and every file part is written to its own file in a spool directory as its
bytes arrive. Size limits are checked on every chunk, so an oversized upload is
refused while it is still arriving instead of after it has filled the disk.
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
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

# A body refused before it was read to its end is read on and thrown away first, as
# nginx's lingering_close does: a client that is still sending (httpx always is) and
# finds the connection closed gets a reset instead of our answer. Draining is bounded
# so a slow or endless sender cannot hold a connection: past either bound the answer
# goes out with Connection: close. 1 GiB takes a second or two on a LAN or localhost.
_DRAIN_SECONDS = 5.0
_DRAIN_MAX_BYTES = 1 << 30


class UploadError(Exception):
    """An upload refused with an HTTP status (400 / 413 / 415) and a message for the user.

    `close_connection` is set when the request body was abandoned part-way: the
    response should then carry `headers` (Connection: close), otherwise uvicorn
    keeps reading, and discarding, the rest of a possibly huge body.
    `settle_refusal` clears it when the rest of the body could be drained cheaply.
    """

    def __init__(self, status: int, message: str, *, close_connection: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.close_connection = close_connection

    @property
    def headers(self) -> dict[str, str]:
        return {"Connection": "close"} if self.close_connection else {}


# --------------------------------------------------------------------------- refusing a body


async def settle_refusal(request: Request, error: UploadError, *, body_started: bool = True) -> UploadError:
    """`error`, ready to answer: when it abandons the body part-way, the rest is read
    and discarded first if that is cheap, and the connection then stays open.

    `body_started` is False for a refusal before the body was read: a client that
    sent `Expect: 100-continue` is then still waiting to send it, so nothing is drained.
    Bodies without a Content-Length (chunked) are never drained: they may be endless.
    """
    if not error.close_connection or not await _drained(request, body_started):
        return error
    return UploadError(error.status, error.message)


async def _drained(request: Request, body_started: bool) -> bool:
    """Read and drop the rest of the body; True when it ended within the bounds."""
    declared = declared_length(request)
    if declared is None or declared > _DRAIN_MAX_BYTES:
        return False
    if not body_started and request.headers.get("expect", "").lower() == "100-continue":
        return False
    try:
        async with asyncio.timeout(_DRAIN_SECONDS):
            async for _ in request.stream():
                pass
    except (TimeoutError, ClientDisconnect):
        return False
    except RuntimeError:  # Starlette's "Stream consumed": the body had already ended
        return True
    return True


def declared_length(request: Request) -> int | None:
    """The request's Content-Length, or None (absent, chunked or unreadable)."""
    declared = request.headers.get("content-length")
    return int(declared) if declared is not None and declared.isdigit() else None


async def refuse_declared_oversize(request: Request, max_bytes: int, message: str) -> None:
    """413 `message` for a body whose Content-Length is over `max_bytes`, before reading any of it."""
    declared = declared_length(request)
    if declared is not None and declared > max_bytes:
        raise await settle_refusal(request, UploadError(413, message, close_connection=True), body_started=False)


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


# Well-formed files that are not media we take, named so a client learns what it sent
# (415) instead of being told its file is damaged (400).
_OTHER_FORMATS: tuple[tuple[bytes, str], ...] = (
    (b"%PDF-", "a PDF document"),
    (b"PK\x03\x04", "a ZIP archive"),
    (b"PK\x05\x06", "a ZIP archive"),
    (b"\x1f\x8b", "a gzip archive"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive"),
    (b"Rar!\x1a\x07", "a RAR archive"),
    (b"II*\x00", "a TIFF image, a format we do not decode"),
    (b"MM\x00*", "a TIFF image, a format we do not decode"),
    (b"8BPS", "a Photoshop image, a format we do not decode"),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", "an Office document"),
    (b"SQLite format 3\x00", "an SQLite database"),
    (b"\x7fELF", "an executable"),
)
# Text may hold tabs, newlines and form feeds; other control characters mean binary data.
_TEXT_CONTROLS = frozenset("\t\n\r\f")


def sniff_other_format(head: bytes) -> str | None:
    """What a file that is not media is ("a PDF document", "plain text"), when we can tell."""
    for magic, name in _OTHER_FORMATS:
        if head.startswith(magic):
            return name
    return "plain text" if _is_text(head) else None


def _is_text(head: bytes) -> bool:
    try:
        # Incremental, so a character cut by the end of `head` is not an error.
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return bool(text) and all(c.isprintable() or c in _TEXT_CONTROLS for c in text)


@dataclass(frozen=True)
class DeclaredType:
    """The media kind a client said some bytes are, and where it said so (for messages)."""

    kind: str  # "image" | "video" | "audio"
    source: str  # "image/png", "by the file name 'clip.mp4'", "by its part type 'image_url'"


# File name extensions of the media containers clients send, for parts that come as
# application/octet-stream. A fixed table: the mimetypes module reads the machine's
# /etc/mime.types, which would make the answers differ between hosts.
_EXTENSION_KINDS = {
    **dict.fromkeys(("png", "jpg", "jpeg", "jpe", "gif", "webp", "bmp", "heic", "heif", "avif"), "image"),
    **dict.fromkeys(("mp4", "m4v", "mov", "qt", "mkv", "webm", "avi", "ts", "m2ts", "mts", "flv", "ogv",
                     "mpg", "mpeg", "3gp", "3g2", "wmv"), "video"),
    **dict.fromkeys(("wav", "mp3", "flac", "ogg", "oga", "opus", "m4a", "aac", "aif", "aiff", "aifc", "amr",
                     "caf", "weba", "wma"), "audio"),
}


def declared_type(content_type: str | None = None, filename: str | None = None) -> DeclaredType | None:
    """The media kind declared by a media type (a data: URL's, a part's Content-Type),
    else by a file name's extension; None when neither names image, video or audio."""
    mime = (content_type or "").split(";", 1)[0].strip().lower()
    major = mime.partition("/")[0]
    if major in MEDIA_KINDS:
        return DeclaredType(major, mime)
    name = filename or ""
    kind = _EXTENSION_KINDS.get(name.rpartition(".")[2].lower()) if "." in name else None
    return None if kind is None else DeclaredType(kind, f"by the file name {filename!r}")


def refusal_for_unrecognised(subject: str, head: bytes, declared: DeclaredType | None) -> tuple[int, str]:
    """(HTTP status, message) for bytes that sniff as no media kind we know.

    400 when they are empty, or when the client declared a media kind they are not
    (as OpenAI answers an invalid image); 415 for a recognisable file of another
    kind, and for undeclared bytes we cannot place.
    """
    if not head:
        return 400, f"{subject} is empty"
    other = sniff_other_format(head)
    if other is not None:
        return 415, f"unsupported media type: {subject} is {other}, not an image, video or audio file"
    if declared is not None:
        return 400, f"{subject} is not a valid {declared.kind} (declared {declared.source})"
    return 415, f"unsupported media type: {subject} is not an image, video or audio format we recognize"


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
    declared: DeclaredType | None = None  # what the part's Content-Type or file name said it is
    head: bytes = field(default=b"", repr=False)  # the first SNIFF_BYTES, to explain a refusal

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
        content_type = part.headers.get("content-type", b"").decode("latin-1")
        self.form.files[part.name] = StoredFile(
            id=part.name,
            path=part.path,
            filename=part.filename,
            bytes=part.size,
            media_kind=sniff_media_kind(bytes(part.head)),
            created_at=int(time.time()),
            declared=declared_type(content_type, part.filename),
            head=bytes(part.head),
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


async def parse_multipart(
    request: Request,
    spool_dir: Path,
    max_bytes: int,
    *,
    max_field_bytes: int = 1 << 20,
    max_parts: int = 64,
    stated_limit: int | None = None,
) -> MultipartForm:
    """Stream a multipart/form-data body: fields into memory, file parts into `spool_dir`.

    Raises UploadError (400 malformed / too many parts / client gone, 413 too
    large) after deleting whatever was already spooled. On success the caller
    owns the files and must call `MultipartForm.cleanup()` (or move them).
    `stated_limit` is the limit a 413 names, when `max_bytes` adds room for the
    form around a file whose own limit the user knows.
    """
    too_large = f"upload exceeds the {format_size(stated_limit or max_bytes)} limit"
    try:
        boundary = _boundary(request)
    except UploadError as exc:
        raise await settle_refusal(request, exc, body_started=False) from None
    await refuse_declared_oversize(request, max_bytes, too_large)
    spool_dir.mkdir(parents=True, exist_ok=True)
    builder = _FormBuilder(spool_dir, max_field_bytes, max_parts)
    try:
        parser = MultipartParser(boundary, builder.callbacks())  # type: ignore[arg-type]
        await _feed(request, parser, builder, max_bytes, too_large)
    except (FormParserError, ClientDisconnect, UploadError) as exc:
        builder.discard()
        error = exc if isinstance(exc, UploadError) else _upload_error_for(exc)
        raise await settle_refusal(request, error) from None
    except BaseException:  # cancellation, disk full...: never leave partial files behind
        builder.discard()
        raise
    return builder.form


async def _feed(
    request: Request, parser: MultipartParser, builder: _FormBuilder, max_bytes: int, too_large: str
) -> None:
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > max_bytes:
            raise UploadError(413, too_large, close_connection=True)
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
        form = await parse_multipart(request, self.root, self.max_file_bytes + _FORM_OVERHEAD_BYTES,
                                     stated_limit=self.max_file_bytes)
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
        stored = dataclasses.replace(upload, id=file_id, path=path, purpose=purpose)
        self._files[file_id] = stored
        return stored

    def _validated_upload(self, form: MultipartForm) -> StoredFile:
        upload = form.files.get("file")
        if upload is None:
            raise UploadError(400, "the upload has no 'file' part")
        if upload.bytes > self.max_file_bytes:
            raise UploadError(413, f"upload exceeds the {format_size(self.max_file_bytes)} limit")
        if upload.media_kind is None:  # empty, or not media (or not the media it claims to be)
            raise UploadError(*refusal_for_unrecognised(f"the uploaded file {upload.filename!r}", upload.head,
                                                        upload.declared))
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
