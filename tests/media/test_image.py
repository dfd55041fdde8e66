"""media.image, image_decode, vision_preprocess and image_dali: decoding, smart_resize
and Qwen2-VL preprocessing, checked against transformers (used here as an oracle only). All images are drawn in the test."""

from __future__ import annotations

import io
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageOps

from media.errors import MediaError, MediaLimits
from media.image import load_images_batch
from media.image_decode import load_image, probe_image
from media.vision_geometry import VisionPreprocessConfig, smart_resize
from media.vision_preprocess import ImageBatch, preprocess_images

# Tolerances on pixel_values (normalised units: one uint8 level is ~0.015). Measured on
# this file's images, then given some headroom:
# * transformers' torchvision processor: bit-identical on CPU (max |diff| 0.0); the atol
#   only allows for another CPU's kernel choice.
# * transformers' PIL processor: Pillow's and torchvision's bicubic agree within 1-2 levels
#   almost everywhere (measured mean 3e-4..7e-4, 0.02-0.06% of values off by more than 2
#   levels), but clamp overshoot at sharp edges differently when one side shrinks and the
#   other grows: a few isolated values differ by up to 23 levels (max 0.336).
# * DALI's cubic resampler: measured max 0.330, mean 2.6e-3, 0.14% > 2 levels.
FAST_ATOL = 1e-5
TWO_LEVELS = 0.031
SLOW_MAX, SLOW_MEAN, SLOW_FRAC = 0.4, 1e-3, 2e-3
DALI_MAX, DALI_MEAN, DALI_FRAC = 0.4, 5e-3, 5e-3


# ---------------------------------------------------------------------------------------
# Test images
# ---------------------------------------------------------------------------------------


