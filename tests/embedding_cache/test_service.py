"""MediaEmbedder: cache lookups in front of preprocessing and the batched encoders."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import multiprocessing as mp
import uuid
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from embedding_cache.service import MediaEmbedder, MediaEmbedderConfig
from embedding_cache.store import SharedEmbeddingStore
from encoders.audio import AudioEncoder, AudioInput
from encoders.batcher import BatcherConfig, EncoderBatcher
from encoders.vision import VisionEncoder
from media import MediaError, VisionPreprocessConfig
from tests.encoders.test_batcher import AUDIO, VISION
from tests.media.test_video import write_video

CONFIG = MediaEmbedderConfig(
    image=VisionPreprocessConfig(min_pixels=56 * 56, max_pixels=112 * 112),
    video=VisionPreprocessConfig(min_pixels=56 * 56, max_pixels=112 * 112),
    video_fps=2.0,
    video_max_frames=8,
)


def _encoders() -> list:
    torch.manual_seed(0)
    return [VisionEncoder(VISION).eval(), AudioEncoder(AUDIO).eval()]


def _png(seed: int, size: tuple[int, int] = (80, 60), compress_level: int = 6) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(
        buf, "PNG", compress_level=compress_level
    )
    return buf.getvalue()


def _wav(seed: int, seconds: float = 0.7) -> bytes:
    t = np.arange(int(16000 * seconds)) / 16000
    tone = 0.3 * np.sin(2 * np.pi * (300 + 100 * seed) * t)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((tone * 32767).astype(np.int16).tobytes())
    return buf.getvalue()


@pytest.fixture
def store():
    s = SharedEmbeddingStore.create(f"swallow-test-{uuid.uuid4().hex[:12]}", 8 << 20, block_size=16 * 1024)
    yield s
    s.close()
    s.unlink()


def _forwards(batcher: EncoderBatcher) -> int:
    return sum(s.batches for s in batcher.stats().values())


def test_hit_bypasses_preprocessing_and_encoder(store: SharedEmbeddingStore) -> None:
    async def main() -> None:
        batcher = EncoderBatcher(_encoders(), BatcherConfig(max_wait_ms=1))
        embedder = MediaEmbedder(batcher, store, CONFIG)
        first = await embedder.embed_image(_png(1))
        assert not first.cached and _forwards(batcher) == 1
        again = await embedder.embed_image(_png(1))
        assert again.cached and torch.equal(again.tensor, first.tensor) and again.key == first.key
        assert embedder.stats.upload_hits == 1 and _forwards(batcher) == 1
        # Same pixels, different file bytes: decoded, then a content hit -- still no forward.
        recompressed = _png(1, compress_level=1)
        assert recompressed != _png(1)
        third = await embedder.embed_image(recompressed)
        assert third.cached and torch.equal(third.tensor, first.tensor)
        assert embedder.stats.content_hits == 1 and _forwards(batcher) == 1
        # ...and that file's bytes are now an alias too (by kind, as the API and the encoder ask).
        assert (await embedder.embed("image", recompressed)).cached
        assert embedder.stats.upload_hits == 2
        with pytest.raises(ValueError, match="unknown media kind 'pdf'"):
            await embedder.embed("pdf", recompressed)
        # Other preprocessing parameters are another key.
        other = MediaEmbedder(batcher, store, MediaEmbedderConfig(image=VisionPreprocessConfig(min_pixels=112 * 112)))
        assert not (await other.embed_image(_png(1))).cached
        await batcher.aclose()
        embedder.close()
        other.close()

    asyncio.run(main())


def test_video_and_audio_round_trip(store: SharedEmbeddingStore, tmp_path: Path) -> None:
    video = write_video(tmp_path / "clip.mp4", n=30, rate=10)

    async def main() -> None:
        batcher = EncoderBatcher(_encoders(), BatcherConfig(max_wait_ms=1))
        embedder = MediaEmbedder(batcher, store, CONFIG)
        v1 = await embedder.embed_video(video)
        v2 = await embedder.embed_video(video.read_bytes())  # same content as bytes
        assert not v1.cached and v2.cached and torch.equal(v1.tensor, v2.tensor)
        a1 = await embedder.embed_audio(_wav(0))
        a2 = await embedder.embed_audio(_wav(0))
        assert not a1.cached and a2.cached and torch.equal(a1.tensor, a2.tensor)
        # 0.7 s = 70 mel frames of 10 ms
        silence = torch.zeros(1, AUDIO.num_mel_bins, AUDIO.chunk_frames)
        expected = batcher.encoder("audio").num_tokens(AudioInput(silence, 70))
        assert a1.rows == expected
        await batcher.aclose()
        embedder.close()

    asyncio.run(main())


def test_concurrent_mixed_requests_one_corrupt(store: SharedEmbeddingStore, tmp_path: Path) -> None:
    video = write_video(tmp_path / "clip.mp4", n=20, rate=10)
    corrupt = _png(3)[:200]

    async def main() -> None:
        batcher = EncoderBatcher(_encoders(), BatcherConfig(max_wait_ms=30))
        embedder = MediaEmbedder(batcher, None, CONFIG)  # no cache: every item is encoded
        jobs = [embedder.embed_image(_png(i, size=(60 + 8 * i, 50))) for i in range(8)]
        jobs += [embedder.embed_audio(_wav(i, seconds=0.3 + 0.2 * i)) for i in range(5)]
        jobs += [embedder.embed_video(video), embedder.embed_video(video)]
        jobs.append(embedder.embed_image(corrupt))
        results = await asyncio.gather(*jobs, return_exceptions=True)
        assert isinstance(results[-1], MediaError) and results[-1].status == 400
        good = results[:-1]
        assert all(not isinstance(r, BaseException) for r in good), good
        assert max(batcher.stats()["vision"].batch_sizes) > 1
        # Each equals encoding the same request alone.
        alone = MediaEmbedder(EncoderBatcher(_encoders()), None, CONFIG)
        refs = [await alone.embed_image(_png(i, size=(60 + 8 * i, 50))) for i in range(8)]
        refs += [await alone.embed_audio(_wav(i, seconds=0.3 + 0.2 * i)) for i in range(5)]
        refs += [await alone.embed_video(video)] * 2
        for r, ref in zip(good, refs):
            assert r.tensor.shape == ref.tensor.shape
            assert float((r.tensor - ref.tensor).abs().max()) <= 1e-5
        await batcher.aclose()
        await alone.batcher.aclose()
        embedder.close()
        alone.close()

    asyncio.run(main())


def _second_process(name: str, png: bytes, out: mp.Queue) -> None:
    async def main() -> tuple[bool, int, list[float]]:
        batcher = EncoderBatcher(_encoders())
        embedder = MediaEmbedder(batcher, SharedEmbeddingStore.attach(name), CONFIG)
        emb = await embedder.embed_image(png)
        forwards = _forwards(batcher)
        await batcher.aclose()
        return emb.cached, forwards, emb.tensor.flatten()[:8].tolist()

    out.put(asyncio.run(main()))


def test_second_process_hits_what_the_first_encoded(store: SharedEmbeddingStore) -> None:
    async def first() -> torch.Tensor:
        batcher = EncoderBatcher(_encoders())
        emb = await MediaEmbedder(batcher, store, CONFIG).embed_image(_png(7))
        await batcher.aclose()
        return emb.tensor

    tensor = asyncio.run(first())
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_second_process, args=(store.name, _png(7), out))
    proc.start()
    cached, forwards, head = out.get(timeout=120)
    proc.join(timeout=30)
    assert cached and forwards == 0
    assert head == tensor.flatten()[:8].tolist()


def test_preprocessing_on_another_device_is_another_key() -> None:
    # GPU preprocessing is not bit-identical to the CPU's: an embedding made one
    # way must never answer for the other, in a store shared across machines.
    assert CONFIG.preprocess_params() == {}
    on_gpu = dataclasses.replace(CONFIG, preprocess_device="cuda:0")
    assert on_gpu.preprocess_params() == {"preprocess_on": "cuda"}
    with pytest.raises(RuntimeError):
        dataclasses.replace(CONFIG, preprocess_device="gpu")


def test_the_serving_pipeline_preprocesses_on_the_encoders_device(tmp_path: Path) -> None:
    from api.media_pipeline import media_config
    from media import DEFAULT_LIMITS

    assert media_config(tmp_path, DEFAULT_LIMITS).preprocess_device == "cpu"
    assert media_config(tmp_path, DEFAULT_LIMITS, "cuda:1").preprocess_device == "cuda:1"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_preprocessing_embeds_images_and_clips_as_the_cpu_does(store: SharedEmbeddingStore,
                                                                   tmp_path: Path) -> None:
    async def main() -> None:
        batcher = EncoderBatcher(_encoders(), BatcherConfig(max_wait_ms=1))
        cpu = MediaEmbedder(batcher, store, CONFIG)
        gpu = MediaEmbedder(batcher, store, dataclasses.replace(CONFIG, preprocess_device="cuda"))
        clip = tmp_path / "clip.mp4"
        write_video(clip)
        for embed in ("embed_image", "embed_video"):
            source = _png(3) if embed == "embed_image" else clip
            on_cpu, on_gpu = await getattr(cpu, embed)(source), await getattr(gpu, embed)(source)
            assert not on_gpu.cached and on_gpu.key != on_cpu.key  # never the CPU's embedding
            torch.testing.assert_close(on_gpu.tensor.float().cpu(), on_cpu.tensor.float().cpu(),
                                       atol=5e-2, rtol=5e-2)
        await batcher.aclose()
        cpu.close()
        gpu.close()

    asyncio.run(main())
