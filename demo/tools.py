"""The demo's one tool, run on a real file: what ``get_video_info`` returns for
an uploaded video, read by the server's own prober. For a file of the demo
world it is what the model was trained to read back (``demo.tool_spec.tool_exchange``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from demo.tool_spec import VIDEO_PROPERTIES, tool_value
from media import probe_video

__all__ = ["ToolArgumentError", "get_video_info"]


class ToolArgumentError(ValueError):
    """The call's arguments do not match the tool's parameters."""


def get_video_info(path: str | Path, arguments: Mapping[str, Any]) -> str:
    """The tool message's content for a call: JSON, e.g. ``{"frame_rate": 25}``.
    Raises ``ToolArgumentError`` for bad arguments and ``media.MediaError`` for a
    file that is not a readable video."""
    if not isinstance(arguments, Mapping) or set(arguments) != {"property"} \
            or arguments["property"] not in VIDEO_PROPERTIES:
        raise ToolArgumentError(f"get_video_info takes one argument, 'property', one of {list(VIDEO_PROPERTIES)}")
    prop = arguments["property"]
    info = probe_video(Path(path))
    value = {"frame_rate": info.fps, "width": info.width, "height": info.height, "duration": info.duration}[prop]
    return json.dumps({prop: tool_value(value)})
