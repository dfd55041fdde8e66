"""Streaming uploads of large media: multipart bodies spooled to disk, and the
files `/v1/files` keeps for later requests to name.

Videos of hundreds of MB must not pass through memory (nor through base64), so
request bodies are fed chunk by chunk into python_multipart's streaming parser
and every file part is written to its own file in a spool directory as its
bytes arrive. Size limits are checked on every chunk, so an oversized upload is
refused while it is still arriving instead of after it has filled the disk.
"""

from __future__ import annotations

import asyncio
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

from api.body_refusal import UploadError, format_size, refuse_declared_oversize, settle_refusal
from api.media_sniff import SNIFF_BYTES, DeclaredType, declared_type, refusal_for_unrecognised, sniff_media_kind

# Spooled files carry this prefix so leftovers of a crashed server are ours to delete.
_SPOOL_PREFIX = "upload-"

# Room for the multipart framing and the `purpose` field around a /v1/files upload.
_FORM_OVERHEAD_BYTES = 64 << 10


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
