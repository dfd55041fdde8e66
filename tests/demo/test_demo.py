"""The trained demo model: training runs, the committed checkpoint answers through
the server's path, and its answers do not depend on batching or prefix caching."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from swallow.cli import main
from api.models import DEMO_MODEL_DIR, ensure_default_model
from demo.evaluate import ask, eval_demo
from demo.model import PackedCausalAttention
from demo.render import write_media
from demo.tasks import answer_matches, make_sample
from demo.train import train_demo
from demo.train_config import TrainConfig, finetune_config
from llm_core import LLM
from llm_core.model.attention import attention_reference
from llm_core.model.config import AttentionSpec

needs_demo_model = pytest.mark.skipif(not (DEMO_MODEL_DIR / "config.json").exists(),
                                      reason="the demo model is not in this checkout")


def test_train_demo_smoke(tmp_path: Path) -> None:
    """A few steps of the real training loop write a checkpoint the server path loads."""
    summary = train_demo(tmp_path / "m", TrainConfig(max_steps=3, batch_size=4), progress=False)
    assert summary["steps"] == 3 and summary["loss"] > 0 and summary["mtp"] > 0
    llm = LLM(tmp_path / "m")
    assert llm.config.num_mtp_layers == 3 and llm.config.sliding_attention.sliding_window == 33
    sample = make_sample(np.random.default_rng(0), "image_shape")
    files = write_media(sample, tmp_path / "media", "pic")
    assert isinstance(ask(tmp_path / "m", sample.question, files, max_tokens=3), str)


def test_a_fine_tuned_checkpoint_fine_tunes_again(tmp_path: Path) -> None:
    """``--init`` on a checkpoint whose tokenizer already has the dialogue tokens:
    no rows are added, and round trips can be drawn on top of the mix."""
    train_demo(tmp_path / "base", TrainConfig(max_steps=1, batch_size=2), progress=False)
    config = finetune_config(max_steps=2, batch_size=4, round_trip_share=0.5)
    summary = train_demo(tmp_path / "tuned", config, progress=False, init=tmp_path / "base")
    assert summary["steps"] == 2 and summary["init"] == str(tmp_path / "base")
    assert LLM(tmp_path / "tuned").config.vocab_size == LLM(tmp_path / "base").config.vocab_size
    assert (tmp_path / "tuned" / "tokenizer.json").read_bytes() == (tmp_path / "base" / "tokenizer.json").read_bytes()


def test_train_demo_is_reproducible_from_its_seed(tmp_path: Path) -> None:
    def weights(out: Path, seed: int) -> list[bytes]:
        train_demo(out, TrainConfig(seed=seed, max_steps=2, batch_size=4), progress=False)
        return [(out / name).read_bytes() for name in ("model-00001-of-00001.safetensors", "encoders.safetensors")]

    first = weights(tmp_path / "a", 0)
    assert weights(tmp_path / "b", 0) == first
    assert weights(tmp_path / "c", 1) != first


@pytest.mark.parametrize("window,with_sinks", [(None, False), (33, True), (3, True)])
@pytest.mark.parametrize("group_size", [1, 2, 8])
def test_packed_training_attention_equals_per_sequence_reference(
    window: int | None, with_sinks: bool, group_size: int
) -> None:
    """Length-grouped padding must not leak across sequences or change any row."""
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 40, 1, 77, 33, 2, 40]
    total = sum(lengths)
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, v_head_dim=8, rope_theta=1e4,
                         partial_rotary_factor=0.5, sliding_window=window, has_sinks=with_sinks)
    q, k, v = (torch.randn(total, h, d, generator=gen) for h, d in ((4, 16), (2, 16), (2, 8)))
    sinks = torch.randn(4, generator=gen) if with_sinks else None
    got = PackedCausalAttention(lengths, group_size).attend(0, q, k, v, spec, sinks)
    expected = torch.cat([
        attention_reference(qs, ks, vs, torch.arange(n), torch.arange(n), window, sinks)
        for qs, ks, vs, n in zip(q.split(lengths), k.split(lengths), v.split(lengths), lengths)
    ])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_demo_model
def test_committed_demo_model_is_small_and_served_by_default() -> None:
    size = sum(p.stat().st_size for p in DEMO_MODEL_DIR.iterdir())
    assert size <= 20 << 20, f"{size / (1 << 20):.1f} MiB"
    assert ensure_default_model() == DEMO_MODEL_DIR


@needs_demo_model
def test_answers_are_right_and_identical_across_engine_settings() -> None:
    # One sample per task: every task, media kind and engine setting; the accuracy
    # over many samples is `swallow eval-demo`'s figure (docs/benchmarks.md).
    result = eval_demo(DEMO_MODEL_DIR, per_task=1, concurrencies=(4, 16), prefix_caching=(True, False))
    assert result["items"] == 10
    # The video tool: called exactly when listed, never when not.
    assert result["tools"]["call_exact"] >= 0.8 and result["tools"]["no_call_in_any_answer_without_tools"] == 1.0
    assert all(result["identical_answers_across_settings"].values()), result["identical_answers_across_settings"]
    assert result["overall_accuracy"] >= 0.9, result
    assert len(result["identical_answers_across_settings"]) == 6  # speculation off in two of them
    mtp = result["mtp"]
    assert mtp["num_speculative_tokens"] == 3 and sum(mtp["drafts_proposed"]) > 0
    assert 1.0 < mtp["mean_acceptance_length"] <= 4.0


@needs_demo_model
def test_demo_video_qa_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sample = make_sample(np.random.default_rng(123), "video_direction")
    video = write_media(sample, tmp_path, "clip")[0]
    assert main(["demo", "video-qa", "--video", str(video), "--question", sample.question]) == 0
    assert answer_matches(capsys.readouterr().out, sample.answer)
