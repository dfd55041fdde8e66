"""The demo page's gallery: clips, pictures and sounds of the demo world drawn
from fixed seeds, each with the questions the demo model understands about it
and their answers.

Nothing is committed as a binary: ``SampleGallery`` renders the files on first use
into a directory it owns and serves them from there afterwards.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from demo.render import write_media
from demo.tasks import description, make_sample
from demo.tool_spec import PROPERTY_QUESTIONS, VIDEO_PROPERTIES, VIDEO_TOOL_NAME, tool_exchange
from demo.world import Sample

__all__ = ["GALLERY", "QUESTIONS_BY_KIND", "GallerySample", "SampleGallery", "SampleQuestion", "SampleSpec"]

MEDIA_TYPES = {".mp4": "video/mp4", ".png": "image/png", ".wav": "audio/wav"}


@dataclass(frozen=True)
class SampleSpec:
    """One gallery item: a world task's sample from a fixed seed."""

    name: str  # URL-safe, unique
    title: str
    task: str
    seed: int


# The seeds are arbitrary but fixed: the gallery is the same on every server.
GALLERY: tuple[SampleSpec, ...] = (
    SampleSpec("moving-shape", "A shape on the move", "video_direction", 11),
    SampleSpec("blinking-light", "A blinking light", "video_blink", 12),
    SampleSpec("colour-change", "A shape that changes colour", "video_color", 13),
    SampleSpec("beeping-clip", "A clip with beeps", "video_audio_beeps", 14),
    SampleSpec("picture", "A picture of a shape", "image_shape", 15),
    SampleSpec("beeps", "A few beeps", "audio_beeps", 16),
    SampleSpec("pitch", "High or low beeps", "audio_pitch", 17),
)

# What the model was trained to answer, by media kind (<...>: a word of the file's).
QUESTIONS_BY_KIND: dict[str, tuple[str, ...]] = {
    "video": (
        "Which way does the <colour> <shape> move?",
        "How many times does the light blink?",
        "What colour does the <shape> turn?",
        "How many beeps are in the video?",
        "Describe the video.",
        *(f"{PROPERTY_QUESTIONS[p]} (with the get_video_info tool)" for p in VIDEO_PROPERTIES),
    ),
    "image": ("What shape is in the picture?", "What colour is the <shape>?"),
    "audio": ("How many beeps do you hear?", "Are the beeps high or low?"),
}


@dataclass(frozen=True)
class SampleQuestion:
    text: str
    answer: str  # what the demo model answers (to a tool question: after the tool's result)
    tools: bool = False  # asked with the get_video_info tool offered
    call: str | None = None  # the call a tool question is answered with first, as JSON


@dataclass(frozen=True)
class GallerySample:
    name: str
    title: str
    kind: str  # video | image | audio
    path: Path
    media_type: str
    questions: tuple[SampleQuestion, ...]

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name, "title": self.title, "kind": self.kind, "url": f"demo/samples/{self.name}",
            "filename": self.path.name, "media_type": self.media_type, "bytes": self.path.stat().st_size,
            "questions": [{"text": q.text, "answer": q.answer, "tools": q.tools, "call": q.call}
                          for q in self.questions],
        }


def sample_questions(sample: Sample) -> tuple[SampleQuestion, ...]:
    """The sample's own question, then others whose answers its scene fixes."""
    questions = [SampleQuestion(sample.question, sample.answer)]
    scene = sample.scene
    shape = scene.shape
    if sample.task == "video_direction" and shape is not None:
        # The describe task's scenes are drawn exactly as a moving shape's are.
        questions.append(SampleQuestion("Describe the video.", description(shape, sample.answer)))
    if sample.task == "image_shape" and shape is not None:
        questions.append(SampleQuestion(f"What colour is the {shape.kind}?", shape.color))
    if scene.kind == "video":
        for prop in ("frame_rate", "duration"):
            exchange = tool_exchange(scene, prop)
            call = {"name": VIDEO_TOOL_NAME, "arguments": exchange.arguments}
            questions.append(SampleQuestion(PROPERTY_QUESTIONS[prop], exchange.reply, True, json.dumps(call)))
    return tuple(questions)


class SampleGallery:
    """Renders the gallery into ``directory`` once (the first call that needs it;
    concurrent callers wait for that one) and lists or finds its items."""

    def __init__(self, directory: Path, specs: tuple[SampleSpec, ...] = GALLERY) -> None:
        self.directory = Path(directory)
        self.specs = specs
        self._lock = threading.Lock()
        self._items: dict[str, GallerySample] | None = None

    def items(self) -> list[GallerySample]:
        return list(self._rendered().values())

    def find(self, name: str) -> GallerySample | None:
        return self._rendered().get(name)

    def _rendered(self) -> dict[str, GallerySample]:
        with self._lock:
            if self._items is None:
                self._items = {spec.name: self._render(spec) for spec in self.specs}
            return self._items

    def _render(self, spec: SampleSpec) -> GallerySample:
        sample = make_sample(np.random.default_rng(spec.seed), spec.task)
        (path,) = write_media(sample, self.directory, spec.name)
        return GallerySample(spec.name, spec.title, sample.scene.kind, path, MEDIA_TYPES[path.suffix],
                             sample_questions(sample))
