"""/v1/chat/completions on a live server with a multimodal checkpoint: the official
`openai` client, multipart uploads, /v1/files, errors, cancellation, metrics."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from api.models import write_random_multimodal
from llm_core import LLM, SamplingParams
from llm_core.model.chat import ChatTemplate
from llm_core.model.presets import tiny
from tests.api.live import HTTP, LiveServer, live_server

API_KEY = "sk-test-key"


@pytest.fixture(scope="module")
def mm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_multimodal(tmp_path_factory.mktemp("mm") / "tiny-mm", tiny(), seed=0)


@pytest.fixture(scope="module")
def server(mm_checkpoint: Path) -> Iterator[LiveServer]:
    with live_server(mm_checkpoint) as live:
        yield live


@pytest.fixture(scope="module")
def strict_server(mm_checkpoint: Path) -> Iterator[LiveServer]:
    """An API key, a 2 MB upload limit, one request at a time, no prefix cache (so a
    pool at capacity means nothing is held)."""
    with live_server(mm_checkpoint, "--api-key", API_KEY, "--max-upload-mb", "2", "--max-pending-requests", "1",
                     "--no-prefix-caching") as live:
        yield live


def _png(seed: int = 0, size: tuple[int, int] = (80, 60)) -> bytes:
    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _video(path: Path, frames: int, size: tuple[int, int] = (320, 240), noisy: bool = False) -> Path:
    """An MPEG-4 clip; ``noisy`` frames at top quality make ~90 KB per frame."""
    rng = np.random.default_rng(0)
    w, h = size
    tiles = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(8)] if noisy else None
    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg4", rate=25)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        if noisy:
            s.bit_rate, s.options = 100_000_000, {"qmin": "1", "qmax": "2"}
        for i in range(frames):
            if tiles is not None:
                pixels = tiles[i % len(tiles)]
            else:
                pixels = np.full((h, w, 3), (i * 9) % 256, np.uint8)
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = i
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def _offline_reply(checkpoint: Path, text: str, max_tokens: int) -> str:
    llm = LLM(checkpoint)
    prompt = ChatTemplate.from_model_dir(checkpoint).render([{"role": "user", "content": text}])
    out = llm.generate([llm.tokenizer.encode(prompt)], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
    return out.text or ""


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = HTTP.get(f"{url}/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# ---------------------------------------------------------------------------------------


def test_openai_client_text_only_matches_offline(server: LiveServer, mm_checkpoint: Path) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "which way does the red circle move"}]
    result = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == _offline_reply(mm_checkpoint, messages[0]["content"], 10)
    assert result.usage.completion_tokens == 10 and result.usage.prompt_tokens > 5
    raw = client.chat.completions.with_raw_response.create(model="m", messages=messages, max_tokens=2)
    assert raw.headers["x-request-id"] == raw.parse().id and raw.parse().id.startswith("chatcmpl-")
    streamed = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == result.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_openai_client_image_data_url_stream_and_not(server: LiveServer) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    content = [{"type": "text", "text": "what shape is in the picture?"},
               {"type": "image_url", "image_url": {"url": _data_url(_png(1))}}]
    messages = [{"role": "user", "content": content}]
    full = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # really streamed
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # The image's tokens are in the prompt: 80x60 px -> 84x56 -> 6x4 patches -> 6 merged tokens.
    text_only = client.chat.completions.create(model="m", messages=[{"role": "user", "content": content[:1]}],
                                               max_tokens=1)
    assert full.usage.prompt_tokens - text_only.usage.prompt_tokens == 6 + 2  # + vision start/end markers
    # Another picture gives another answer (the embeddings reach the model).
    other = [content[0], {"type": "image_url", "image_url": {"url": _data_url(_png(2))}}]
    again = client.chat.completions.create(model="m", messages=[{"role": "user", "content": other}],
                                           max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content != full.choices[0].message.content


def test_multipart_video_upload_streams_to_disk(server: LiveServer, tmp_path: Path) -> None:
    video = _video(tmp_path / "big.mp4", 560, noisy=True)
    size = video.stat().st_size
    assert size > 45 << 20
    status = Path(f"/proc/{server.pid}/status")
    if not status.exists():
        pytest.skip("needs /proc to measure the server's memory")
    Path(f"/proc/{server.pid}/clear_refs").write_text("5")  # reset the peak RSS

    def rss_kib(field: str) -> int:
        line = next(x for x in status.read_text().splitlines() if x.startswith(field))
        return int(line.split()[1])

    before = rss_kib("VmRSS:")
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "how many times does the light blink?"},
        {"type": "file", "file": {"file_id": "clip"}},
    ]}], "max_tokens": 6}
    sent_all = threading.Event()
    during_upload: list[int] = []

    def sample() -> None:  # the server's RSS while the body is still arriving
        while not sent_all.is_set():
            during_upload.append(rss_kib("VmRSS:"))
            time.sleep(0.005)

    class Upload(io.FileIO):
        def read(self, size: int = -1) -> bytes:
            block = super().read(size)
            if not block:
                sent_all.set()
            return block

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with Upload(video, "rb") as f:  # httpx streams an open file in chunks
            files = {"request": (None, json.dumps(body), "application/json"), "clip": ("clip.mp4", f, "video/mp4")}
            r = HTTP.post(f"{server.url}/v1/chat/completions", files=files, timeout=300)
    finally:
        sent_all.set()
        sampler.join()
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["usage"]["prompt_tokens"] > 16 and answer["choices"][0]["message"]["content"] is not None
    size_mib = size / (1 << 20)
    upload_growth = (max(during_upload) - before) / 1024
    assert len(during_upload) > 10 and upload_growth < size_mib / 5, (
        f"RSS grew {upload_growth:.1f} MiB while receiving a {size_mib:.0f} MiB upload")
    # Decoding the sampled frames and encoding them afterwards costs memory too, but the
    # whole request never came near holding the file.
    peak_growth = (rss_kib("VmHWM:") - before) / 1024
    assert peak_growth < size_mib * 0.75, f"peak RSS grew {peak_growth:.0f} MiB for a {size_mib:.0f} MiB upload"


def test_files_api_upload_once_use_twice(server: LiveServer) -> None:
    up = HTTP.post(f"{server.url}/v1/files", files={"file": ("pic.png", _png(5), "image/png")},
                    data={"purpose": "user_data"}, timeout=60)
    assert up.status_code == 200, up.text
    file_id = up.json()["id"]
    assert file_id.startswith("file-") and up.json()["bytes"] == len(_png(5))
    assert HTTP.get(f"{server.url}/v1/files/{file_id}").json()["filename"] == "pic.png"
    image_hits = ("swallow_embedding_cache_requests_total", (("kind", "image"), ("result", "hit")))
    hits_before = _metrics(server.url).get(image_hits, 0.0)
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what colour?"}, {"type": "file", "file": {"file_id": file_id}}]}],
        "max_tokens": 4, "temperature": 0}
    first = HTTP.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    second = HTTP.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    hits_after = _metrics(server.url)[image_hits]
    assert hits_after >= hits_before + 1  # the second request skipped preprocessing and the encoder
    assert httpx.delete(f"{server.url}/v1/files/{file_id}").json()["deleted"] is True
    gone = HTTP.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert gone.status_code == 400 and file_id in gone.json()["error"]["message"]


def test_audio_and_video_parts(server: LiveServer, tmp_path: Path) -> None:
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        tone = 0.3 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)
        w.writeframes((tone * 32767).astype(np.int16).tobytes())
    clip = _video(tmp_path / "small.mp4", 50).read_bytes()
    content = [
        {"type": "text", "text": "how many beeps do you hear?"},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"}},
        {"type": "video_url", "video_url": {"url": _data_url(clip, "video/mp4")}},
    ]
    r = HTTP.post(f"{server.url}/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": content}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 30


def _chat(url: str, content: object, **extra: object) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4} | extra
    return HTTP.post(f"{url}/v1/chat/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {API_KEY}"})


def _still_serving(server: LiveServer) -> None:
    assert HTTP.get(f"{server.url}/health", timeout=10).status_code == 200
    ok = _chat(server.url, "hello")
    assert ok.status_code == 200, ok.text


def test_api_key(strict_server: LiveServer) -> None:
    url = strict_server.url
    missing = HTTP.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert missing.status_code == 401 and "missing API key" in missing.json()["error"]["message"]
    wrong = HTTP.get(f"{url}/v1/models", headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "invalid API key" in wrong.json()["error"]["message"]
    assert HTTP.get(f"{url}/health").status_code == 200  # health checks need no key
    _still_serving(strict_server)


@pytest.mark.parametrize(
    ("content", "extra", "status", "reason"),
    [
        ([{"type": "hologram"}], {}, 400, "unsupported content part type"),
        ([{"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}], {}, 400, "remote URLs"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], {}, 400, "invalid base64"),
        ([{"type": "image_url", "image_url": {"url": _data_url(_png()[:100] + b"\0" * 200)}}], {}, 400, "image"),
        ([{"type": "image_url", "image_url": {"url": _data_url(b"just some text, not media")}}], {}, 415,
         "unsupported media type"),
        # Bytes that are not what the client declared are a bad request, as at OpenAI.
        ([{"type": "image_url", "image_url": {"url": _data_url(np.random.default_rng(0).bytes(4096))}}], {}, 400,
         "is not a valid image (declared image/png)"),
        ([{"type": "input_audio", "input_audio": {"data": base64.b64encode(b"\0" + np.random.default_rng(1).bytes(4096))
                                                  .decode(), "format": "wav"}}], {}, 400,
         "is not a valid audio (declared by its part type 'input_audio')"),
        ([{"type": "image_url", "image_url": {"url": _data_url(b"%PDF-1.7\n" + bytes(100))}}], {}, 415,
         "is a PDF document"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}], {}, 400, "is empty"),
        ("hi", {"temperature": 10**400}, 400, "'temperature' is out of range"),
        ("hi", {"max_tokens": 9000}, 400, "context length"),
        ("hi", {"max_tokens": "ten"}, 400, "'max_tokens' must be an integer"),
    ],
)
def test_errors_have_status_and_reason(
    strict_server: LiveServer, content: object, extra: dict, status: int, reason: str
) -> None:
    r = _chat(strict_server.url, content, **extra)
    assert r.status_code == status, r.text
    assert reason in r.json()["error"]["message"]
    _still_serving(strict_server)


def test_bad_json_and_upload_limits(strict_server: LiveServer) -> None:
    url, auth = strict_server.url, {"authorization": f"Bearer {API_KEY}"}
    json_headers = auth | {"content-type": "application/json"}
    bad = HTTP.post(f"{url}/v1/chat/completions", content=b"{nope", headers=json_headers)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]

    status, sent = _upload_until_answered(url, total=8 << 20)
    assert status.startswith("HTTP/1.1 413"), status
    assert sent < 8 << 20  # refused while the body was still arriving, not after
    unsupported = HTTP.post(f"{url}/v1/files", headers=auth, files={"file": ("notes.txt", b"plain text " * 50)})
    assert unsupported.status_code == 415 and "unsupported media type" in unsupported.json()["error"]["message"]
    _still_serving(strict_server)


def test_bodies_over_the_limit_reach_the_client_as_413(strict_server: LiveServer) -> None:
    # httpx sends a whole body before reading the answer: the server must drain it,
    # not close the connection under the client (which would be a reset, not a 413).
    url, auth = strict_server.url, {"authorization": f"Bearer {API_KEY}"}
    big = _data_url(b"\0" * (3 << 20))
    with httpx.Client(timeout=60, headers=auth) as client:
        chat = client.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": big}]})
        assert chat.status_code == 413 and "exceeds the 2 MB limit" in chat.json()["error"]["message"]
        upload = client.post(f"{url}/v1/files", files={"file": ("big.png", _png() + b"\0" * (3 << 20), "image/png")})
        assert upload.status_code == 413 and "exceeds the 2 MB limit" in upload.json()["error"]["message"]
        assert "close" not in (chat.headers.get("connection", "") + upload.headers.get("connection", ""))
    _still_serving(strict_server)


def test_too_deep_json_is_400(strict_server: LiveServer) -> None:
    url, auth = strict_server.url, {"authorization": f"Bearer {API_KEY}"}
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    as_body = HTTP.post(f"{url}/v1/chat/completions", content=deep,
                         headers=auth | {"content-type": "application/json"}, timeout=60)
    assert as_body.status_code == 400
    assert as_body.json()["error"]["message"] == "request body is not valid JSON: it nests too deeply"
    as_part = HTTP.post(f"{url}/v1/chat/completions", files={"request": (None, deep, "application/json")},
                         headers=auth, timeout=60)
    assert as_part.status_code == 400
    assert as_part.json()["error"]["message"] == "the 'request' part is not valid JSON: it nests too deeply"
    _still_serving(strict_server)


def test_multipart_parts_that_are_not_what_they_claim(strict_server: LiveServer) -> None:
    url, auth = strict_server.url, {"authorization": f"Bearer {API_KEY}"}

    def send(filename: str, data: bytes) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "clip"}}]}]}
        files = {"request": (None, json.dumps(body), "application/json"), "clip": (filename, data)}
        return HTTP.post(f"{url}/v1/chat/completions", files=files, headers=auth, timeout=60)

    random_mp4 = send("clip.mp4", np.random.default_rng(0).bytes(4096))
    assert random_mp4.status_code == 400, random_mp4.text
    assert "is not a valid video (declared video/mp4)" in random_mp4.json()["error"]["message"]
    empty = send("clip.mp4", b"")
    assert empty.status_code == 400 and "is empty" in empty.json()["error"]["message"]
    upload = HTTP.post(f"{url}/v1/files", headers=auth, files={"file": ("clip.mp4", b"")})
    assert upload.status_code == 400 and "is empty" in upload.json()["error"]["message"]
    _still_serving(strict_server)


def test_queue_full_is_429(strict_server: LiveServer) -> None:
    url, auth = strict_server.url, {"authorization": f"Bearer {API_KEY}"}
    body = {"messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                                           headers=auth) as long:
        lines = long.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # the long request is running
        r = _chat(url, "me too")
        assert r.status_code == 429 and "capacity" in r.json()["error"]["message"]
    _wait_idle(strict_server)
    _still_serving(strict_server)


def _upload_until_answered(url: str, total: int) -> tuple[str, int]:
    """Stream a chunked multipart upload of ``total`` bytes over a raw socket, a bit at a
    time, and stop as soon as the server answers. Returns (status line, bytes sent)."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    boundary = "swallowtestboundary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"clip\"; filename=\"big.mp4\"\r\n"
            "Content-Type: video/mp4\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                      f"Authorization: Bearer {API_KEY}\r\nTransfer-Encoding: chunked\r\n"
                      f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n").encode())
        sent, piece = 0, b"\0" * (64 << 10)
        sock.sendall(b"%x\r\n%s\r\n" % (len(head), head))
        sock.setblocking(False)
        while sent < total:
            try:
                reply = sock.recv(4096)
                if reply:
                    return reply.split(b"\r\n", 1)[0].decode(), sent
            except BlockingIOError:
                pass
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                time.sleep(0.01)
                continue
            sent += len(piece)
            time.sleep(0.002)
        sock.setblocking(True)
        return sock.recv(4096).split(b"\r\n", 1)[0].decode(), sent


