"""The demo page's gallery: rendered once from fixed seeds, decodable by the
server's own media path, with questions whose answers the scenes fix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from demo.samples import GALLERY, QUESTIONS_BY_KIND, SampleGallery, sample_questions
from demo.tasks import make_sample
from demo.tool_spec import tool_exchange
from demo.world import TASKS
from media import load_audio, load_image, probe_video


def test_gallery_renders_every_sample_once(tmp_path: Path) -> None:
    gallery = SampleGallery(tmp_path)
    items = gallery.items()
    assert [i.name for i in items] == [s.name for s in GALLERY]
    assert len({i.name for i in items}) == len(items)
    assert all(s.task in TASKS for s in GALLERY)
    assert {i.kind for i in items} == {"video", "image", "audio"} == set(QUESTIONS_BY_KIND)
    stamps = {i.name: i.path.stat().st_mtime_ns for i in items}
    again = SampleGallery(tmp_path)  # a fresh gallery renders the same bytes
    assert gallery.find("moving-shape") is items[0]
    assert gallery.find("nope") is None
    assert {i.name: i.path.stat().st_mtime_ns for i in gallery.items()} == stamps
    assert again.find("picture").path.read_bytes() == items[[i.name for i in items].index("picture")].path.read_bytes()


def test_files_decode_through_the_media_path(tmp_path: Path) -> None:
    for item in SampleGallery(tmp_path).items():
        data = item.path.read_bytes()
        if item.kind == "video":
            assert probe_video(item.path).duration > 0
        elif item.kind == "image":
            assert load_image(item.path).shape[0] == 3
        else:
            assert len(load_audio(item.path)) > 0
        doc = item.to_json()
        assert doc["url"] == f"demo/samples/{item.name}" and doc["bytes"] == len(data)


def test_questions_are_answered_by_the_scene() -> None:
    for spec in GALLERY:
        sample = make_sample(np.random.default_rng(spec.seed), spec.task)
        questions = sample_questions(sample)
        assert (questions[0].text, questions[0].answer) == (sample.question, sample.answer)
        for question in questions:
            if question.tools:  # the file's own facts: the model calls the tool, then reads its result back
                call = json.loads(question.call)
                assert call["name"] == "get_video_info" and set(call["arguments"]) == {"property"}
                assert question.answer == tool_exchange(sample.scene, call["arguments"]["property"]).reply
            else:
                assert question.call is None
        if spec.task == "video_direction":
            shape = sample.scene.shape
            describe = next(q for q in questions if q.text == "Describe the video.")
            assert describe.answer.startswith(f"a {shape.color} {shape.kind} moves {sample.answer}")
