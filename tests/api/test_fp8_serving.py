"""A published-layout FP8 checkpoint (multimodal) through `swallow serve` and
`swallow stack`: greedy tokens equal transformers' on its dequantized weights,
an image question is answered as from the dequantized checkpoint, and the
engine flags (--quantization, --kv-cache-dtype) reach every engine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from api.models import write_random_multimodal
from api.launch import launch_stack
from llm_core.loading.fp8_dequantize import write_dequantized_copy
from llm_core.model.presets import tiny
from tests.api.live import HTTP, live_server
from tests.api.test_stack import chat_response

pytestmark = pytest.mark.slow
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8-serving")
    fp8 = write_random_multimodal(root / "fp8", tiny(), seed=2, fp8_block=(128, 128))
    return fp8, write_dequantized_copy(fp8, root / "dequantized")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (4, 37, 90)]


@pytest.fixture(scope="module")
def transformers_tokens(checkpoints: tuple[Path, Path], prompts: list[list[int]]) -> list[list[int]]:
    from transformers import MiMoV2FlashForCausalLM

    from tests.conftest import hf_greedy_outputs

    model = MiMoV2FlashForCausalLM.from_pretrained(checkpoints[1], dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return hf_greedy_outputs(model, prompts, MAX_TOKENS)


def _completions(url: str, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for prompt in prompts:
        body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        response = HTTP.post(f"{url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        out.append(response.json()["choices"][0]["token_ids"])
    return out


def _image_answer(model_dir: Path, question: str, files: list[Path]) -> str:
    from api.metrics import ServerMetrics
    from api.runtime import ServingModel
    from api.chat_service import ChatService
    from demo.evaluate import _answer, _request

    async def run() -> str:
        model = ServingModel(model_dir)
        try:
            return (await _answer(ChatService(model, ServerMetrics()), _request(question, files, 16))).answer
        finally:
            await model.aclose()

    return asyncio.run(run())


def test_serve_matches_transformers_and_answers_images_as_the_dequantized_checkpoint(
        checkpoints: tuple[Path, Path], prompts: list[list[int]], transformers_tokens: list[list[int]],
        media_dir: dict[str, Any]) -> None:
    fp8, dequantized = checkpoints
    question, files = media_dir["image"]
    expected_answer = _image_answer(dequantized, question, files)
    with live_server(fp8) as server:
        assert _completions(server.url, prompts) == transformers_tokens
        answer = chat_response(server.url, question, files, max_tokens=16).json()
        assert answer["choices"][0]["message"]["content"].strip() == expected_answer
        weights = HTTP.get(f"{server.url}/stats", timeout=10).json()["weights"]
        assert weights["checkpoint"] == "fp8 e4m3, 128x128 blocks" and weights["held_as"] == "float32"
        assert "swallow_weights_resident_bytes" in HTTP.get(f"{server.url}/metrics", timeout=10).text


def test_serve_with_an_fp8_kv_cache(checkpoints: tuple[Path, Path], prompts: list[list[int]]) -> None:
    with live_server(checkpoints[0], "--kv-cache-dtype", "fp8_e4m3", "--quantization", "none") as server:
        tokens = _completions(server.url, prompts)
        assert [len(t) for t in tokens] == [MAX_TOKENS] * len(prompts)
        stats = HTTP.get(f"{server.url}/stats", timeout=10).json()
        assert stats["kv_cache_dtype"] == "float8_e4m3fn" and stats["weights"]["quantization"] == "none"


def test_stack_matches_transformers(checkpoints: tuple[Path, Path], prompts: list[list[int]],
                                    transformers_tokens: list[list[int]]) -> None:
    with launch_stack(checkpoints[0], "--quantization", "auto", workers=1, encoders=1) as stack:
        assert _completions(stack.url, prompts) == transformers_tokens