def _drawing(w: int, h: int, seed: int, mode: str = "RGB") -> Image.Image:
    """Gradients, shapes and a little noise: enough structure that resampler differences
    show, and JPEG-realistic rather than pure noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    arr = np.stack(
        [xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), (xx * 3 + yy * 5) % 256], -1
    )
    arr = (arr + rng.integers(-12, 12, arr.shape)).clip(0, 255).astype(np.uint8)
    im = Image.fromarray(arr, "RGB")
    d = ImageDraw.Draw(im)
    for _ in range(6):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        x1, y1 = x0 + int(rng.integers(1, w // 2 + 2)), y0 + int(rng.integers(1, h // 2 + 2))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            d.ellipse([x0, y0, x1, y1], fill=color)
        else:
            d.rectangle([x0, y0, x1, y1], outline=color, width=3)
    d.line([(0, 0), (w - 1, h - 1)], fill=(255, 255, 255), width=2)
    if mode == "RGBA":
        alpha = Image.fromarray((xx * 255 // max(w - 1, 1)).astype(np.uint8), "L")
        im.putalpha(alpha)
    elif mode != "RGB":
        im = im.convert(mode)
    return im


def _encode(im: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _gif_with_transparency() -> bytes:
    im = _drawing(200, 120, 7).convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    return _encode(im, "GIF", transparency=0)


def _png16_gray() -> bytes:
    arr = (np.mgrid[0:90, 0:140][1] * 467).astype(np.uint16)  # 0..65000, most above 255
    return _encode(Image.fromarray(arr), "PNG")  # uint16 -> mode I;16


# name -> (encoded bytes, whether the fast decoder should be used)
CASES: dict[str, tuple[Callable[[], bytes], bool]] = {
    "jpeg_1080p": (lambda: _encode(_drawing(1920, 1080, 1), "JPEG", quality=90), True),
    "jpeg_odd": (lambda: _encode(_drawing(457, 301, 2), "JPEG", quality=85), True),
    "jpeg_gray": (lambda: _encode(_drawing(311, 233, 3, "L"), "JPEG"), True),
    "jpeg_cmyk": (lambda: _encode(_drawing(180, 150, 4, "CMYK"), "JPEG"), False),
    "jpeg_panorama": (lambda: _encode(_drawing(2400, 60, 5), "JPEG"), True),
    "png_rgb": (lambda: _encode(_drawing(250, 190, 6), "PNG"), True),
    "png_gray_tall": (lambda: _encode(_drawing(90, 1500, 8, "L"), "PNG"), True),
    "png_palette": (lambda: _encode(_drawing(173, 129, 9, "P"), "PNG"), True),
    "png_rgba": (lambda: _encode(_drawing(240, 160, 10, "RGBA"), "PNG"), False),
    "png_tiny": (lambda: _encode(_drawing(30, 20, 11), "PNG"), True),  # < min_pixels
    "png_1x1": (lambda: _encode(_drawing(1, 1, 12), "PNG"), True),
    "gif_palette": (lambda: _encode(_drawing(200, 120, 13, "P"), "GIF"), False),
    "gif_transparent": (_gif_with_transparency, False),
    "webp_lossy": (lambda: _encode(_drawing(330, 210, 14), "WEBP", quality=80), True),
    "webp_lossless": (lambda: _encode(_drawing(129, 97, 15), "WEBP", lossless=True), True),
    "webp_alpha": (lambda: _encode(_drawing(150, 100, 16, "RGBA"), "WEBP", lossless=True), False),
}


@pytest.fixture(scope="module")
def encoded() -> dict[str, bytes]:
    return {name: make() for name, (make, _) in CASES.items()}


def _reference_rgb(data: bytes) -> torch.Tensor:
    """What transformers feeds its processors for a PIL image: convert_to_rgb (alpha
    composited on white), as a CHW uint8 tensor."""
    from transformers.image_transforms import convert_to_rgb

    arr = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    return torch.from_numpy(np.ascontiguousarray(arr)).permute(2, 0, 1)


def _processors(**kw: object) -> tuple[object, object]:
    """(torchvision "fast", PIL "slow") Qwen2-VL processors across transformers versions:
    v5 renamed the fast one to Qwen2VLImageProcessor and the slow one to ...Pil."""
    transformers = pytest.importorskip("transformers")
    if hasattr(transformers, "Qwen2VLImageProcessorPil"):
        return transformers.Qwen2VLImageProcessor(**kw), transformers.Qwen2VLImageProcessorPil(**kw)
    return transformers.Qwen2VLImageProcessorFast(**kw), transformers.Qwen2VLImageProcessor(**kw)


def _hf_kwargs(cfg: VisionPreprocessConfig) -> dict[str, object]:
    return dict(
        min_pixels=cfg.min_pixels,
        max_pixels=cfg.max_pixels,
        patch_size=cfg.patch_size,
        merge_size=cfg.merge_size,
        temporal_patch_size=cfg.temporal_patch_size,
        image_mean=list(cfg.image_mean),
        image_std=list(cfg.image_std),
    )


# ---------------------------------------------------------------------------------------
# smart_resize
# ---------------------------------------------------------------------------------------


def _hf_smart_resize() -> Callable[..., tuple[int, int]]:
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as ref

    return ref


@pytest.mark.parametrize(
    "h,w,kw",
    [
        (1080, 1920, {}),
        (1, 1, {}),
        (20, 30, {}),  # below min_pixels
        (27, 27, {}),
        (14, 14, {}),  # rounds to 0x0
        (42, 42, {}),  # exactly on a .5 rounding boundary (half-to-even)
        (70, 70, {}),
        (301, 457, {}),
        (60, 2400, {}),
        (10, 1500, {}),  # one side rounds to 0
        (100, 20000, {}),  # ratio exactly 200
        (4000, 3000, {}),
        (8000, 8000, {}),
        (1080, 1920, {"max_pixels": 256 * 28 * 28}),
        (300, 400, {"min_pixels": 512 * 28 * 28, "max_pixels": 1024 * 28 * 28}),
        (1080, 1920, {"factor": 32, "min_pixels": 64 * 64, "max_pixels": 32 * 32 * 1024}),
    ],
)
def test_smart_resize_cases(h: int, w: int, kw: dict[str, int]) -> None:
    assert smart_resize(h, w, **kw) == _hf_smart_resize()(h, w, **kw)


def test_smart_resize_random_sizes() -> None:
    ref = _hf_smart_resize()
    rng = np.random.default_rng(0)
    for _ in range(500):
        h, w = (int(x) for x in rng.integers(1, 5000, 2))
        if max(h, w) / min(h, w) > 200:
            continue
        factor = int(rng.choice([28, 32]))
        got = smart_resize(h, w, factor=factor)
        assert got == ref(h, w, factor=factor), (h, w, factor)
        assert got[0] % factor == 0 and got[1] % factor == 0


@pytest.mark.parametrize("h,w", [(1, 201), (1000, 4), (3, 20000)])
def test_smart_resize_aspect_ratio(h: int, w: int) -> None:
    with pytest.raises(MediaError, match="aspect ratio") as ei:
        smart_resize(h, w)
    assert ei.value.status == 400
    assert "200:1" in str(ei.value)


# ---------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_load_image_matches_pillow(name: str, encoded: dict[str, bytes]) -> None:
    data = encoded[name]
    img = load_image(data)
    assert img.dtype == torch.uint8 and img.shape[0] == 3
    # Routing: plain images take the torchvision decoder, and must still equal Pillow's.
    assert (probe_image(data, MediaLimits()).codec is not None) == CASES[name][1]
    torch.testing.assert_close(img, _reference_rgb(data), atol=0, rtol=0)


def test_load_image_16bit_png_scaled_not_clipped() -> None:
    data = _png16_gray()
    img = load_image(data)
    expected = torch.from_numpy((np.asarray(Image.open(io.BytesIO(data))).astype(np.int64) >> 8).astype(np.uint8))
    assert torch.equal(img[0], expected) and torch.equal(img[1], img[0]) and torch.equal(img[2], img[0])
    assert int(img.max()) > 200  # Pillow's convert("RGB") would clip everything to 255


def test_load_image_from_path(tmp_path: Path, encoded: dict[str, bytes]) -> None:
    path = tmp_path / "photo.jpg"
    path.write_bytes(encoded["jpeg_odd"])
    assert torch.equal(load_image(path), load_image(encoded["jpeg_odd"]))
    assert torch.equal(load_image(str(path)), load_image(encoded["jpeg_odd"]))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation(orientation: int) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = _encode(_drawing(64, 40, 20), "JPEG", exif=exif.tobytes())
    expected = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    img = load_image(data)
    assert torch.equal(img, torch.from_numpy(np.array(expected)).permute(2, 0, 1))


# ---------------------------------------------------------------------------------------
# Preprocessing vs transformers
# ---------------------------------------------------------------------------------------

HF_CASES = [n for n in CASES if n != "jpeg_cmyk"]  # see test_cmyk_decoded_like_pillow


def _hf_run(processor: object, datas: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    pils = [Image.open(io.BytesIO(d)) for d in datas]
    out = processor(images=pils, return_tensors="pt")  # type: ignore[operator]
    return torch.as_tensor(out["pixel_values"]).float(), torch.as_tensor(out["image_grid_thw"])


CONFIGS = {
    "qwen2vl": VisionPreprocessConfig(),
    "small_budget": VisionPreprocessConfig(min_pixels=8 * 28 * 28, max_pixels=128 * 28 * 28),
    # Qwen3-VL-like: 16px patches, 0.5 mean/std, temporal 2.
    "p16": VisionPreprocessConfig(
        patch_size=16, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), max_pixels=32 * 32 * 512
    ),
}


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_matches_transformers(cfg_name: str, encoded: dict[str, bytes]) -> None:
    cfg = CONFIGS[cfg_name]
    fast, slow = _processors(**_hf_kwargs(cfg))
    datas = [encoded[n] for n in HF_CASES]
    mine = load_images_batch(datas, cfg)

    pv_fast, grid_fast = _hf_run(fast, datas)
    assert torch.equal(mine.grid_thw, grid_fast)
    assert mine.pixel_values.dtype == torch.float32
    assert mine.pixel_values.shape == (int(grid_fast.prod(-1).sum()), cfg.patch_dim)
    # Measured: bit-identical (max |diff| = 0.0).
    torch.testing.assert_close(mine.pixel_values, pv_fast, atol=FAST_ATOL, rtol=0)

    pv_slow, grid_slow = _hf_run(slow, datas)
    assert torch.equal(mine.grid_thw, grid_slow)
    _assert_near(mine.pixel_values, pv_slow, SLOW_MAX, SLOW_MEAN, SLOW_FRAC)


def _assert_near(got: torch.Tensor, ref: torch.Tensor, max_: float, mean: float, frac: float) -> None:
    """Close in distribution: a bound on the worst value, the mean, and the share of
    values more than two uint8 levels off."""
    diff = (got - ref).abs()
    stats = (float(diff.max()), float(diff.mean()), float((diff > TWO_LEVELS).float().mean()))
    assert stats[0] <= max_ and stats[1] <= mean and stats[2] <= frac, stats


def test_cmyk_decoded_like_pillow(encoded: dict[str, bytes]) -> None:
    # transformers gets the same pixels from a CMYK JPEG only through Pillow's conversion,
    # which is what load_image uses; preprocessing the decoded tensor then matches.
    fast, _ = _processors()
    mine = preprocess_images([load_image(encoded["jpeg_cmyk"])])
    pv, grid = _hf_run(fast, [encoded["jpeg_cmyk"]])
    assert torch.equal(mine.grid_thw, grid)
    torch.testing.assert_close(mine.pixel_values, pv, atol=FAST_ATOL, rtol=0)


def test_batched_equals_per_image(encoded: dict[str, bytes]) -> None:
    cfg = VisionPreprocessConfig()
    # Repeats and equal target sizes exercise the grouping and the reordering gather.
    names = ["png_rgb", "jpeg_odd", "png_rgb", "png_tiny", "jpeg_odd", "webp_lossy", "png_1x1"]
    images = [load_image(encoded[n]) for n in names]
    batch = preprocess_images(images, cfg)
    singles = [preprocess_images([img], cfg) for img in images]
    assert torch.equal(batch.pixel_values, torch.cat([s.pixel_values for s in singles]))
    assert torch.equal(batch.grid_thw, torch.cat([s.grid_thw for s in singles]))
    assert len(batch) == len(names)
    for part, single, img in zip(batch.split(), singles, images):
        assert torch.equal(part, single.pixel_values)
        assert tuple(single.grid_thw[0].tolist()) == cfg.grid_thw(img.shape[1], img.shape[2])
    # decode+preprocess in one call, threaded or not, is the same thing
    datas = [encoded[n] for n in names]
    for threads in (1, 2):
        both = load_images_batch(datas, cfg, num_threads=threads)
        assert torch.equal(both.pixel_values, batch.pixel_values)
        assert torch.equal(both.grid_thw, batch.grid_thw)


def test_num_tokens_and_empty_batch() -> None:
    cfg = VisionPreprocessConfig()
    assert cfg.grid_thw(1080, 1920) == (1, 52, 94)  # 728x1316 after smart_resize
    assert cfg.num_tokens(1080, 1920) == 52 * 94 // 4
    empty = load_images_batch([], cfg)
    assert empty.pixel_values.shape == (0, cfg.patch_dim) and empty.grid_thw.shape == (0, 3)
    assert isinstance(preprocess_images([], cfg), ImageBatch)
    with pytest.raises(ValueError, match="backend"):
        preprocess_images([torch.zeros(3, 8, 8, dtype=torch.uint8)], backend="opencv")
    with pytest.raises(ValueError, match="uint8"):
        preprocess_images([torch.zeros(3, 8, 8)])


# ---------------------------------------------------------------------------------------
# DALI (CPU pipeline)
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dali_cpu() -> None:
    pytest.importorskip("nvidia.dali", reason="nvidia-dali is not installed")
    try:
        preprocess_images([torch.zeros(3, 56, 56, dtype=torch.uint8)], backend="dali")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"DALI cannot run a CPU pipeline here: {type(e).__name__}: {e}")


def test_dali_cpu_close_to_torchvision(dali_cpu: None, encoded: dict[str, bytes]) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated = _encode(_drawing(300, 200, 21), "JPEG", exif=exif.tobytes())
    # plain JPEG/PNG/WebP decode in DALI; RGBA/GIF/CMYK are decoded by Pillow and only
    # resized by DALI; the EXIF-rotated JPEG checks DALI's orientation handling.
    datas = [encoded[n] for n in CASES] + [rotated]
    ref = load_images_batch(datas, backend="torchvision")
    got = load_images_batch(datas, backend="dali")
    assert torch.equal(got.grid_thw, ref.grid_thw)
    _assert_near(got.pixel_values, ref.pixel_values, DALI_MAX, DALI_MEAN, DALI_FRAC)
    # The resize-only entry point (decoded tensors in) gives what decode+resize gave:
    # DALI's decoders agree with libjpeg-turbo/libpng/libwebp here.
    decoded = [load_image(d) for d in datas]
    again = preprocess_images(decoded, backend="dali")
    assert torch.equal(again.pixel_values, got.pixel_values)


def test_dali_cpu_bad_input(dali_cpu: None, encoded: dict[str, bytes]) -> None:
    truncated = encoded["jpeg_odd"][:-2]  # header fine (probe passes), data cut short
    with pytest.raises(MediaError) as ei:
        load_images_batch([encoded["png_rgb"], truncated], backend="dali")
    assert ei.value.status == 400 and str(ei.value).startswith("image 1: ")
    assert "truncated JPEG" in str(ei.value) and "\n" not in str(ei.value)
    # the cached pipeline still works after the error
    assert len(load_images_batch([encoded["png_rgb"]], backend="dali")) == 1


# ---------------------------------------------------------------------------------------
# GPU paths
# ---------------------------------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@requires_cuda
def test_cuda_preprocess_close_to_cpu(encoded: dict[str, bytes]) -> None:
    images = [load_image(encoded[n]) for n in CASES]
    ref = preprocess_images(images)
    got = preprocess_images(images, device="cuda")
    assert got.pixel_values.is_cuda
    assert torch.equal(got.grid_thw.cpu(), ref.grid_thw)
    # CUDA bicubic runs in float and rounds once; the CPU uint8 kernel clamps between its
    # two passes -- the same kind of edge-overshoot difference as PIL vs torchvision.
    # Not measured here (no GPU on the dev machine): bounds as for the slow processor.
    _assert_near(got.pixel_values.cpu(), ref.pixel_values, SLOW_MAX, 2e-3, 5e-3)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("backend", ["torchvision", "dali"])
def test_cuda_decode_close_to_cpu(backend: str, encoded: dict[str, bytes]) -> None:
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    datas = [encoded[n] for n in CASES]
    ref = load_images_batch(datas)
    got = load_images_batch(datas, device="cuda", backend=backend)
    assert torch.equal(got.grid_thw.cpu(), ref.grid_thw)
    # nvJPEG's IDCT / chroma upsampling differ from libjpeg-turbo's by a few levels, on
    # top of the resize differences. Not measured here (no GPU on the dev machine).
    _assert_near(got.pixel_values.cpu(), ref.pixel_values, 0.6, 0.01, 0.05)


@pytest.mark.gpu
@requires_cuda
def test_cuda_truncated_jpeg_raises(encoded: dict[str, bytes]) -> None:
    data = encoded["jpeg_odd"]
    with pytest.raises(MediaError) as ei:
        load_images_batch([encoded["png_rgb"], data[: len(data) // 2]], device="cuda")
    assert ei.value.status == 400 and "image 1" in str(ei.value)


# ---------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------


def _png_claiming(width: int, height: int) -> bytes:
    """A real 1x1 PNG whose IHDR claims width x height (CRC fixed up): a decompression
    bomb header, built without allocating anything."""
    data = bytearray(_encode(Image.new("RGB", (1, 1)), "PNG"))
    assert data[12:16] == b"IHDR"
    data[16:20] = width.to_bytes(4, "big")
    data[20:24] = height.to_bytes(4, "big")
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")
    return bytes(data)


def _half(data: bytes) -> bytes:
    return data[: len(data) // 2]


BAD: list[tuple[str, Callable[[dict[str, bytes]], bytes], MediaLimits, int, str]] = [
    ("zero_bytes", lambda e: b"", MediaLimits(), 400, "empty"),
    ("truncated_jpeg", lambda e: _half(e["jpeg_odd"]), MediaLimits(), 400, "truncated JPEG"),
    ("jpeg_missing_eoi", lambda e: e["jpeg_odd"][:-2], MediaLimits(), 400, "truncated JPEG"),
    (
        "truncated_progressive_jpeg",
        lambda e: _half(_encode(_drawing(200, 150, 30), "JPEG", progressive=True)),
        MediaLimits(),
        400,
        "truncated JPEG",
    ),
    ("jpeg_header_only", lambda e: e["jpeg_odd"][:20], MediaLimits(), 400, "truncated JPEG"),
    ("truncated_png", lambda e: _half(e["png_rgb"]), MediaLimits(), 400, "truncated PNG"),
    ("truncated_rgba_png", lambda e: _half(e["png_rgba"]), MediaLimits(), 400, "truncated PNG"),
    ("truncated_gif", lambda e: _half(e["gif_palette"]), MediaLimits(), 400, "truncated GIF"),
    ("truncated_webp", lambda e: _half(e["webp_lossy"]), MediaLimits(), 400, "truncated WebP"),
    (
        "random_bytes",
        lambda e: np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        MediaLimits(),
        415,
        "not an image",
    ),
    ("text", lambda e: b"Hello! This is a plain text file.\n" * 20, MediaLimits(), 415, "not an image"),
    ("bmp", lambda e: _encode(_drawing(40, 30, 31), "BMP"), MediaLimits(), 415, "JPEG, PNG, WebP or GIF"),
    # 81 Mpx: over our 64 Mpx limit, under Pillow's own guard -> our header check
    ("bomb_header", lambda e: _png_claiming(9000, 9000), MediaLimits(), 413, "9000x9000"),
    # 900 Mpx: Pillow's guard fires inside Image.open
    ("pil_bomb_header", lambda e: _png_claiming(30000, 30000), MediaLimits(), 413, "900000000 pixels"),
    ("over_pixel_limit", lambda e: e["png_rgb"], MediaLimits(max_image_pixels=10_000), 413, "limit is 10000"),
    ("over_file_limit", lambda e: e["png_rgb"], MediaLimits(max_file_bytes=100), 413, "limit is 100 bytes"),
]


@pytest.mark.parametrize("name,make,limits,status,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input(
    name: str,
    make: Callable[[dict[str, bytes]], bytes],
    limits: MediaLimits,
    status: int,
    needle: str,
    encoded: dict[str, bytes],
    tmp_path: Path,
) -> None:
    data = make(encoded)
    with pytest.raises(MediaError) as ei:
        load_image(data, limits=limits)
    assert ei.value.status == status, str(ei.value)
    assert needle in str(ei.value)
    assert "Traceback" not in str(ei.value) and len(str(ei.value)) < 300
    # same answer from a file, and from the batch API (which names the image)
    path = tmp_path / "upload.bin"
    path.write_bytes(data)
    with pytest.raises(MediaError) as ei_path:
        load_image(path, limits=limits)
    assert ei_path.value.status == status
    with pytest.raises(MediaError) as ei_batch:
        load_images_batch([encoded["png_1x1"], data], limits=limits)
    assert ei_batch.value.status == status and str(ei_batch.value).startswith("image 1: ")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(MediaError, match="not found") as ei:
        load_image(tmp_path / "nope.png")
    assert ei.value.status == 400


def test_aspect_ratio_rejected_in_batch(encoded: dict[str, bytes]) -> None:
    thin = _encode(_drawing(1000, 4, 40), "PNG")
    assert load_image(thin).shape == (3, 4, 1000)  # decoding is fine...
    with pytest.raises(MediaError, match="aspect ratio") as ei:  # ...the model can't take it
        load_images_batch([encoded["png_rgb"], thin])
    assert ei.value.status == 400 and str(ei.value).startswith("image 1: ")
    with pytest.raises(MediaError, match="aspect ratio"):
        preprocess_images([load_image(thin)])


@pytest.mark.parametrize("t,h,w", [(4, 90, 160), (5, 240, 320), (1, 64, 64)])
def test_preprocess_video_matches_transformers(t: int, h: int, w: int) -> None:
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from media import preprocess_video

    frames = torch.randint(0, 256, (t, h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(t))
    ref = Qwen2VLVideoProcessor()(
        videos=[frames.permute(0, 3, 1, 2)], return_tensors="pt", do_sample_frames=False, cap_pixels_per_frame=False
    )
    ours = preprocess_video(frames)
    assert ours.grid_thw.tolist() == ref["video_grid_thw"].tolist()
    assert torch.equal(ours.pixel_values, ref["pixel_values_videos"])


def test_preprocess_video_rejects_bad_frames() -> None:
    from media import preprocess_video

    with pytest.raises(ValueError, match=r"\[T, H, W, 3\]"):
        preprocess_video(torch.zeros(2, 3, 32, 32, dtype=torch.uint8))
    with pytest.raises(MediaError, match="no frames"):
        preprocess_video(torch.zeros(0, 32, 32, 3, dtype=torch.uint8))
