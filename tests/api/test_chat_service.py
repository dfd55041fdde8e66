"""ChatService's media path: a clip with a sound track is seen and heard, and its bytes hashed once."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

import api.chat_service
import embedding_cache.service
from api.chat import MediaRef
from api.chat_service import with_sound_tracks
from embedding_cache.keys import file_digest
from embedding_cache.service import MediaEmbedder
from embedding_cache.store import SharedEmbeddingStore
from encoders.batcher import BatcherConfig, EncoderBatcher
from tests.embedding_cache.test_service import CONFIG, _encoders
from tests.media.test_video import write_video


def test_a_clip_with_sound_is_two_items_of_one_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clip = write_video(tmp_path / "clip.mp4", n=20, rate=10, audio=True)
    silent = write_video(tmp_path / "silent.mp4", n=20, rate=10)
    hashed: list[object] = []

    def counted(source: object) -> bytes:
        hashed.append(source)
        return file_digest(source)  # type: ignore[arg-type]

    monkeypatch.setattr(api.chat_service, "file_digest", counted)
    monkeypatch.setattr(embedding_cache.service, "file_digest", counted)
    store = SharedEmbeddingStore.create(f"swallow-test-{uuid.uuid4().hex[:12]}", 8 << 20, block_size=16 * 1024)

    async def main() -> None:
        content = [{"type": "video"}, {"type": "text", "text": "what beeps?"}, {"type": "video"}]
        messages, refs = await with_sound_tracks([{"role": "user", "content": content}],
                                                 [MediaRef("video", path=clip), MediaRef("video", data=silent.read_bytes())])
        assert [p["type"] for p in messages[0]["content"]] == ["video", "audio", "text", "video"]
        assert [r.kind for r in refs] == ["video", "audio", "video"]
        assert refs[0].digest == refs[1].digest == file_digest(clip) and refs[2].digest is None
        assert len(hashed) == 1  # the silent clip is not hashed for a track it does not have

        batcher = EncoderBatcher(_encoders(), BatcherConfig(max_wait_ms=1))
        embedder = MediaEmbedder(batcher, store, CONFIG)
        seen = await embedder.embed("video", clip, refs[0].digest)
        heard = await embedder.embed("audio", clip, refs[1].digest)
        assert (seen.kind, heard.kind) == ("video", "audio") and not seen.cached and not heard.cached
        assert len(hashed) == 1  # the embedder used the digest it was given
        # The keys are those of the bytes hashed by the embedder itself: an upload hit.
        again = await embedder.embed("video", clip.read_bytes())
        assert again.cached and again.key == seen.key and embedder.stats.upload_hits == 1
        with pytest.raises(ValueError, match="a media digest is 32 bytes"):
            await embedder.embed("audio", clip, b"short")
        await batcher.aclose()
        embedder.close()

    try:
        asyncio.run(main())
    finally:
        store.close()
        store.unlink()
