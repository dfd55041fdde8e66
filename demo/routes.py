"""The demo's routes, mounted beside the API by `swallow serve` and the
stack's API: the video-QA page, its sample media, and the demo's tool run on
an uploaded file so the page can finish a tool round trip."""

from __future__ import annotations

import asyncio
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from api.chat import BadRequest
from api.http import JSON_BODY_LIMIT, error_response, guarded, read_json
from api.openapi import OpenAPIPart
from api.openapi_blocks import (
    SECURED_ERRORS, closed_object, error_responses, json_content, nullable, object_schema, ok_response, operation,
    schema_ref, text_content,
)
from api.routes import ServerContext
from demo.samples import QUESTIONS_BY_KIND, SampleGallery
from demo.tools import ToolArgumentError, get_video_info

__all__ = ["DemoRoutes", "PAGE", "demo_openapi"]

PAGE = Path(__file__).parent / "static" / "index.html"
_NAME = [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]


class DemoRoutes:
    """`/` (the page), `/demo/samples[/{name}]` and `/demo/tools/{name}`."""

    # The demo's tool reads uploaded files, as /v1/files does.
    keyed_prefixes = ("/demo/tools/",)

    def __init__(self, context: ServerContext) -> None:
        self.files = context.files
        # The page's sample clips, pictures and sounds: rendered on first request, off the event loop.
        self.gallery = SampleGallery(context.spool_root / "samples")

    def routes(self) -> list[Route]:
        return [
            Route("/", self.page),
            Route("/demo/samples", self.samples),
            Route("/demo/samples/{name}", self.sample_file),
            Route("/demo/tools/{name}", self.tool, methods=["POST"]),
        ]

    async def page(self, _: Request) -> Response:
        if not PAGE.exists():
            return error_response(404, "the demo page is not installed", "not_found")
        return FileResponse(PAGE, media_type="text/html")

    async def samples(self, _: Request) -> Response:
        items = await asyncio.get_running_loop().run_in_executor(None, self.gallery.items)
        return JSONResponse({"samples": [item.to_json() for item in items], "questions_by_kind": QUESTIONS_BY_KIND})

    async def sample_file(self, request: Request) -> Response:
        item = await asyncio.get_running_loop().run_in_executor(None, self.gallery.find, request.path_params["name"])
        if item is None:
            return error_response(404, f"no sample {request.path_params['name']!r}", "not_found")
        return FileResponse(item.path, media_type=item.media_type, filename=item.path.name)

    async def tool(self, request: Request) -> Response:
        async def handle() -> Response:
            body = await read_json(request, JSON_BODY_LIMIT)
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object with 'file_id' and 'arguments'")
            if request.path_params["name"] != "get_video_info":
                return error_response(404, f"no demo tool {request.path_params['name']!r}", "not_found")
            stored = self.files.get(body.get("file_id")) if isinstance(body.get("file_id"), str) else None
            if stored is None:
                raise BadRequest("'file_id' must name an uploaded file (POST /v1/files)")
            try:
                content = await asyncio.get_running_loop().run_in_executor(
                    None, get_video_info, stored.path, body.get("arguments"))
            except ToolArgumentError as exc:
                raise BadRequest(str(exc)) from None
            return JSONResponse({"content": content})

        return await guarded(request, handle)

    def openapi(self) -> OpenAPIPart:
        return demo_openapi()


def demo_openapi() -> OpenAPIPart:
    """The demo's paths and schemas in the server's OpenAPI document."""
    count = {"type": "integer", "minimum": 0}
    question = closed_object({"text": {"type": "string"}, "answer": {"type": "string"},
                              "tools": {"type": "boolean"}, "call": nullable({"type": "string"})})
    gallery = closed_object({
        "samples": {"type": "array", "items": closed_object({
            "name": {"type": "string"}, "title": {"type": "string"},
            "kind": {"enum": ["video", "image", "audio"]}, "url": {"type": "string"},
            "filename": {"type": "string"}, "media_type": {"type": "string"}, "bytes": count,
            "questions": {"type": "array", "items": question},
        })},
        "questions_by_kind": {"type": "object", "additionalProperties": {"type": "array",
                                                                          "items": {"type": "string"}}},
    })
    media_file = {t: {"schema": {"type": "string", "contentMediaType": t}}
                  for t in ("video/mp4", "image/png", "audio/wav")}
    tool_body = object_schema({"file_id": {"type": "string"}, "arguments": {"type": "object"}},
                              ["file_id", "arguments"])
    return OpenAPIPart(paths={
        "/demo/samples": {"get": operation(
            "The demo page's sample media, with the questions the demo model understands",
            ok_response("The gallery.", json_content(schema_ref("SampleGallery"))))},
        "/demo/samples/{name}": {"get": operation(
            "One sample's media file", {**ok_response("The file.", media_file), **error_responses(404)},
            parameters=_NAME)},
        "/demo/tools/{name}": {"post": operation(
            "Run the demo's tool (get_video_info) on an uploaded video, for the page's tool round trip",
            {**ok_response("The tool message's content.",
                           json_content(closed_object({"content": {"type": "string"}}))),
             **error_responses(400, *SECURED_ERRORS, 404, 413, 415)},
            body=json_content(tool_body), parameters=_NAME, secured=True)},
        "/": {"get": operation("The video-QA demo page",
                               {**ok_response("The page.", text_content("html")), **error_responses(404)})},
    }, schemas={"SampleGallery": gallery})