def _wait_idle(server: LiveServer, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(server.url)
        used = {pool: m.get(("swallow_kv_pool_used_tokens", (("pool", pool),)), -1) for pool in ("full", "swa")}
        if m.get(("swallow_requests_running", ()), -1) == 0 and used == {"full": 0, "swa": 0}:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"KV not released: used={used}, running={m.get(('swallow_requests_running', ()))}")
        time.sleep(0.2)


def test_cancelled_stream_frees_kv(strict_server: LiveServer) -> None:
    url, auth = strict_server.url, {"authorization": f"Bearer {API_KEY}"}
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "describe the picture at length"},
        {"type": "image_url", "image_url": {"url": _data_url(_png(3))}}]}],
        "max_tokens": 1000, "ignore_eos": True, "stream": True}
    seen = threading.Event()
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                                           headers=auth) as stream:
        got = 0
        for line in stream.iter_lines():
            if line.startswith("data:"):
                got += 1
            if got >= 4:
                seen.set()
                break  # leave mid-stream: the connection closes with the `with`
    assert seen.is_set()
    metrics = _wait_idle(strict_server)
    generated = metrics[("swallow_generation_tokens_total", ())]
    assert generated < 1000  # the request stopped early instead of running to max_tokens
    _still_serving(strict_server)
