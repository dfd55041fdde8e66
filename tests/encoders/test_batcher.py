"""EncoderBatcher: packed forwards across concurrent requests, per-item isolation."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch

from encoders.audio import AudioEncoder, AudioEncoderConfig, AudioInput
from encoders.batcher import BatcherConfig, EncoderBatcher, EncoderQueueFull
from encoders.vision import VisionEncoder, VisionEncoderConfig, VisionInput

VISION = VisionEncoderConfig(
    depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
    window_size=56, fullatt_block_indexes=(1,),
)
AUDIO = AudioEncoderConfig(
    d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
    num_mel_bins=16, max_source_positions=50, out_hidden_size=48, pad_to_full_chunk=False,
)


@pytest.fixture(scope="module")
def encoders() -> dict[str, VisionEncoder | AudioEncoder]:
    torch.manual_seed(0)
    return {"vision": VisionEncoder(VISION).eval(), "audio": AudioEncoder(AUDIO).eval()}


def _vision_item(t: int, h: int, w: int, seed: int) -> VisionInput:
    g = torch.Generator().manual_seed(seed)
    return VisionInput(torch.randn(t * h * w, VISION.patch_dim, generator=g), (t, h, w))


def _audio_item(chunks: int, frames: int, seed: int) -> AudioInput:
    g = torch.Generator().manual_seed(seed)
    return AudioInput(torch.randn(chunks, AUDIO.num_mel_bins, AUDIO.chunk_frames, generator=g), frames)


def _mixed_requests() -> list[tuple[str, VisionInput | AudioInput]]:
    """16 requests: images of several sizes, video clips (t > 1), audio of 1-2 chunks."""
    shapes = [(1, 4, 4), (1, 6, 10), (1, 14, 8), (1, 2, 2), (1, 8, 8), (1, 4, 12)]
    reqs: list[tuple[str, VisionInput | AudioInput]] = []
    for i, s in enumerate(shapes):
        reqs.append(("vision", _vision_item(*s, seed=i)))
    for i, s in enumerate([(2, 6, 8), (3, 4, 4), (4, 2, 6), (2, 8, 8)]):
        reqs.append(("vision", _vision_item(*s, seed=100 + i)))
    for i, (chunks, frames) in enumerate([(1, 100), (1, 37), (2, 150), (1, 1), (2, 200), (1, 64)]):
        reqs.append(("audio", _audio_item(chunks, frames, seed=200 + i)))
    return reqs


def _run(coro):  # noqa: ANN001, ANN202 - tiny helper for sync tests
    return asyncio.run(coro)


def test_sixteen_concurrent_mixed_requests_equal_one_by_one(encoders: dict) -> None:
    reqs = _mixed_requests()
    assert len(reqs) == 16

    async def main() -> tuple[list[torch.Tensor], dict]:
        batcher = EncoderBatcher(encoders, BatcherConfig(max_wait_ms=20))
        outs = await asyncio.gather(*(batcher.encode(kind, item) for kind, item in reqs))
        stats = batcher.stats()
        await batcher.aclose()
        return list(outs), stats

    outs, stats = _run(main())
    worst = 0.0
    for (kind, item), out in zip(reqs, outs):
        alone = encoders[kind].encode_batch([item])[0]
        assert out.shape == alone.shape == (encoders[kind].num_tokens(item), 48)
        worst = max(worst, float((out - alone).abs().max()))
    assert worst <= 1e-5, worst
    # Fused: far fewer forwards than requests.
    assert stats["vision"].batches < 10 and stats["audio"].batches < 6
    assert stats["vision"].items == 10 and stats["audio"].items == 6
    assert max(stats["vision"].batch_sizes) > 1


def test_bad_item_fails_only_its_request(encoders: dict) -> None:
    good = _vision_item(1, 4, 4, seed=1)
    nan = _vision_item(1, 4, 4, seed=2)
    nan.pixel_values[3, 5] = float("nan")
    wrong_shape = VisionInput(torch.randn(10, VISION.patch_dim), (1, 4, 4))

    async def main() -> list:
        batcher = EncoderBatcher(encoders, BatcherConfig(max_wait_ms=20))
        results = await asyncio.gather(
            batcher.encode("vision", good),
            batcher.encode("vision", nan),
            batcher.encode("vision", wrong_shape),
            batcher.encode("audio", _audio_item(1, 500, seed=3)),  # more frames than the chunk has
            batcher.encode("video", good),  # no such encoder
            batcher.encode("vision", good),
            return_exceptions=True,
        )
        await batcher.aclose()
        return results

    results = _run(main())
    alone = encoders["vision"].encode_batch([good])[0]
    assert torch.allclose(results[0], alone, atol=1e-6) and torch.allclose(results[5], alone, atol=1e-6)
    for r in results[1:5]:
        assert isinstance(r, ValueError), r
    assert "finite" in str(results[1]) or "nan" in str(results[1]).lower()
    assert "no 'video' encoder" in str(results[4])


class _FlakyVisionEncoder(VisionEncoder):
    """Fails any forward that contains an item with a 2x2 grid -- an item that passes
    ``check`` but breaks the encoder, as a device error would."""

    def encode_batch(self, items: Sequence[VisionInput]) -> list[torch.Tensor]:
        if any(it.grid_thw == (1, 2, 2) for it in items):
            raise RuntimeError("simulated kernel failure")
        return super().encode_batch(items)


def test_failing_forward_is_retried_item_by_item(encoders: dict) -> None:
    flaky = _FlakyVisionEncoder(VISION).eval()
    flaky.load_state_dict(encoders["vision"].state_dict())
    items = [_vision_item(1, 4, 4, seed=i) for i in range(5)]
    items[2] = _vision_item(1, 2, 2, seed=9)

    async def main() -> list:
        batcher = EncoderBatcher([flaky], BatcherConfig(max_wait_ms=20))
        out = await asyncio.gather(*(batcher.encode("vision", it) for it in items), return_exceptions=True)
        failed = batcher.stats()["vision"].failed_items
        await batcher.aclose()
        return [out, failed]

    out, failed = _run(main())
    assert isinstance(out[2], RuntimeError) and failed == 1
    for i in (0, 1, 3, 4):
        assert torch.allclose(out[i], encoders["vision"].encode_batch([items[i]])[0], atol=1e-6)


def test_token_budget_bounds_each_forward(encoders: dict) -> None:
    items = [_vision_item(1, 8, 8, seed=i) for i in range(8)]  # 64 patches each

    async def main() -> dict:
        batcher = EncoderBatcher(encoders, BatcherConfig(max_wait_ms=50, max_batch_tokens=150))
        await asyncio.gather(*(batcher.encode("vision", it) for it in items))
        stats = batcher.stats()["vision"]
        await batcher.aclose()
        return stats

    stats = _run(main())
    assert max(stats.batch_sizes) == 2  # 2 x 64 <= 150 < 3 x 64
    assert stats.items == 8


def test_oversized_item_runs_alone(encoders: dict) -> None:
    big = _vision_item(1, 16, 16, seed=0)

    async def main() -> torch.Tensor:
        batcher = EncoderBatcher(encoders, BatcherConfig(max_wait_ms=1, max_batch_tokens=10))
        out = await batcher.encode("vision", big)
        await batcher.aclose()
        return out

    assert _run(main()).shape == (64, 48)


def test_cancelled_request_is_dropped_and_queue_limit(encoders: dict) -> None:
    async def main() -> None:
        batcher = EncoderBatcher(encoders, BatcherConfig(max_wait_ms=500, arrival_gap_ms=500, max_queued_items=2))
        t1 = asyncio.create_task(batcher.encode("vision", _vision_item(1, 4, 4, seed=1)))
        t2 = asyncio.create_task(batcher.encode("vision", _vision_item(1, 4, 4, seed=2)))
        await asyncio.sleep(0.01)
        with pytest.raises(EncoderQueueFull):
            await batcher.encode("vision", _vision_item(1, 4, 4, seed=3))
        t1.cancel()
        out = await t2
        assert out.shape == (4, 48)
        assert t1.cancelled()
        assert batcher.stats()["vision"].items == 1  # the cancelled item never cost a forward
        await batcher.aclose()

    _run(main())


def test_lone_request_is_not_held_past_max_wait(encoders: dict) -> None:
    async def main() -> float:
        batcher = EncoderBatcher(encoders, BatcherConfig(max_wait_ms=30))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await batcher.encode("vision", _vision_item(1, 4, 4, seed=1))
        elapsed = loop.time() - t0
        await batcher.aclose()
        return elapsed

    assert _run(main()) < 1.0


def test_a_burst_starts_without_waiting_out_max_wait(encoders: dict) -> None:
    """Once arrivals pause for arrival_gap_ms, the batch goes: a long max_wait_ms only
    bounds how long a trickle of arrivals may keep a batch open."""

    async def main() -> tuple[float, int]:
        batcher = EncoderBatcher(encoders, BatcherConfig(max_wait_ms=2000, arrival_gap_ms=5))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.gather(*(batcher.encode("vision", _vision_item(1, 4, 4, seed=i)) for i in range(6)))
        elapsed = loop.time() - t0
        forwards = batcher.stats()["vision"].batches
        await batcher.aclose()
        return elapsed, forwards

    elapsed, forwards = _run(main())
    assert forwards == 1 and elapsed < 1.0
