from __future__ import annotations

from pathlib import Path

import pytest

from swallow.cli import main
from llm_core import LLM, SamplingParams
from llm_core.model.presets import tiny


def test_init_checkpoint_writes_a_loadable_model_with_tokenizer(tmp_path: Path, capsys) -> None:
    assert main(["init-checkpoint", str(tmp_path / "m"), "--preset", "tiny", "--seed", "5"]) == 0
    assert "random 'tiny' checkpoint" in capsys.readouterr().out
    llm = LLM(tmp_path / "m")
    assert llm.config == tiny()
    assert llm.tokenizer is not None and llm.tokenizer.vocab_size == tiny().vocab_size
    out = llm.generate("hello", SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_init_checkpoint_is_seeded(tmp_path: Path) -> None:
    for name in ("a", "b"):
        main(["init-checkpoint", str(tmp_path / name), "--seed", "1"])
    files_a = sorted((tmp_path / "a").glob("*.safetensors"))
    files_b = sorted((tmp_path / "b").glob("*.safetensors"))
    assert [f.read_bytes() for f in files_a] == [f.read_bytes() for f in files_b]


@pytest.mark.parametrize(("preset", "message"), [("mimo-v2-flash", "too large"), ("nope", "unknown preset")])
def test_init_checkpoint_errors_are_messages(tmp_path: Path, capsys, preset: str, message: str) -> None:
    assert main(["init-checkpoint", str(tmp_path / "x"), "--preset", preset]) == 2
    assert message in capsys.readouterr().err


def test_bench_image_prints_one_json_object(capsys) -> None:
    import json

    assert main(["bench", "image", "--num-images", "4", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["num_images"] == 4 and result["batched_images_per_s"] > 0


def test_init_checkpoint_multimodal_loads_with_encoders(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from encoders.media_kinds import placeholder_token_ids
    from encoders.multimodal_checkpoint import load_encoders
    from llm_core.model.chat import ChatTemplate, DEFAULT_CHAT_TEMPLATE

    out = tmp_path / "mm"
    assert main(["init-checkpoint", str(out), "--multimodal"]) == 0
    assert "multimodal" in capsys.readouterr().out
    encoders = load_encoders(out)
    assert set(encoders) == {"vision", "audio"}
    assert all(e.config.out_hidden_size == 128 for e in encoders.values())  # the tiny LLM's hidden size
    assert set(placeholder_token_ids(out)) == {"image", "video", "audio"}
    assert ChatTemplate.from_model_dir(out).source == DEFAULT_CHAT_TEMPLATE


def test_schedule_buckets_option() -> None:
    from api.options import bucket_edges

    assert bucket_edges(None) is None  # the model's default
    assert bucket_edges("none") == ()
    assert bucket_edges("65536,262144") == (65536, 262144)
    with pytest.raises(SystemExit, match="comma-separated"):
        bucket_edges("64K")


def test_init_checkpoint_fp8_writes_the_published_layout(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    import json

    assert main(["init-checkpoint", str(tmp_path / "f"), "--preset", "tiny-kv2", "--fp8", "--fp8-block", "32,32",
                 "--fused-qkv"]) == 0
    assert "FP8, 32x32 blocks, fused qkv_proj" in capsys.readouterr().out
    config = json.loads((tmp_path / "f" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [32, 32]
    assert config["attention_projection_layout"] == "fused_qkv"
    llm = LLM(tmp_path / "f")
    assert llm.stats()["weights"]["checkpoint"] == "fp8 e4m3, 32x32 blocks"
    assert main(["init-checkpoint", str(tmp_path / "g"), "--fp8", "--fp8-block", "100,100"]) == 2
    assert "weight_block_size" in capsys.readouterr().err
    assert main(["init-checkpoint", str(tmp_path / "h"), "--fused-qkv"]) == 2


def test_engine_flags_reach_the_engine_and_every_stack_worker() -> None:
    from swallow.cli import build_parser
    from api.options import engine_argv, engine_options

    args = build_parser().parse_args(["stack", "--quantization", "none", "--kv-cache-dtype", "fp8_e4m3"])
    assert {"quantization": "none", "kv_cache_dtype": "fp8_e4m3"}.items() <= engine_options(args).items()
    forwarded = engine_argv(args)
    assert forwarded[forwarded.index("--quantization") + 1] == "none"
    assert forwarded[forwarded.index("--kv-cache-dtype") + 1] == "fp8_e4m3"


def test_the_prefill_batch_limit_defaults_by_device_and_reaches_the_engine_core() -> None:
    from swallow.cli import build_parser
    from api.options import CPU_PREFILL_BATCH_TOKENS, engine_argv, engine_options

    parser = build_parser()
    assert engine_options(parser.parse_args(["serve"]))["prefill_batch_tokens"] == CPU_PREFILL_BATCH_TOKENS
    assert engine_options(parser.parse_args(["serve", "--device", "cuda"]))["prefill_batch_tokens"] is None
    assert engine_options(parser.parse_args(["serve", "--prefill-batch-tokens", "0"]))["prefill_batch_tokens"] is None
    args = parser.parse_args(["serve", "--prefill-batch-tokens", "512"])
    assert engine_options(args)["prefill_batch_tokens"] == 512
    forwarded = engine_argv(args)
    assert forwarded[forwarded.index("--prefill-batch-tokens") + 1] == "512"
    with pytest.raises(SystemExit, match="0 or more"):
        engine_options(parser.parse_args(["serve", "--prefill-batch-tokens", "-1"]))


def test_commands_start_without_what_they_do_not_use() -> None:
    # Every process of a server or a stack builds the command line first: it
    # must not import torch (seconds of every start); nor must the API side and
    # the supervisor, which hold no tensor; and a text-only server must not
    # import the media decoders (torchvision, and through it dynamo).
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from swallow.cli import build_parser\n"
        "build_parser()\n"
        "assert 'torch' not in sys.modules, 'the parser imported torch'\n"
        "import api.server, api.engine_core, api.engine_core_frontend, api.stack.frontend, api.stack.supervisor\n"
        "import swallow.cli, demo.routes\n"
        "assert 'torch' not in sys.modules, 'the API side or a supervisor imported torch'\n"
        "import api.stack.worker\n"
        "assert 'torchvision' not in sys.modules, 'the text-only serving path imported torchvision'\n"
        "assert 'torch._dynamo' not in sys.modules, 'the serving path imported dynamo'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
