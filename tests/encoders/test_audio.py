"""Whisper-family audio encoder against transformers' WhisperEncoder (the test-only oracle)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from encoders.audio import (
    AudioEncoder,
    AudioEncoderConfig,
    AudioInput,
    encoder_frames,
    load_audio_encoder,
)
from llm_core.model.config import ConfigError
from llm_core.loading.weights import CheckpointError

transformers = pytest.importorskip("transformers")
from transformers import WhisperConfig, WhisperForConditionalGeneration, WhisperModel  # noqa: E402
from transformers.models.whisper.modeling_whisper import WhisperEncoder  # noqa: E402

SMALL_POSITIONS = 100  # -> 200 mel frames per chunk: keeps the oracle fast
SMALL_FRAMES = 2 * SMALL_POSITIONS
N_MELS = 80
D_MODEL = 64
LLM_HIDDEN = 96
PARITY_TOL = 1e-4
BATCH_TOL = 1e-5


def whisper_config(max_source_positions: int = SMALL_POSITIONS) -> WhisperConfig:
    # Decoder sizes and token ids only matter for the full-model checkpoints;
    # they are kept tiny and inside the tiny vocabulary.
    return WhisperConfig(
        d_model=D_MODEL,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=128,
        num_mel_bins=N_MELS,
        max_source_positions=max_source_positions,
        decoder_layers=1,
        decoder_attention_heads=4,
        decoder_ffn_dim=64,
        max_target_positions=16,
        vocab_size=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=3,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Weights with non-trivial attention patterns, biases and norm affines.

    transformers' init leaves biases at 0, norms at identity and q/k so small that
    attention is nearly uniform; none of that would catch a misplaced bias or scale.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(module.named_parameters()):
        noise = torch.randn(p.shape, generator=gen)
        if "layer_norm" in name:
            p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
        elif p.dim() == 1:
            p.copy_(0.1 * noise)
        else:
            fan_in = p[0].numel()
            p.copy_(noise * (1.5 / math.sqrt(fan_in)))


def make_reference(max_source_positions: int = SMALL_POSITIONS, seed: int = 0) -> WhisperEncoder:
    torch.manual_seed(seed)
    ref = WhisperEncoder(whisper_config(max_source_positions)).eval()
    randomize_(ref, seed)
    return ref


def mel(chunks: int, frames: int = SMALL_FRAMES, seed: int = 1) -> torch.Tensor:
    return torch.randn(chunks, N_MELS, frames, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def reference_on_frames(ref: WhisperEncoder, chunk: torch.Tensor) -> torch.Tensor:
    """The oracle's own modules over just ``chunk`` ([n_mels, v]): Whisper without the padding."""
    x = F.gelu(ref.conv1(chunk[None]))
    x = F.gelu(ref.conv2(x)).transpose(1, 2)
    x = x + ref.embed_positions.weight[: x.shape[1]]
    for layer in ref.layers:
        x = layer(x, None)
    return ref.layer_norm(x)[0]


