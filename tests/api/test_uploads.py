"""Streaming uploads against a real uvicorn server on localhost.

The routes here are small stand-ins for the real ones: they call
parse_multipart / FileStore and turn UploadError into a JSON error, as the
server does. Uploads are streamed by httpx from generators, so the server sees
a body that arrives over time and has to enforce limits while it does.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api import body_refusal
from api.body_refusal import UploadError
from api.media_sniff import DeclaredType, declared_type, refusal_for_unrecognised, sniff_media_kind, sniff_other_format
from api.uploads import FileStore, parse_multipart

BOUNDARY = "swallow-test-boundary"
FORM_LIMIT = 2 << 20  # bytes per /form request
STORE_LIMIT = 1 << 20  # bytes per /v1/files file
MiB = 1 << 20


# --------------------------------------------------------------------------- media headers

def png(extra: int = 0) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + bytes(extra)


def mp4(brand: bytes = b"isom") -> bytes:
    return struct.pack(">I", 24) + b"ftyp" + brand + b"\x00\x00\x02\x00" + b"isommp41"


def riff(form: bytes) -> bytes:
    return b"RIFF" + struct.pack("<I", 1000) + form


def bmp() -> bytes:
    return b"BM" + struct.pack("<IHHI", 1000, 0, 0, 54) + struct.pack("<I", 40) + bytes(16)


def mpeg_ts() -> bytes:
    packet = b"\x47\x40\x00\x10" + b"\xff" * 184
    return packet * 2


SIGNATURES: list[tuple[str, bytes, str | None]] = [
    ("jpeg", b"\xff\xd8\xff\xe0\x00\x10JFIF\x00", "image"),
    ("png", png(), "image"),
    ("gif87", b"GIF87a\x01\x00\x01\x00", "image"),
    ("gif89", b"GIF89a\x01\x00\x01\x00", "image"),
    ("webp", riff(b"WEBPVP8 "), "image"),
    ("bmp", bmp(), "image"),
    ("heic", mp4(b"heic"), "image"),
    ("avif", mp4(b"avif"), "image"),
    ("mp4", mp4(b"isom"), "video"),
    ("mov", mp4(b"qt  "), "video"),
    ("3gp", mp4(b"3gp4"), "video"),
    ("old quicktime", struct.pack(">I", 1000) + b"moov", "video"),
    ("m4a", mp4(b"M4A "), "audio"),
    ("m4b", mp4(b"M4B "), "audio"),
    ("f4a", mp4(b"F4A "), "audio"),
    ("matroska", b"\x1a\x45\xdf\xa3\x9f\x42\x86\x81\x01", "video"),
    ("avi", riff(b"AVI LIST"), "video"),
    ("mpeg-ts", mpeg_ts(), "video"),
    ("m2ts", b"\x00\x00\x00\x00" + b"\x47" + bytes(191) + b"\x47" + bytes(10), "video"),
    ("flv", b"FLV\x01\x05\x00\x00\x00\x09", "video"),
    ("mpeg-ps", b"\x00\x00\x01\xba\x44\x00\x04\x00", "video"),
    ("ogg theora", b"OggS\x00\x02" + bytes(22) + b"\x01\x2a\x80theora", "video"),
    ("wav", riff(b"WAVEfmt "), "audio"),
    ("flac", b"fLaC\x00\x00\x00\x22", "audio"),
    ("ogg vorbis", b"OggS\x00\x02" + bytes(22) + b"\x01\x1e\x01vorbis", "audio"),
    ("mp3 id3", b"ID3\x04\x00\x00\x00\x00\x00\x00", "audio"),
    ("mp3 frame", b"\xff\xfb\x90\x64\x00", "audio"),  # MPEG-1 layer III, 128 kbit/s, 44.1 kHz
    ("mp2 frame", b"\xff\xfd\x90\x64\x00", "audio"),
    ("aac adts", b"\xff\xf1\x50\x80\x02\x1f\xfc", "audio"),
    ("aac adts mpeg2", b"\xff\xf9\x50\x80\x02\x1f\xfc", "audio"),
    ("aiff", b"FORM\x00\x00\x10\x00AIFFCOMM", "audio"),
    ("aifc", b"FORM\x00\x00\x10\x00AIFCFVER", "audio"),
    ("amr", b"#!AMR\n\x3c", "audio"),
    ("amr-wb", b"#!AMR-WB\n", "audio"),
    ("caf", b"caff\x00\x01\x00\x00desc", "audio"),
    ("text", b"hello, this is plain text\n" * 4, None),
    ("text starting BM", b"BMW owners club newsletter\n", None),
    ("json", b'{"model": "swallow"}', None),
    ("zip", b"PK\x03\x04\x14\x00\x00\x00\x08\x00", None),
    ("pdf", b"%PDF-1.7\n", None),
    ("lone ts sync byte", b"\x47" + bytes(300), None),
    ("empty", b"", None),
    ("short", b"\xff", None),
]


@pytest.mark.parametrize(("head", "kind"), [(h, k) for _, h, k in SIGNATURES], ids=[n for n, _, _ in SIGNATURES])
def test_sniff_media_kind(head: bytes, kind: str | None) -> None:
    assert sniff_media_kind(head) == kind


RANDOM_BYTES = random.Random(0).randbytes(4096)


@pytest.mark.parametrize(
    ("head", "name"),
    [
        (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3", "a PDF document"),
        (b"PK\x03\x04\x14\x00", "a ZIP archive"),
        (b"II*\x00\x08\x00\x00\x00", "a TIFF image, a format we do not decode"),
        (b"MM\x00*\x00\x00\x00\x08", "a TIFF image, a format we do not decode"),
        (b"notes about the trip\n\tday 1: caf\xc3", "plain text"),  # a UTF-8 character cut by the end
        (RANDOM_BYTES, None),
        (b"text\x00with a NUL", None),
        (b"", None),
    ],
    ids=["pdf", "zip", "tiff le", "tiff be", "text", "random", "nul", "empty"],
)
def test_sniff_other_format(head: bytes, name: str | None) -> None:
    assert sniff_other_format(head) == name


@pytest.mark.parametrize(
    ("content_type", "filename", "declared"),
    [
        ("image/png", None, DeclaredType("image", "image/png")),
        ("Video/MP4; codecs=avc1", "x.bin", DeclaredType("video", "video/mp4")),  # the media type wins
        ("application/octet-stream", "clip.MP4", DeclaredType("video", "by the file name 'clip.MP4'")),
        (None, "song.flac", DeclaredType("audio", "by the file name 'song.flac'")),
        ("text/plain", "notes.txt", None),
        ("application/octet-stream", "no-extension", None),
        (None, None, None),
    ],
)
def test_declared_type(content_type: str | None, filename: str | None, declared: DeclaredType | None) -> None:
    assert declared_type(content_type, filename) == declared


@pytest.mark.parametrize(
    ("head", "declared", "status", "message"),
    [
        (b"", DeclaredType("image", "image/png"), 400, "x is empty"),
        (RANDOM_BYTES, DeclaredType("image", "image/png"), 400, "x is not a valid image (declared image/png)"),
        (RANDOM_BYTES, None, 415, "unsupported media type: x is not an image, video or audio format we recognize"),
        (b"%PDF-1.4", DeclaredType("image", "image/png"), 415,
         "unsupported media type: x is a PDF document, not an image, video or audio file"),
    ],
    ids=["empty", "declared", "undeclared", "another format"],
)
def test_refusal_for_unrecognised(head: bytes, declared: DeclaredType | None, status: int, message: str) -> None:
    assert refusal_for_unrecognised("x", head, declared) == (status, message)


# --------------------------------------------------------------------------- multipart bodies

def part_header(name: str, filename: str | None = None, content_type: str = "application/octet-stream") -> bytes:
    disposition = f'form-data; name="{name}"' + ("" if filename is None else f'; filename="{filename}"')
    lines = [f"--{BOUNDARY}", f"Content-Disposition: {disposition}"]
    if filename is not None:
        lines.append(f"Content-Type: {content_type}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes]]) -> bytes:
    body = b""
    for name, value in fields.items():
        body += part_header(name) + value.encode() + b"\r\n"
    for name, (filename, data) in files.items():
        body += part_header(name, filename) + data + b"\r\n"
    return body + f"--{BOUNDARY}--\r\n".encode()


def streamed_file_body(name: str, filename: str, head: bytes, total: int, chunk: int = 256 << 10,
                       sent: list[int] | None = None) -> Iterator[bytes]:
    """A multipart body with one `total`-byte file part, produced chunk by chunk (no Content-Length)."""
    yield part_header(name, filename)
    block = (head + bytes(range(256)) * (chunk // 256 + 1))[:chunk]
    left = total
    while left > 0:
        piece = block[:min(chunk, left)]
        left -= len(piece)
        if sent is not None:
            sent.append(len(piece))
        yield piece
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


MULTIPART = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}


# --------------------------------------------------------------------------- server under test

def error_response(exc: UploadError) -> JSONResponse:
    return JSONResponse({"error": {"message": exc.message}}, status_code=exc.status, headers=exc.headers)


def make_app(spool: Path, store: FileStore, failures: list[UploadError]) -> Starlette:
    async def form(request: Request) -> Response:
        limits = {k: int(v) for k, v in request.query_params.items()}
        try:
            parsed = await parse_multipart(request, spool, limits.pop("max_bytes", FORM_LIMIT), **limits)
        except UploadError as exc:
            failures.append(exc)
            return error_response(exc)
        files = {
            name: {"id": f.id, "path": str(f.path), "filename": f.filename, "bytes": f.bytes, "kind": f.media_kind,
                   "declared": None if f.declared is None else f.declared.kind}
            for name, f in parsed.files.items()
        }
        return JSONResponse({"fields": parsed.fields, "files": files})

    async def upload(request: Request) -> Response:
        try:
            return JSONResponse((await store.save_upload(request)).to_openai())
        except UploadError as exc:
            return error_response(exc)

    async def get_file(request: Request) -> Response:
        stored = store.get(request.path_params["file_id"])
        if stored is None:
            return JSONResponse({"error": {"message": "no such file"}}, status_code=404)
        return JSONResponse(stored.to_openai() | {"media_kind": stored.media_kind, "path": str(stored.path)})

    async def delete_file(request: Request) -> Response:
        file_id = request.path_params["file_id"]
        return JSONResponse({"id": file_id, "object": "file", "deleted": store.delete(file_id)})

    async def list_files(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [f.to_openai() for f in store.list()]})

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[
        Route("/form", form, methods=["POST"]),
        Route("/v1/files", upload, methods=["POST"]),
        Route("/v1/files", list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", get_file, methods=["GET"]),
        Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
        Route("/health", health),
    ])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app: Starlette) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class Server:
    def __init__(self, url: str, spool: Path, store: FileStore, failures: list[UploadError]) -> None:
        self.url, self.spool, self.store, self.failures = url, spool, store, failures

    def spooled(self) -> list[Path]:
        # The spool is made by the first upload parsed: a test that runs first (alone, or on an
        # xdist worker) refuses its upload before that, and finds none.
        return sorted(self.spool.iterdir()) if self.spool.exists() else []

    def assert_answers(self) -> None:
        assert httpx.get(f"{self.url}/health", timeout=5).json() == {"status": "ok"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("uploads")
    spool, store = root / "spool", FileStore(root / "files", max_file_bytes=STORE_LIMIT)
    failures: list[UploadError] = []
    with serve_in_thread(make_app(spool, store, failures)) as url:
        yield Server(url, spool, store, failures)
    store.close()


@pytest.fixture
def srv(server: Server) -> Iterator[Server]:
    """The shared server, with the spool dir emptied after each test."""
    server.failures.clear()
    yield server
    for path in server.spool.glob("*"):
        path.unlink()


def post_form(
    srv: Server, body: bytes | Iterator[bytes], query: str = "", headers: dict[str, str] | None = None
) -> httpx.Response:
    headers = MULTIPART if headers is None else headers
    return httpx.post(f"{srv.url}/form{query}", content=body, headers=headers, timeout=30)


# --------------------------------------------------------------------------- parse_multipart

def test_json_request_and_two_files_land_on_disk_byte_exact(srv: Server) -> None:
    video = mp4() + os.urandom(700_000)
    image = png(extra=50_000)
    request_json = json.dumps({"model": "swallow", "messages": [{"role": "user", "content": "hi ✓"}]})
    body = multipart({"request": request_json}, {"clip": ("my clip.mp4", video), "photo": ("cat.png", image)})
    # Small chunks so parts straddle chunk (and boundary-lookalike) edges.
    chunks = (body[i:i + 7_919] for i in range(0, len(body), 7_919))

    response = post_form(srv, chunks)

    assert response.status_code == 200, response.text
    result = response.json()
    assert json.loads(result["fields"]["request"]) == json.loads(request_json)
    clip, photo = result["files"]["clip"], result["files"]["photo"]
    assert (clip["id"], clip["filename"], clip["bytes"], clip["kind"]) == ("clip", "my clip.mp4", len(video), "video")
    assert (photo["id"], photo["filename"], photo["bytes"], photo["kind"]) == ("photo", "cat.png", len(image), "image")
    assert Path(clip["path"]).read_bytes() == video
    assert Path(photo["path"]).read_bytes() == image
    assert {Path(clip["path"]), Path(photo["path"])} == set(srv.spooled())


def test_file_containing_boundary_lookalikes_is_byte_exact(srv: Server) -> None:
    # Each lookalike is one byte short of a delimiter; the byte after "--{BOUNDARY}-" is never
    # "-", which would make it the closing delimiter (random bytes did, once in ~150 runs).
    tricky = png() + (f"\r\n--{BOUNDARY[:-1]}\r\n--{BOUNDARY}-".encode() + b"x" + os.urandom(998)) * 200
    response = post_form(srv, multipart({}, {"f": ("x.png", tricky)}))
    assert response.status_code == 200, response.text
    assert Path(response.json()["files"]["f"]["path"]).read_bytes() == tricky


def test_unknown_file_type_is_kept_with_no_media_kind(srv: Server) -> None:
    response = post_form(srv, multipart({}, {"notes": ("notes.txt", b"just text")}))
    assert response.json()["files"]["notes"]["kind"] is None


def test_a_part_keeps_the_kind_its_content_type_or_name_declares(srv: Server) -> None:
    body = (part_header("a", "upload", "audio/wav") + b"x\r\n" + part_header("b", "clip.mkv") + b"x\r\n"
            + part_header("c", "data.bin") + b"x\r\n" + f"--{BOUNDARY}--\r\n".encode())
    files = post_form(srv, body).json()["files"]
    assert {name: f["declared"] for name, f in files.items()} == {"a": "audio", "b": "video", "c": None}


def test_body_over_limit_gets_413_while_still_uploading(srv: Server) -> None:
    sent: list[int] = []
    total = 256 * MiB  # far more than the kernel's socket buffers could swallow
    body = streamed_file_body("clip", "big.mp4", mp4(), total, sent=sent)

    response = post_form(srv, body)

    assert response.status_code == 413
    assert response.json()["error"]["message"] == "upload exceeds the 2 MB limit"
    assert sum(sent) < total // 4, "the server read the whole body before refusing it"
    assert srv.failures[-1].status == 413
    assert srv.spooled() == []
    srv.assert_answers()


def test_declared_length_over_limit_gets_413_before_any_body_is_sent(srv: Server) -> None:
    port = int(srv.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /form HTTP/1.1\r\nHost: localhost\r\n"
            + f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n".encode()
            + b"Content-Length: 10000000000\r\n\r\n"  # past the drain budget: answered at once, then closed
        )
        reply = b""
        while chunk := sock.recv(65536):  # the server closes the connection after its answer
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
    assert b"upload exceeds the 2 MB limit" in reply
    assert srv.spooled() == []
    srv.assert_answers()


def test_declared_length_over_limit_is_drained_so_the_client_reads_the_413(srv: Server) -> None:
    # httpx sends the whole body before it reads: had the server closed the connection
    # at once, the client would see a reset instead of the answer.
    body = multipart({}, {"clip": ("big.mp4", mp4() + bytes(3 * MiB))})
    with httpx.Client(timeout=30) as client:
        refused = client.post(f"{srv.url}/form", content=body, headers=MULTIPART)
        assert refused.status_code == 413
        assert refused.json()["error"]["message"] == "upload exceeds the 2 MB limit"
        assert refused.headers.get("connection") != "close"  # the body was drained: keep-alive goes on
        assert client.get(f"{srv.url}/health").status_code == 200
    assert srv.spooled() == []


def test_malformed_body_with_a_declared_length_is_drained_so_the_client_reads_the_400(srv: Server) -> None:
    files = {f"f{i}": (f"{i}.png", png(1000)) for i in range(4000)}  # ~4 MB: more than socket buffers hold
    with httpx.Client(timeout=30) as client:
        refused = client.post(f"{srv.url}/form?max_parts=3&max_bytes={64 * MiB}", content=multipart({}, files),
                              headers=MULTIPART)
        assert refused.status_code == 400
        assert "more than 3 parts" in refused.json()["error"]["message"]
        assert refused.headers.get("connection") != "close"
    assert srv.spooled() == []


def raw_request(srv: Server, head: bytes, body: bytes = b"") -> tuple[bytes, float]:
    """Send `head` and `body` on a fresh connection and read until the server closes it:
    (everything it answered, seconds from the last byte sent to the close)."""
    port = int(srv.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(head + body)
        started, reply = time.monotonic(), b""
        while chunk := sock.recv(65536):
            reply += chunk
        return reply, time.monotonic() - started


def form_head(content_length: int, *extra: str) -> bytes:
    lines = ["POST /form HTTP/1.1", "Host: localhost", f"Content-Type: multipart/form-data; boundary={BOUNDARY}",
             f"Content-Length: {content_length}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_expect_100_continue_over_limit_is_answered_at_once_and_closed(srv: Server) -> None:
    # The client waits for "100 Continue" before sending the body: there is nothing to drain.
    reply, seconds = raw_request(srv, form_head(3 * MiB, "Expect: 100-continue"))
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
    assert b"connection: close" in reply.lower() and b"100 Continue" not in reply
    assert seconds < body_refusal._DRAIN_SECONDS
    srv.assert_answers()


def test_declared_body_that_never_ends_gets_413_and_close_after_the_drain_deadline(
    srv: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(body_refusal, "_DRAIN_SECONDS", 0.5)  # the server runs in this process
    reply, seconds = raw_request(srv, form_head(3 * MiB), part_header("clip", "big.mp4") + bytes(MiB))
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
    assert b"connection: close" in reply.lower()
    assert 0.4 < seconds < 5
    assert srv.spooled() == []
    srv.assert_answers()


def test_complete_body_just_over_limit_gets_413_and_no_files(srv: Server) -> None:
    body = multipart({"request": "{}"}, {"a": ("a.png", png(1000)), "b": ("b.png", png(FORM_LIMIT))})
    response = post_form(srv, iter([body[i:i + 65536] for i in range(0, len(body), 65536)]))
    assert response.status_code == 413
    assert srv.spooled() == []


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("multipart/form-data", multipart({"a": "1"}, {})),
        ("multipart/form-data; boundary=", multipart({"a": "1"}, {})),
        ("application/json", b'{"a": 1}'),
        (None, b"x"),
    ],
    ids=["no boundary", "empty boundary", "json", "no content type"],
)
def test_not_multipart_with_boundary_is_400(srv: Server, content_type: str | None, body: bytes) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = post_form(srv, body, headers=headers)
    assert response.status_code == 400
    assert "multipart/form-data" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        b"this is not multipart at all",
        b"",
        part_header("f", "x.png") + png(100),  # truncated: no closing boundary
        f"--{BOUNDARY}\r\nContent-Disposition: form-data\r\n\r\nvalue\r\n--{BOUNDARY}--\r\n".encode(),  # no name
        f"--{BOUNDARY}\r\nX-Other: 1\r\n\r\nvalue\r\n--{BOUNDARY}--\r\n".encode(),  # no disposition
        f"--{BOUNDARY}\r\nbroken header line\r\n\r\nvalue\r\n--{BOUNDARY}--\r\n".encode(),
        multipart({"request": "{}"}, {"request": ("a.png", png())}),  # same name twice
        part_header("request") + b"\xff\xfe{}\r\n" + f"--{BOUNDARY}--\r\n".encode(),  # not UTF-8
    ],
    ids=["garbage", "empty", "truncated", "no name", "no disposition", "bad header", "duplicate", "not utf-8"],
)
def test_malformed_multipart_is_400_and_leaves_no_files(srv: Server, body: bytes) -> None:
    response = post_form(srv, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]
    assert srv.spooled() == []
    srv.assert_answers()


def test_too_many_parts_is_400(srv: Server) -> None:
    files = {f"f{i}": (f"{i}.png", png()) for i in range(4)}
    response = post_form(srv, multipart({}, files), query="?max_parts=3")
    assert response.status_code == 400
    assert "more than 3 parts" in response.json()["error"]["message"]
    assert srv.spooled() == []


def test_field_over_field_limit_is_413(srv: Server) -> None:
    response = post_form(srv, multipart({"request": "x" * 2000}, {}), query="?max_field_bytes=1024")
    assert response.status_code == 413
    assert "'request' exceeds the 1 KB limit" in response.json()["error"]["message"]


def test_client_disconnect_mid_upload_deletes_partial_file(srv: Server) -> None:
    def body() -> Iterator[bytes]:
        yield part_header("clip", "c.mp4")
        yield mp4() + bytes(512 << 10)
        wait_for(srv.spooled)  # the server has started writing the part
        raise ConnectionAbortedError("client gave up")

    with pytest.raises(ConnectionAbortedError):
        post_form(srv, body())
    wait_for(lambda: srv.failures and srv.spooled() == [])
    assert srv.failures[-1].status == 400
    assert "disconnected" in srv.failures[-1].message
    srv.assert_answers()


def wait_for(condition: Callable[[], object], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


# --------------------------------------------------------------------------- FileStore

def post_file(srv: Server, body: bytes) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/files", content=body, headers=MULTIPART, timeout=30)


def test_file_store_save_get_list_delete(srv: Server) -> None:
    video = mp4() + os.urandom(300_000)
    response = post_file(srv, multipart({"purpose": "vision"}, {"file": ("holiday.mp4", video)}))

    assert response.status_code == 200, response.text
    created = response.json()
    assert created["object"] == "file" and created["id"].startswith("file-") and len(created["id"]) == 29
    assert all(c in "0123456789abcdef" for c in created["id"][5:])
    assert (created["bytes"], created["filename"], created["purpose"]) == (len(video), "holiday.mp4", "vision")
    assert abs(created["created_at"] - time.time()) < 60

    stored = httpx.get(f"{srv.url}/v1/files/{created['id']}").json()
    assert stored["media_kind"] == "video"
    assert Path(stored["path"]).read_bytes() == video
    assert created["id"] in [f["id"] for f in httpx.get(f"{srv.url}/v1/files").json()["data"]]
    assert srv.spooled() == []

    assert httpx.delete(f"{srv.url}/v1/files/{created['id']}").json()["deleted"] is True
    assert not Path(stored["path"]).exists()
    assert httpx.get(f"{srv.url}/v1/files/{created['id']}").status_code == 404
    assert httpx.delete(f"{srv.url}/v1/files/{created['id']}").json()["deleted"] is False


def test_file_store_default_purpose_and_streamed_upload(srv: Server) -> None:
    body = streamed_file_body("file", "song.flac", b"fLaC\x00\x00\x00\x22", 600_000)
    response = httpx.post(f"{srv.url}/v1/files", content=body, headers=MULTIPART, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["purpose"] == "user_data"
    assert srv.store.get(response.json()["id"]).media_kind == "audio"
    assert srv.store.delete(response.json()["id"])


def test_file_store_extra_file_parts_are_not_kept(srv: Server) -> None:
    before = set(srv.store.root.iterdir())
    body = multipart({}, {"file": ("a.png", png()), "other": ("b.png", png())})
    file_id = post_file(srv, body).json()["id"]
    assert set(srv.store.root.iterdir()) - before == {srv.store.get(file_id).path}
    srv.store.delete(file_id)


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (multipart({}, {"file": ("notes.txt", b"plain text, not media")}), 415, "unsupported media type"),
        (multipart({}, {"file": ("doc.png", b"%PDF-1.7\n" + RANDOM_BYTES)}), 415, "'doc.png' is a PDF document"),
        (multipart({}, {"file": ("blob.bin", RANDOM_BYTES)}), 415, "not an image, video or audio format we recognize"),
        (multipart({}, {"file": ("clip.mp4", RANDOM_BYTES)}), 400,
         "'clip.mp4' is not a valid video (declared by the file name 'clip.mp4')"),
        (part_header("file", "upload", "image/png") + RANDOM_BYTES + f"\r\n--{BOUNDARY}--\r\n".encode(), 400,
         "'upload' is not a valid image (declared image/png)"),
        (multipart({}, {"file": ("empty.png", b"")}), 400, "is empty"),
        (multipart({"purpose": "vision"}, {}), 400, "no 'file' part"),
        (multipart({}, {"upload": ("a.png", png())}), 400, "no 'file' part"),
        (multipart({}, {"file": ("big.png", png(STORE_LIMIT))}), 413, "exceeds the 1 MB limit"),
    ],
    ids=["text file", "pdf named png", "random bytes", "random mp4", "random image/png", "empty file", "no file part",
         "wrong part name", "too large"],
)
def test_file_store_rejections(srv: Server, body: bytes, status: int, message: str) -> None:
    before = set(srv.store.root.iterdir())
    response = post_file(srv, body)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]
    assert set(srv.store.root.iterdir()) == before


def test_file_store_close_deletes_everything(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "files", max_file_bytes=MiB)
    leftover = store.root / "upload-crashed"
    leftover.write_bytes(b"partial")
    with serve_in_thread(make_app(tmp_path / "spool", store, [])) as url:
        for _ in range(2):
            assert httpx.post(f"{url}/v1/files", content=multipart({}, {"file": ("a.png", png())}),
                              headers=MULTIPART).status_code == 200
    assert len(store.list()) == 2
    store.close()
    assert store.list() == [] and list(store.root.iterdir()) == []


def test_upload_error_carries_status_and_message() -> None:
    error = UploadError(413, "too big")
    assert (error.status, error.message, str(error)) == (413, "too big", "too big")
    assert error.headers == {}
    assert UploadError(413, "too big", close_connection=True).headers == {"Connection": "close"}


# --------------------------------------------------------------------------- memory

def serve_for_memory_test(port: int, spool: str) -> None:
    """Entry point of the subprocess: a server whose RSS the test watches."""

    async def form(request: Request) -> Response:
        try:
            parsed = await parse_multipart(request, Path(spool), 256 * MiB)
        except UploadError as exc:
            return error_response(exc)
        sizes = {name: f.bytes for name, f in parsed.files.items()}
        parsed.cleanup()
        return JSONResponse({"pid": os.getpid(), "sizes": sizes})

    app = Starlette(routes=[Route("/form", form, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc status")


@pytest.fixture
def memory_server(tmp_path: Path) -> Iterator[tuple[str, int]]:
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc")
    port = free_port()
    code = f"from tests.api.test_uploads import serve_for_memory_test; serve_for_memory_test({port}, {str(tmp_path)!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parents[2])
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "memory test server did not start"
                time.sleep(0.1)
        try:
            Path(f"/proc/{proc.pid}/clear_refs").write_text("5")
        except OSError:
            pytest.skip("cannot reset the peak RSS through /proc/<pid>/clear_refs")
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_large_upload_memory_stays_flat(memory_server: tuple[str, int]) -> None:
    url, pid = memory_server
    size = 50 * MiB

    def upload(total: int) -> dict:
        body = streamed_file_body("clip", "clip.mp4", mp4(), total, chunk=MiB)
        response = httpx.post(f"{url}/form", content=body, headers=MULTIPART, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    upload(2 * MiB)  # warm up: lazy imports, worker threads, allocator arenas
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    baseline = peak_rss_kib(pid)

    assert upload(size)["sizes"] == {"clip": size}

    growth_mib = (peak_rss_kib(pid) - baseline) / 1024
    assert growth_mib < 15, f"peak RSS grew {growth_mib:.1f} MiB for a {size // MiB} MiB upload"
