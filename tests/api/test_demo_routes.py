"""The routes behind the demo page, on a live server of the demo model: the
sample gallery, the panel's /metrics/summary, the media-cache header, and the
demo tool run on an uploaded file."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from demo.samples import GALLERY
from demo.tasks import make_sample
from demo.tool_spec import tool_exchange
from tests.api.live import HTTP, LiveServer


@pytest.fixture(scope="module")
def server(demo_server: LiveServer) -> str:
    return demo_server.url


def _upload(url: str, name: str, data: bytes, media_type: str) -> str:
    response = HTTP.post(f"{url}/v1/files", files={"file": (name, data, media_type)}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["id"]


def test_gallery_lists_and_serves_every_sample(server: str) -> None:
    gallery = HTTP.get(f"{server}/demo/samples", timeout=60).json()
    assert [s["name"] for s in gallery["samples"]] == [spec.name for spec in GALLERY]
    for sample in gallery["samples"]:
        response = HTTP.get(f"{server}/{sample['url']}", timeout=60)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith(sample["media_type"])
        assert len(response.content) == sample["bytes"]
    assert set(gallery["questions_by_kind"]) == {"video", "image", "audio"}
    missing = HTTP.get(f"{server}/demo/samples/nope", timeout=10)
    assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]


def test_second_question_about_a_clip_reports_both_caches(server: str) -> None:
    clip = HTTP.get(f"{server}/demo/samples/moving-shape", timeout=60).content
    file_id = _upload(server, "clip.mp4", clip, "video/mp4")

    def ask(question: str) -> httpx.Response:
        content = [{"type": "file", "file": {"file_id": file_id}}, {"type": "text", "text": question}]
        return HTTP.post(f"{server}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": content}], "max_tokens": 30, "temperature": 0})

    first = ask("Which way does the shape move?")
    assert first.headers["x-swallow-media-cache"] == "hits=0; items=1"
    second = ask("Describe the video.")
    assert second.headers["x-swallow-media-cache"] == "hits=1; items=1"
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    summary = HTTP.get(f"{server}/metrics/summary", timeout=10).json()
    assert summary["embedding_cache_hits"] >= 1 and summary["prefix_cache_cached_tokens"] > 0
    assert summary["kv_bytes_full_attention"] >= summary["kv_bytes_in_use"] > 0
    assert summary["kv_capacity_gain"] > 2


@pytest.mark.parametrize("prop", ["frame_rate", "width", "height", "duration"])
def test_the_demo_tool_reads_an_uploaded_video(server: str, tmp_path: Path, prop: str) -> None:
    from demo.render import write_media

    sample = make_sample(np.random.default_rng(5), "video_info")
    (path,) = write_media(sample, tmp_path, "clip")
    file_id = _upload(server, path.name, path.read_bytes(), "video/mp4")
    response = HTTP.post(f"{server}/demo/tools/get_video_info", timeout=60,
                          json={"file_id": file_id, "arguments": {"property": prop}})
    assert response.status_code == 200, response.text
    # What the model was trained to read back for this file.
    assert response.json()["content"] == tool_exchange(sample.scene, prop).result


def test_the_demo_tool_refuses_bad_calls(server: str) -> None:
    clip = HTTP.get(f"{server}/demo/samples/moving-shape", timeout=60).content
    video = _upload(server, "clip.mp4", clip, "video/mp4")
    picture = _upload(server, "p.png", HTTP.get(f"{server}/demo/samples/picture", timeout=60).content, "image/png")
    cases = [
        ("get_video_info", {"file_id": video, "arguments": {"property": "codec"}}, 400, "property"),
        ("get_video_info", {"file_id": video, "arguments": {}}, 400, "property"),
        ("get_video_info", {"file_id": video, "arguments": "frame_rate"}, 400, "property"),
        ("get_video_info", {"file_id": "file-missing", "arguments": {"property": "width"}}, 400, "file_id"),
        ("get_video_info", [1, 2], 400, "JSON object"),
        ("get_weather", {"file_id": video, "arguments": {"city": "Paris"}}, 404, "get_weather"),
    ]
    for tool, body, status, reason in cases:
        response = HTTP.post(f"{server}/demo/tools/{tool}", json=body, timeout=60)
        assert response.status_code == status, (body, response.text)
        assert reason in response.json()["error"]["message"], response.text
    not_video = HTTP.post(f"{server}/demo/tools/get_video_info", timeout=60,
                           json={"file_id": picture, "arguments": {"property": "width"}})
    assert 400 <= not_video.status_code < 500 and not_video.json()["error"]["message"]
    assert json.loads(HTTP.post(f"{server}/demo/tools/get_video_info", timeout=60, json={
        "file_id": video, "arguments": {"property": "width"}}).json()["content"])["width"] > 0