def with_mode(encoder: AudioEncoder, pad_to_full_chunk: bool) -> AudioEncoder:
    config = dataclasses.replace(encoder.config, pad_to_full_chunk=pad_to_full_chunk)
    other = AudioEncoder(config).eval()
    other.load_state_dict(encoder.state_dict())
    return other


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def write_multimodal_checkpoint(
    path: Path, ref: WhisperEncoder, projector: dict[str, torch.Tensor], drop: str | None = None
) -> Path:
    """A MiMo-style checkpoint: LLM tensors, ``audio_tower.``, ``audio_projector.``."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {f"audio_tower.{k}": v.contiguous() for k, v in ref.state_dict().items()}
    tensors |= {f"audio_projector.{k}": v for k, v in projector.items()}
    tensors["model.embed_tokens.weight"] = torch.zeros(8, LLM_HIDDEN)  # the LLM's, to be ignored
    tensors.pop(drop, None)
    save_file(tensors, str(path / "model.safetensors"))
    whisper = {k: v for k, v in ref.config.to_dict().items() if not k.startswith("decoder")}
    audio_config = whisper | {"out_hidden_size": LLM_HIDDEN, "projector_downsample": 2}
    config = {"model_type": "mimo_v2_omni", "hidden_size": LLM_HIDDEN, "audio_config": audio_config}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def reference() -> WhisperEncoder:
    return make_reference()


@pytest.fixture(scope="session")
def projector_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        "linear_1.weight": torch.randn(LLM_HIDDEN, 2 * D_MODEL, generator=gen) / math.sqrt(2 * D_MODEL),
        "linear_1.bias": 0.1 * torch.randn(LLM_HIDDEN, generator=gen),
        "linear_2.weight": torch.randn(LLM_HIDDEN, LLM_HIDDEN, generator=gen) / math.sqrt(LLM_HIDDEN),
        "linear_2.bias": 0.1 * torch.randn(LLM_HIDDEN, generator=gen),
    }


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, reference, projector_weights) -> dict[str, Path]:
    """The same tower saved in each layout the loader must understand."""
    root = tmp_path_factory.mktemp("audio_ckpt")
    dirs = {"encoder": root / "encoder", "model": root / "model", "conditional": root / "conditional"}
    reference.save_pretrained(dirs["encoder"])
    for key, cls in (("model", WhisperModel), ("conditional", WhisperForConditionalGeneration)):
        full = cls(reference.config)
        full.get_encoder().load_state_dict(reference.state_dict())
        full.save_pretrained(dirs[key])
    dirs["multimodal"] = write_multimodal_checkpoint(root / "multimodal", reference, projector_weights)
    return dirs


@pytest.fixture(scope="session")
def bare_encoder(checkpoints) -> AudioEncoder:
    return load_audio_encoder(checkpoints["encoder"])


@pytest.fixture(scope="session")
def mm_encoder(checkpoints) -> AudioEncoder:
    return load_audio_encoder(checkpoints["multimodal"])


# ---------------------------------------------------------------------------
# Parity with WhisperEncoder


def test_whisper_encoder_save_layout_is_bare(checkpoints):
    # What WhisperEncoder.save_pretrained writes decides which prefix the loader needs.
    from llm_core.loading.weights import CheckpointReader

    with CheckpointReader(checkpoints["encoder"]) as reader:
        assert "conv1.weight" in reader and "layers.1.fc2.bias" in reader
    with CheckpointReader(checkpoints["model"]) as reader:
        assert "encoder.conv1.weight" in reader
    with CheckpointReader(checkpoints["conditional"]) as reader:
        assert "model.encoder.conv1.weight" in reader


@pytest.mark.parametrize("layout", ["encoder", "model", "conditional", "multimodal"])
def test_tower_matches_whisper_encoder(layout, checkpoints, reference):
    encoder = load_audio_encoder(checkpoints[layout])
    assert (encoder.projector is not None) == (layout == "multimodal")
    features = mel(3)
    with torch.no_grad():
        expected = reference(features).last_hidden_state
        got = encoder.forward_chunks(features, [SMALL_FRAMES] * 3)
    diff = max_diff(got, expected.reshape(-1, D_MODEL))
    print(f"{layout}: tower vs WhisperEncoder max abs diff {diff:.2e}")
    assert diff <= PARITY_TOL
    if layout != "multimodal":
        (out,) = encoder.encode_batch([AudioInput(features, 3 * SMALL_FRAMES)])
        assert max_diff(out, expected.reshape(-1, D_MODEL)) <= PARITY_TOL


def test_projector_stacks_frames_within_each_chunk(mm_encoder, reference, projector_weights):
    # 200 + 77 valid frames: chunk 0 keeps 100 encoder frames, chunk 1 keeps 39,
    # whose last projector token pairs frame 38 with zeros.
    features = mel(2, seed=3)
    item = AudioInput(features, SMALL_FRAMES + 77)
    (out,) = mm_encoder.encode_batch([item])
    with torch.no_grad():
        tower = reference(features).last_hidden_state
    pieces = []
    for chunk, kept in ((tower[0], 100), (tower[1], 39)):
        rows = torch.cat([chunk[:kept], chunk.new_zeros(kept % 2, D_MODEL)])
        pieces.append(rows.reshape(-1, 2 * D_MODEL))
    stacked = torch.cat(pieces)
    w = projector_weights
    hidden = F.gelu(F.linear(stacked, w["linear_1.weight"], w["linear_1.bias"]))
    expected = F.linear(hidden, w["linear_2.weight"], w["linear_2.bias"])
    assert out.shape == (50 + 20, LLM_HIDDEN) and mm_encoder.num_tokens(item) == 70
    diff = max_diff(out, expected)
    print(f"projector vs hand-stacked reference max abs diff {diff:.2e}")
    assert diff <= PARITY_TOL


def test_pad_mode_partial_last_chunk_is_trimmed_reference(bare_encoder, reference):
    features = mel(2, seed=4)
    item = AudioInput(features, SMALL_FRAMES + 77)
    (out,) = bare_encoder.encode_batch([item])
    with torch.no_grad():
        expected = reference(features).last_hidden_state
    assert out.shape == (100 + 39, D_MODEL) == (bare_encoder.num_tokens(item), D_MODEL)
    diff = max_diff(out, torch.cat([expected[0], expected[1, :39]]))
    print(f"pad mode partial chunk max abs diff {diff:.2e}")
    assert diff <= PARITY_TOL
    assert bare_encoder.cost(item) == 2 * SMALL_POSITIONS


def test_trimmed_mode_runs_only_valid_frames(bare_encoder, reference):
    trimmed = with_mode(bare_encoder, pad_to_full_chunk=False)
    full = mel(1, seed=5)
    (pad_out,) = bare_encoder.encode_batch([AudioInput(full, SMALL_FRAMES)])
    (trim_out,) = trimmed.encode_batch([AudioInput(full, SMALL_FRAMES)])
    full_diff = max_diff(trim_out, pad_out)

    features = mel(2, seed=6)
    item = AudioInput(features, SMALL_FRAMES + 77)
    (out,) = trimmed.encode_batch([item])
    expected = torch.cat(
        [reference_on_frames(reference, features[0]), reference_on_frames(reference, features[1, :, :77])]
    )
    partial_diff = max_diff(out, expected)
    print(f"trimmed: full chunk vs pad mode {full_diff:.2e}; partial vs reference {partial_diff:.2e}")
    assert full_diff <= BATCH_TOL and partial_diff <= PARITY_TOL
    assert trimmed.num_tokens(item) == 139 and trimmed.cost(item) == 139


@pytest.mark.parametrize("pad_to_full_chunk", [True, False])
def test_batched_equals_single(mm_encoder, pad_to_full_chunk):
    encoder = with_mode(mm_encoder, pad_to_full_chunk)
    items = [
        AudioInput(mel(1, seed=10), SMALL_FRAMES),
        AudioInput(mel(2, seed=11), SMALL_FRAMES + 33),
        AudioInput(mel(1, seed=12), 1),
        AudioInput(mel(3, seed=13), 2 * SMALL_FRAMES + 150),
        AudioInput(mel(2, seed=14), 150),  # the second chunk holds no audio and is skipped
        AudioInput(mel(1, seed=15), 150),  # same valid length as the previous: one stem group
    ]
    batched = encoder.encode_batch(items)
    worst = 0.0
    for item, out in zip(items, batched):
        (alone,) = encoder.encode_batch([item])
        assert out.shape == (encoder.num_tokens(item), LLM_HIDDEN)
        assert torch.isfinite(out).all()
        worst = max(worst, max_diff(out, alone))
    print(f"pad_to_full_chunk={pad_to_full_chunk}: batched vs single max abs diff {worst:.2e}")
    assert worst <= BATCH_TOL
    assert [o.shape[0] for o in batched] == [50, 50 + 9, 1, 100 + 38, 38, 38]
    assert encoder.encode_batch([]) == []


def test_full_size_chunk_on_real_tone(tmp_path):
    """Default 1500 positions / 3000 frames, on log-mels of a synthetic tone."""
    from media.audio import audio_features

    ref = make_reference(max_source_positions=1500, seed=2)
    ref.save_pretrained(tmp_path)
    encoder = load_audio_encoder(tmp_path)
    assert encoder.config.chunk_frames == 3000

    sample_rate, seconds = 16000, 4.5
    t = torch.arange(int(sample_rate * seconds)) / sample_rate
    waveform = 0.5 * torch.sin(2 * math.pi * 440.0 * t) + 0.2 * torch.sin(2 * math.pi * 1250.0 * t)
    features = audio_features(waveform.float())
    item = AudioInput.from_waveform_length(features, waveform.numel())
    assert features.shape == (1, N_MELS, 3000) and item.num_frames == 450

    (pad_out,) = encoder.encode_batch([item])
    with torch.no_grad():
        expected = ref(features).last_hidden_state[0, :225]
    pad_diff = max_diff(pad_out, expected)

    trimmed = with_mode(encoder, pad_to_full_chunk=False)
    (trim_out,) = trimmed.encode_batch([item])
    trim_diff = max_diff(trim_out, reference_on_frames(ref, features[0, :, :450]))
    print(f"real tone: pad mode {pad_diff:.2e}, trimmed mode {trim_diff:.2e}")
    assert pad_diff <= PARITY_TOL and trim_diff <= PARITY_TOL
    assert (encoder.cost(item), trimmed.cost(item)) == (1500, 225)


def test_lower_precision_load(checkpoints):
    encoder = load_audio_encoder(checkpoints["multimodal"], dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in encoder.parameters())
    (out,) = encoder.encode_batch([AudioInput(mel(1), 100)])
    assert out.dtype == torch.bfloat16 and out.shape == (25, LLM_HIDDEN) and torch.isfinite(out).all()


# ---------------------------------------------------------------------------
# Config, input checks, checkpoint errors


def test_config_round_trip():
    hf = whisper_config().to_dict()
    config = AudioEncoderConfig.from_hf_dict(hf)
    assert (config.d_model, config.encoder_layers) == (D_MODEL, 2)
    assert config.max_source_positions == SMALL_POSITIONS
    assert config.out_hidden_size is None and config.pad_to_full_chunk
    assert config.chunk_frames == SMALL_FRAMES and config.head_dim == 16
    assert AudioEncoderConfig.from_hf_dict(config.to_hf_dict()) == config

    custom = dataclasses.replace(config, out_hidden_size=32, projector_downsample=4, pad_to_full_chunk=False)
    top = {"model_type": "mimo_v2_omni", "hidden_size": 32, "audio_config": custom.to_hf_dict()}
    assert AudioEncoderConfig.from_hf_dict(top) == custom
    # The Whisper field names are real: transformers reads them back.
    back = WhisperConfig(**{k: v for k, v in custom.to_hf_dict().items() if k in hf and k != "model_type"})
    assert (back.d_model, back.encoder_ffn_dim, back.num_mel_bins) == (D_MODEL, 128, N_MELS)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"encoder_attention_heads": 5}, "divisible"),
        ({"encoder_layers": 0}, "encoder_layers"),
        ({"d_model": True}, "d_model"),
        ({"max_source_positions": 1.5}, "max_source_positions"),
        ({"activation_function": "mish"}, "activation_function"),
        ({"out_hidden_size": -1}, "out_hidden_size"),
        ({"projector_downsample": 0}, "projector_downsample"),
        ({"layer_norm_eps": 0}, "layer_norm_eps"),
        ({"pad_to_full_chunk": "yes"}, "pad_to_full_chunk"),
    ],
)
def test_bad_config_is_config_error(change, message):
    d = AudioEncoderConfig(D_MODEL, 2, 4, 128).to_hf_dict() | change
    with pytest.raises(ConfigError, match=message):
        AudioEncoderConfig.from_hf_dict(d)


def test_config_without_audio_fields_is_config_error():
    with pytest.raises(ConfigError, match="audio_config"):
        AudioEncoderConfig.from_hf_dict({"model_type": "mimo_v2_flash", "hidden_size": 64})
    with pytest.raises(ConfigError, match="encoder_ffn_dim"):
        partial = {"d_model": 64, "encoder_layers": 1, "encoder_attention_heads": 4}
        AudioEncoderConfig.from_hf_dict({"audio_config": partial})
    with pytest.raises(ConfigError, match="JSON object"):
        AudioEncoderConfig.from_hf_dict({"audio_config": [1, 2]})


@pytest.mark.parametrize(
    "item, message",
    [
        (AudioInput(torch.zeros(N_MELS, SMALL_FRAMES), 10), "3-D|2-D"),
        (AudioInput(torch.zeros(0, N_MELS, SMALL_FRAMES), 1), "no chunks"),
        (AudioInput(torch.zeros(1, 128, SMALL_FRAMES), 10), "128 mel bins"),
        (AudioInput(torch.zeros(1, N_MELS, 3000), 10), "3000 mel frames"),
        (AudioInput(torch.zeros(1, N_MELS, SMALL_FRAMES, dtype=torch.int32), 10), "floating point"),
        (AudioInput(torch.zeros(1, N_MELS, SMALL_FRAMES), 0), "num_frames"),
        (AudioInput(torch.zeros(2, N_MELS, SMALL_FRAMES), 2 * SMALL_FRAMES + 1), "num_frames"),
        (AudioInput(torch.zeros(1, N_MELS, SMALL_FRAMES), 10.0), "num_frames"),
        (AudioInput(torch.full((1, N_MELS, SMALL_FRAMES), float("nan")), 10), "NaN"),
    ],
)
def test_check_rejects_bad_items(bare_encoder, item, message):
    with pytest.raises(ValueError, match=message):
        bare_encoder.check(item)
    with pytest.raises(ValueError, match=message):
        bare_encoder.encode_batch([AudioInput(mel(1), 5), item])


def test_token_counts_and_waveform_length():
    assert [encoder_frames(v) for v in (0, 1, 2, 3, 77, 200, 3000)] == [0, 1, 1, 2, 39, 100, 1500]
    features = torch.zeros(2, N_MELS, SMALL_FRAMES)
    assert AudioInput.from_waveform_length(features, 160 * 250 + 1).num_frames == 251
    assert AudioInput.from_waveform_length(features, 10**9).num_frames == 2 * SMALL_FRAMES
    with pytest.raises(ValueError):
        AudioInput.from_waveform_length(features, 0)
    config = AudioEncoderConfig(
        D_MODEL, 1, 4, 128, max_source_positions=SMALL_POSITIONS, out_hidden_size=8, projector_downsample=3
    )
    encoder = AudioEncoder(config)
    item = AudioInput(features, SMALL_FRAMES + 77)  # 100 + 39 encoder frames
    assert encoder.num_tokens(item) == 34 + 13
    assert encoder.cost(item) == 2 * SMALL_POSITIONS
    assert AudioEncoder(dataclasses.replace(config, out_hidden_size=None)).num_tokens(item) == 139


@pytest.mark.parametrize("drop", ["audio_tower.layers.1.fc2.bias", "audio_projector.linear_2.weight"])
def test_missing_tensor_is_named(tmp_path, reference, projector_weights, drop):
    path = write_multimodal_checkpoint(tmp_path, reference, projector_weights, drop=drop)
    with pytest.raises(CheckpointError, match=drop.replace(".", r"\.")):
        load_audio_encoder(path)


def test_checkpoint_without_tower_or_wrong_shape(tmp_path, reference, projector_weights):
    path = write_multimodal_checkpoint(
        tmp_path / "no_tower", reference, projector_weights, drop="audio_tower.conv1.weight"
    )
    with pytest.raises(CheckpointError, match="conv1.weight"):
        load_audio_encoder(path)
    path = write_multimodal_checkpoint(tmp_path / "wide", reference, projector_weights)
    config = json.loads((path / "config.json").read_text())
    config["audio_config"]["encoder_ffn_dim"] = 256
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="fc1.weight"):
        load_audio_encoder(path)


def test_identity_tracks_config_and_weights(mm_encoder):
    assert mm_encoder.identity == mm_encoder.identity and mm_encoder.identity.startswith("audio-")
    assert with_mode(mm_encoder, True).identity == mm_encoder.identity
    assert with_mode(mm_encoder, False).identity != mm_encoder.identity
    changed = with_mode(mm_encoder, True)
    with torch.no_grad():
        changed.projector.linear_2.bias[0] += 1.0
    assert changed.identity != mm_encoder.identity
