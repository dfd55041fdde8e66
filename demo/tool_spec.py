"""The one tool the demo model learns, as the world defines it: its definition
(``VIDEO_INFO_TOOL``), the ``video_info`` questions that need it, what it returns for
a scene's file, and the texts of an exchange with it (the call the model writes, the
tool's result, the answer in words that follows). Running it on a real uploaded file
is ``demo.tools``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from demo.world import Scene, video_frame_count

# The one tool the demo model learns: a property of the user's video file. The frames
# the model sees are resized and resampled, so the file's own numbers must come from
# the client's side of the exchange.
VIDEO_TOOL_NAME = "get_video_info"
VIDEO_PROPERTIES = ("frame_rate", "width", "height", "duration")
VIDEO_INFO_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": VIDEO_TOOL_NAME,
        "description": "Get a property of the video file: its frame rate, width, height or duration.",
        "parameters": {
            "type": "object",
            "properties": {"property": {"type": "string", "enum": list(VIDEO_PROPERTIES)}},
            "required": ["property"],
        },
    },
}
PROPERTY_QUESTIONS: dict[str, str] = {
    "frame_rate": "What is the frame rate of this video?",
    "width": "What is the width of this video?",
    "height": "What is the height of this video?",
    "duration": "What is the duration of this video?",
}
# Asked without the tool, the model says so instead of calling a tool it was not given.
NO_TOOL_ANSWER = "i cannot tell from the frames alone"
_REPLIES = {
    "frame_rate": "The video has {} frames per second.",
    "width": "The video is {} pixels wide.",
    "height": "The video is {} pixels high.",
    "duration": "The video lasts {} seconds.",
}


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call as the model writes it (and the chat template renders it back): one
    ``<tool_call>`` block holding JSON with exactly ``name`` then ``arguments``."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def video_property(scene: Scene, prop: str) -> int | float:
    """What ``get_video_info`` returns for a written file of the scene: frame rates as
    a number of frames per second (NTSC rates to 3 decimals), sides in pixels, the
    duration in seconds; whole numbers as integers."""
    if scene.kind != "video" or scene.fps is None:
        raise ValueError("get_video_info is about a video")
    values: dict[str, float] = {
        "frame_rate": float(scene.fps),
        "width": scene.width,
        "height": scene.height,
        "duration": video_frame_count(scene.fps) / scene.fps,
    }
    try:
        return tool_value(values[prop])
    except KeyError:
        raise ValueError(f"unknown property {prop!r}; expected one of {VIDEO_PROPERTIES}") from None


def tool_value(value: float) -> int | float:
    """A property as ``get_video_info`` reports it: to 3 decimals, whole numbers as integers."""
    rounded = round(float(value), 3)
    return int(rounded) if rounded.is_integer() else rounded


@dataclass(frozen=True)
class ToolExchange:
    """The rest of a ``video_info`` conversation once the model has called the tool."""

    prop: str
    arguments: dict[str, Any]
    result: str  # the tool message's content: JSON, e.g. {"frame_rate": 25}
    reply: str  # the model's answer in words after reading the result


def tool_exchange(scene: Scene, prop: str) -> ToolExchange:
    value = video_property(scene, prop)
    return ToolExchange(prop, {"property": prop}, json.dumps({prop: value}), _REPLIES[prop].format(value))


def question_property(question: str) -> str:
    """The property a ``video_info`` question asks for."""
    for prop, asked in PROPERTY_QUESTIONS.items():
        if asked == question:
            return prop
    raise ValueError(f"not a video_info question: {question!r}")
