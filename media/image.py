"""Image decoding and Qwen2-VL / Qwen2.5-VL vision preprocessing.

Decoding (``load_image``)
    JPEG, PNG, WebP and GIF (first frame) into an RGB ``uint8`` tensor ``[3, H, W]``.
    Every input is first opened *lazily* with Pillow, which parses only the header: that
    gives the format, mode and size, so the pixel-count limit (decompression bombs) is
    enforced before a single pixel is decoded. "Plain" images (8-bit RGB/grey JPEG, 8-bit
    RGB/grey/palette PNG without transparency, still opaque WebP) are then decoded by
    torchvision (libjpeg-turbo / libpng / libwebp, ~25% faster than Pillow here and
    bit-identical to it, checked in the tests); everything else goes through Pillow.

    Conversions, chosen to match ``transformers`` (which converts PIL images with
    ``convert_to_rgb``): palette/grey/CMYK -> RGB with Pillow's conversions; any
    transparency (alpha band or a ``transparency`` key) is *composited on white*, not
    dropped, so a transparent background does not turn black. 16-bit grey PNGs are scaled
    to 8 bits (``>> 8``; Pillow's own ``I;16 -> RGB`` conversion clips to 255 instead).
    EXIF orientation is applied (like ``transformers.image_utils.load_image``), so phone
    photos come out upright.

    Truncated or corrupt data always raises ``MediaError`` (torchvision's decoders raise
    on a premature end of data; Pillow does too as long as nobody has set the process-wide
    ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES``).

Preprocessing (``preprocess_images``, ``load_images_batch``)
    Reproduces ``transformers.Qwen2VLImageProcessor`` (the torchvision, ex-"Fast",
    processor): ``smart_resize`` target size, bicubic antialiased resize of the uint8
    image with torchvision, rescale + CLIP normalisation in float32, and the Qwen2-VL
    patch layout. On CPU the result is bit-identical to transformers' (the same float32
    operations in the same order). Backends:

    * ``"torchvision"``: CPU or CUDA tensors; with ``load_images_batch`` on CUDA, plain
      JPEGs are decoded together by nvJPEG (``decode_jpeg(device='cuda')``).
    * ``"dali"``: NVIDIA DALI pipeline (CPU with ``device_id=None``, ``"mixed"`` nvJPEG
      decoder + GPU resize on CUDA), fed with the encoded bytes. DALI's cubic resampler is
      not torchvision's. Measured on CPU against the torchvision path
      (``tests/media/test_image.py``): mean |pixel_values diff| 2.6e-3 (one uint8 level is
      ~0.015), 0.14% of values more than two levels off, max 0.33 at sharp edges.
    * ``"auto"``: torchvision (on CPU or on CUDA, following ``device``).

    Exactness across paths: CPU torchvision == transformers' torchvision processor, bit for
    bit. transformers' PIL processor (Pillow's resampler) agrees within 1-2 uint8 levels
    almost everywhere, but a few isolated values at sharp edges differ by up to ~23 levels
    (max |diff| 0.34) because the two resamplers clamp overshoot differently. CUDA's bicubic
    runs in float (no intermediate uint8 clamp) and so differs from CPU in the same way.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torchvision.io import ImageReadMode, decode_jpeg, decode_png, decode_webp
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as tvF

from media.errors import DEFAULT_LIMITS, MediaError, MediaLimits

ImageSource = str | os.PathLike[str] | bytes | bytearray | memoryview

BACKENDS = ("auto", "torchvision", "dali")

# What we accept. Restricting Pillow to these also keeps its rarer (and historically
# buggier) decoders away from untrusted input. (Pillow's JPEG opener may report "MPO",
# the multi-picture JPEG many phones write; its first picture is an ordinary JPEG.)
_PIL_FORMATS = ("JPEG", "PNG", "WEBP", "GIF")
_FORMAT_NAMES = "JPEG, PNG, WebP or GIF"

# Magic numbers, to tell "a damaged image of a supported format" (400) from "not an
# image we support" (415) when Pillow cannot even parse the header.
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
)

# EXIF orientation tag (0x0112) -> the tensor op that makes the image upright, on
# [..., H, W]. Equivalent to PIL.ImageOps.exif_transpose (checked in the tests).
_ORIENT_OPS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    2: lambda t: t.flip(-1),  # mirrored horizontally
    3: lambda t: t.flip(-2, -1),  # rotated 180
    4: lambda t: t.flip(-2),  # mirrored vertically
    5: lambda t: t.transpose(-2, -1),  # PIL TRANSPOSE
    6: lambda t: torch.rot90(t, -1, (-2, -1)),  # PIL ROTATE_270 (90 clockwise)
    7: lambda t: t.transpose(-2, -1).flip(-2, -1),  # PIL TRANSVERSE
    8: lambda t: torch.rot90(t, 1, (-2, -1)),  # PIL ROTATE_90 (90 counter-clockwise)
}


# ---------------------------------------------------------------------------------------
# Reading and probing
# ---------------------------------------------------------------------------------------


def _read_source(source: ImageSource, limits: MediaLimits) -> bytes:
    """The encoded bytes of ``source`` (a path or the bytes themselves), size-checked."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if len(data) > limits.max_file_bytes:
            raise MediaError(_too_big_file(len(data), limits), status=413)
    elif isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        try:
            # stat first so an oversized file is refused without reading it.
            size = os.stat(path).st_size
            if size > limits.max_file_bytes:
                raise MediaError(_too_big_file(size, limits), status=413)
            with open(path, "rb") as f:
                data = f.read(limits.max_file_bytes + 1)
        except FileNotFoundError:
            raise MediaError(f"image file not found: {path!r}") from None
        except IsADirectoryError:
            raise MediaError(f"image path is a directory: {path!r}") from None
        except PermissionError:
            raise MediaError(f"image file is not readable: {path!r}") from None
        if len(data) > limits.max_file_bytes:  # grew between stat and read
            raise MediaError(_too_big_file(len(data), limits), status=413)
    else:
        raise TypeError(f"image source must be a path or bytes, got {type(source).__name__}")
    if not data:
        raise MediaError("image data is empty (0 bytes)")
    return data


def _too_big_file(n: int, limits: MediaLimits) -> str:
    return f"image file is {n} bytes; the limit is {limits.max_file_bytes} bytes"


@dataclass
class _Probe:
    """What the header says, and how the pixels will be decoded."""

    data: bytes
    pil: Image.Image  # opened lazily: header parsed, pixels not decoded yet
    fmt: str  # Pillow's format name
    width: int  # as stored (before EXIF orientation)
    height: int
    orientation: int  # EXIF orientation tag, 1 = as stored
    # "jpeg" / "png" / "webp" when torchvision (and DALI) decode it to exactly the pixels
    # Pillow + transformers' convert_to_rgb would give; None -> decode with Pillow.
    codec: str | None

    @property
    def out_hw(self) -> tuple[int, int]:
        """(H, W) of the upright image (orientations 5-8 swap the sides)."""
        if self.orientation in (5, 6, 7, 8):
            return self.width, self.height
        return self.height, self.width


def _sniff(data: bytes) -> str | None:
    """Format name from the magic number, for data Pillow could not parse."""
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    return None


def _probe(data: bytes, limits: MediaLimits) -> _Probe:
    try:
        im = Image.open(io.BytesIO(data), formats=_PIL_FORMATS)
    except Image.DecompressionBombError as e:
        # Pillow's own guard (above 2x PIL.Image.MAX_IMAGE_PIXELS, ~179 Mpx) fires inside
        # open(), before we see the size; it is the binding limit above that size even if
        # limits.max_image_pixels is set higher.
        found = re.search(r"\((\d+) pixels\)", str(e))
        what = f"image has {found.group(1)} pixels" if found else "image is too large"
        raise MediaError(f"{what}; the limit is {limits.max_image_pixels} pixels", status=413) from None
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - any parser failure on untrusted bytes is the input's fault
        name = _sniff(data)
        if name is not None:
            # A supported format whose header is damaged: a bad request, not a wrong type.
            detail = "unreadable header" if isinstance(e, UnidentifiedImageError) else _short(e)
            raise MediaError(f"corrupt or truncated {name} image ({detail})") from None
        if isinstance(e, UnidentifiedImageError):
            raise MediaError(
                f"unsupported image format or not an image; expected {_FORMAT_NAMES}", status=415
            ) from None
        raise MediaError(f"corrupt image header ({_short(e)})") from None

    width, height = im.size
    if width <= 0 or height <= 0:
        raise MediaError(f"image has invalid dimensions {width}x{height}")
    if width * height > limits.max_image_pixels:
        raise MediaError(
            f"image is {width}x{height} = {width * height} pixels; the limit is "
            f"{limits.max_image_pixels} pixels",
            status=413,
        )
    fmt = im.format or "?"
    return _Probe(
        data=data,
        pil=im,
        fmt=fmt,
        width=width,
        height=height,
        orientation=_exif_orientation(im, fmt),
        codec=_plain_codec(im, fmt, data),
    )


def _exif_orientation(im: Image.Image, fmt: str) -> int:
    """EXIF orientation from the header, without decoding pixels. Broken EXIF is ignored
    (orientation is cosmetic; refusing the image over it would be unhelpful)."""
    try:
        if fmt in ("PNG", "GIF") and "exif" not in im.info:
            # Pillow's PNG getexif() would decode the whole image to look for a late eXIf
            # chunk; only honour EXIF that sits in the header.
            return 1
        value = im.getexif().get(0x0112, 1)
        return int(value) if int(value) in _ORIENT_OPS else 1
    except Exception:  # noqa: BLE001
        return 1


def _plain_codec(im: Image.Image, fmt: str, data: bytes) -> str | None:
    """Which fast decoder gives exactly Pillow's RGB for this image, if any."""
    if "transparency" in im.info:
        return None  # composite on white, via Pillow, like transformers
    if fmt in ("JPEG", "MPO"):
        # CMYK / YCCK JPEGs need Pillow's (Adobe-aware) conversion.
        return "jpeg" if im.mode in ("RGB", "L") else None
    if fmt == "PNG":
        if getattr(im, "n_frames", 1) != 1:
            return None  # APNG: Pillow picks the first frame (acTL is read with the header)
        # IHDR sits at a fixed offset: bit depth (24), colour type (25), interlace (28).
        # 8-bit grey / RGB / palette, non-interlaced: libpng and Pillow agree exactly.
        # 16-bit, alpha and interlaced PNGs go through Pillow.
        if len(data) < 29 or data[12:16] != b"IHDR":
            return None
        bit_depth, color_type, interlace = data[24], data[25], data[28]
        if bit_depth == 8 and color_type in (0, 2, 3) and interlace == 0:
            return "png"
        return None
    if fmt == "WEBP":
        # Pillow reports RGB only for opaque WebPs; animated ones take the first frame.
        return "webp" if im.mode == "RGB" and getattr(im, "n_frames", 1) == 1 else None
    return None  # GIF: Pillow (counting its frames would mean walking the whole file)


# ---------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------


def _bytes_tensor(data: bytes) -> torch.Tensor:
    # bytearray: torch.frombuffer wants a writable buffer (bytes would warn); the copy is
    # of the compressed data, small next to the decode.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _decode_fast_cpu(p: _Probe) -> torch.Tensor:
    buf = _bytes_tensor(p.data)
    # EXIF orientation is applied by us (same code for every decoder), not by torchvision.
    if p.codec == "jpeg":
        return decode_jpeg(buf, mode=ImageReadMode.RGB)
    if p.codec == "png":
        return decode_png(buf, mode=ImageReadMode.RGB)
    return decode_webp(buf, mode=ImageReadMode.RGB)


def _decode_pil(p: _Probe) -> torch.Tensor:
    im = p.pil
    try:
        im.load()
        if im.mode in ("I;16", "I;16B", "I;16L", "I"):
            # 16-bit grey PNG: Pillow's convert("RGB") clips at 255; scale instead.
            grey = (np.asarray(im).astype(np.uint32) >> 8).clip(0, 255).astype(np.uint8)
            arr = np.repeat(grey[:, :, None], 3, axis=2)
        else:
            has_alpha = "A" in im.getbands() or im.info.get("transparency") is not None
            if has_alpha:
                # Same as transformers' convert_to_rgb: alpha-composite on white.
                rgba = im.convert("RGBA")
                white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                rgb = Image.alpha_composite(white, rgba).convert("RGB")
            else:
                rgb = im.convert("RGB")
            arr = np.array(rgb)  # writable HWC copy, owned by the tensor below
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated/corrupt data surfaces as many types
        raise MediaError(f"corrupt or truncated {p.fmt} image ({_short(e)})") from None
    # CHW view of HWC memory (channels_last): torchvision's resize is fastest on it and
    # gives bit-identical results.
    return torch.from_numpy(arr).permute(2, 0, 1)


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return msg[:120]


def _orient(img: torch.Tensor, orientation: int) -> torch.Tensor:
    op = _ORIENT_OPS.get(orientation)
    return img if op is None else op(img)


def _check_decoded(img: torch.Tensor, p: _Probe) -> torch.Tensor:
    if img.dtype != torch.uint8 or img.dim() != 3 or tuple(img.shape) != (3, p.height, p.width):
        raise MediaError(f"corrupt {p.fmt} image (decoded size does not match its header)")
    return img


def _decode_cpu(p: _Probe) -> torch.Tensor:
    if p.codec is not None:
        try:
            img = _decode_fast_cpu(p)
        except RuntimeError as e:
            raise MediaError(f"corrupt or truncated {p.fmt} image ({_short(e)})") from None
    else:
        img = _decode_pil(p)
    return _orient(_check_decoded(img, p), p.orientation)


def load_image(source: ImageSource, *, limits: MediaLimits = DEFAULT_LIMITS) -> torch.Tensor:
    """Decode a JPEG/PNG/WebP/GIF (first frame) file or byte string to RGB uint8 [3, H, W].

    Transparency is composited on white; EXIF orientation is applied. Raises
    ``MediaError``: 413 if the file or the pixel count (read from the header, before
    decoding) exceeds ``limits``; 415 for non-image or unsupported data; 400 for empty,
    truncated or corrupt data. The result may be a non-contiguous (channels-last) view.
    """
    return _decode_cpu(_probe(_read_source(source, limits), limits))


# ---------------------------------------------------------------------------------------
# Sizes and config
# ---------------------------------------------------------------------------------------

MAX_ASPECT_RATIO = 200


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
) -> tuple[int, int]:
    """Qwen2-VL target size: both sides multiples of ``factor``, ``h * w`` brought into
    ``[min_pixels, max_pixels]`` while keeping the aspect ratio as well as possible.

    Same arithmetic as the reference (Python ``round``, i.e. half-to-even, then floor when
    shrinking and ceil when growing), because the vision tower's token count -- and so the
    prompt layout -- must agree with it exactly.
    """
    if height < 1 or width < 1:
        raise MediaError(f"image has invalid dimensions {width}x{height}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise MediaError(
            f"image aspect ratio {ratio:.1f}:1 ({width}x{height}) exceeds the limit of "
            f"{MAX_ASPECT_RATIO}:1"
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        # Shrink: scale both sides by the same beta, round *down* so we stay under the cap.
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        # Grow (tiny images, and sides that rounded to 0): round *up* to reach the floor.
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class VisionPreprocessConfig:
    """Qwen2-VL / Qwen2.5-VL image preprocessing settings (transformers' defaults)."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)  # CLIP
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        """Side granularity: a merge window of patches."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def grid_thw(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patch grid for an image of this size -- known from the header alone,
        so a server can count image tokens before decoding."""
        h, w = self.target_size(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, height: int, width: int) -> int:
        """LLM placeholder tokens for an image of this size (patches / merge_size^2)."""
        t, gh, gw = self.grid_thw(height, width)
        return t * gh * gw // (self.merge_size**2)


@dataclass
class ImageBatch:
    """Patches of N images, concatenated in input order (transformers' layout)."""

    pixel_values: torch.Tensor  # [total_patches, 3*temporal_patch*patch*patch] float32
    grid_thw: torch.Tensor  # [N, 3] int64: (1, H/patch, W/patch) per image

    def __len__(self) -> int:
        return int(self.grid_thw.shape[0])

    def patches_per_image(self) -> list[int]:
        return [int(n) for n in self.grid_thw.prod(dim=-1).tolist()]

    def split(self) -> list[torch.Tensor]:
        """Per-image views of ``pixel_values``."""
        return list(torch.split(self.pixel_values, self.patches_per_image(), dim=0))

    def to(self, device: torch.device | str) -> ImageBatch:
        return ImageBatch(self.pixel_values.to(device), self.grid_thw.to(device))


# ---------------------------------------------------------------------------------------
# Preprocessing
# ---------------------------------------------------------------------------------------


def _resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown image backend {backend!r}; expected one of {BACKENDS}")
    return "torchvision" if backend == "auto" else backend


def _check_image(img: torch.Tensor, i: int) -> None:
    if not isinstance(img, torch.Tensor) or img.dtype != torch.uint8 or img.dim() != 3 or img.shape[0] != 3:
        desc = f"{img.dtype} {tuple(img.shape)}" if isinstance(img, torch.Tensor) else type(img).__name__
        raise ValueError(f"image {i}: expected an RGB uint8 tensor [3, H, W], got {desc}")


def _targets(images: Sequence[torch.Tensor], config: VisionPreprocessConfig) -> list[tuple[int, int]]:
    out = []
    for i, img in enumerate(images):
        try:
            out.append(config.target_size(int(img.shape[-2]), int(img.shape[-1])))
        except MediaError as e:
            raise _with_index(e, i, len(images)) from None
    return out


def _with_index(e: MediaError, i: int, n: int) -> MediaError:
    return e if n == 1 else MediaError(f"image {i}: {e}", status=e.status)


def _resize_torchvision(
    images: Sequence[torch.Tensor], targets: Sequence[tuple[int, int]]
) -> list[torch.Tensor]:
    """Bicubic + antialias, uint8 in and out, exactly transformers' call. Images with the
    same source *and* target size are resized as one [B, 3, H, W] op (transformers groups
    the same way); a lone image is resized as [1, 3, H, W] without a copy."""
    groups: dict[tuple[int, int, int, int, str], list[int]] = {}
    for i, (img, (th, tw)) in enumerate(zip(images, targets)):
        groups.setdefault((int(img.shape[1]), int(img.shape[2]), th, tw, str(img.device)), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(images)
    for (_, _, th, tw, _), idx in groups.items():
        batch = images[idx[0]][None] if len(idx) == 1 else torch.stack([images[i] for i in idx])
        resized = tvF.resize(batch, [th, tw], interpolation=InterpolationMode.BICUBIC, antialias=True)
        for j, i in enumerate(idx):
            out[i] = resized[j]
    return out  # type: ignore[return-value]


def _norm_constants(
    config: VisionPreprocessConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    # transformers fuses rescale into normalise exactly like this (float32 mean * 1/scale),
    # then computes (x - mean') / std' in float32; same constants + same ops = same bits.
    inv = 1.0 / config.rescale_factor
    mean = torch.tensor(config.image_mean, dtype=torch.float32, device=device) * inv
    std = torch.tensor(config.image_std, dtype=torch.float32, device=device) * inv
    return mean.view(1, 3, 1), std.view(1, 3, 1)


def _pack(
    resized: Sequence[torch.Tensor], config: VisionPreprocessConfig, device: torch.device
) -> ImageBatch:
    """Patchify resized uint8 images and normalise them, batched.

    1. Per target size: stack the group's images and write their patches (the Qwen2-VL
       permutation, still uint8 -- a quarter of the bytes of float) into a group-major
       buffer with one permuted copy.
    2. Gather rows back into input order (a uint8 row gather; skipped when already ordered).
    3. One batched normalisation of *all* patches: (x - mean) / std in float32 written
       straight into the output's first temporal slot, then copied into the other
       temporal_patch_size - 1 slots of each (C, temporal, p, p) row.
    Normalising after patchifying is exact: the channel is an explicit axis of each row.
    """
    p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
    n = len(resized)
    sizes = [(int(r.shape[1]), int(r.shape[2])) for r in resized]
    counts = [(h // p) * (w // p) for h, w in sizes]
    total = sum(counts)
    grid = torch.tensor([[1, h // p, w // p] for h, w in sizes], dtype=torch.int64).reshape(n, 3)

    groups: dict[tuple[int, int], list[int]] = {}
    for i, hw in enumerate(sizes):
        groups.setdefault(hw, []).append(i)

    u8 = torch.empty((total, 3, p * p), dtype=torch.uint8, device=device)
    starts = [0] * n  # row where image i starts in the group-major buffer
    row = 0
    for (h, w), idx in groups.items():
        batch = resized[idx[0]][None] if len(idx) == 1 else torch.stack([resized[i] for i in idx])
        b = batch.shape[0]
        gh, gw = h // p, w // p
        src = batch.reshape(b, 3, gh // m, m, p, gw // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
        rows = b * gh * gw
        u8[row : row + rows].view(b, gh // m, gw // m, m, m, 3, p, p).copy_(src)
        for j, i in enumerate(idx):
            starts[i] = row + j * gh * gw
        row += rows

    ordered_starts = [0, *itertools.accumulate(counts)][:n]
    if starts != ordered_starts:
        perm = torch.cat(
            [torch.arange(s, s + c, dtype=torch.int64) for s, c in zip(starts, counts)]
        ).to(device)
        u8 = u8.index_select(0, perm)

    mean, std = _norm_constants(config, device)
    out = torch.empty((total, 3, tp, p * p), dtype=torch.float32, device=device)
    first = out[:, :, 0]
    torch.sub(u8, mean, out=first)  # uint8 -> float32 promotion, then subtract
    first.div_(std)
    if tp > 1:
        out[:, :, 1:].copy_(first.unsqueeze(2).expand(-1, -1, tp - 1, -1))
    return ImageBatch(pixel_values=out.view(total, config.patch_dim), grid_thw=grid.to(device))


def _empty_batch(config: VisionPreprocessConfig, device: torch.device) -> ImageBatch:
    return ImageBatch(
        torch.empty((0, config.patch_dim), dtype=torch.float32, device=device),
        torch.empty((0, 3), dtype=torch.int64, device=device),
    )


def preprocess_images(
    images: list[torch.Tensor],
    config: VisionPreprocessConfig = VisionPreprocessConfig(),
    device: torch.device | str = "cpu",
    backend: str = "auto",
) -> ImageBatch:
    """Resize, normalise and patchify decoded RGB uint8 [3, H, W] images (from any number
    of requests) into one ``ImageBatch`` matching ``transformers.Qwen2VLImageProcessor``.

    ``backend="dali"`` resizes with a DALI pipeline (the images are handed over as HWC
    arrays); ``load_images_batch`` is the DALI entry point that also decodes in DALI.
    Raises ``MediaError`` for an aspect ratio over 200:1.
    """
    dev = torch.device(device)
    backend = _resolve_backend(backend)
    if not images:
        return _empty_batch(config, dev)
    for i, img in enumerate(images):
        _check_image(img, i)
    targets = _targets(images, config)
    if backend == "dali":
        resized = _dali_resize_decoded(list(images), targets, dev)
    else:
        resized = _resize_torchvision([img.to(dev, non_blocking=True) for img in images], targets)
    return _pack(resized, config, dev)


# transformers' Qwen2-VL video processor sizes frames between 128 and 768 merge windows.
VIDEO_PREPROCESS = VisionPreprocessConfig(min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28)


def preprocess_video(
    frames: torch.Tensor,
    config: VisionPreprocessConfig = VIDEO_PREPROCESS,
    device: torch.device | str = "cpu",
) -> ImageBatch:
    """Resize, normalise and patchify sampled frames (``VideoFrames.frames``, uint8
    ``[T, H, W, 3]``) into one clip of ``temporal_patch_size``-frame patches, matching
    ``transformers.Qwen2VLVideoProcessor``: an odd frame count repeats the last frame.

    Returns an ``ImageBatch`` of one item with ``grid_thw = [[T', H/patch, W/patch]]``.
    """
    is_rgb_u8 = isinstance(frames, torch.Tensor) and frames.dtype == torch.uint8 and frames.dim() == 4
    if not is_rgb_u8 or frames.shape[-1] != 3:
        desc = f"{frames.dtype} {tuple(frames.shape)}" if isinstance(frames, torch.Tensor) else type(frames).__name__
        raise ValueError(f"expected RGB uint8 frames [T, H, W, 3], got {desc}")
    if frames.shape[0] == 0:
        raise MediaError("the video has no frames to sample")
    dev = torch.device(device)
    p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
    th, tw = config.target_size(int(frames.shape[1]), int(frames.shape[2]))
    clip = frames.to(dev).permute(0, 3, 1, 2)
    clip = tvF.resize(clip, [th, tw], interpolation=InterpolationMode.BICUBIC, antialias=True)
    if pad := -clip.shape[0] % tp:
        clip = torch.cat((clip, clip[-1:].expand(pad, -1, -1, -1)))
    mean, std = _norm_constants(config, dev)
    normed = (clip - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    gt, gh, gw = clip.shape[0] // tp, th // p, tw // p
    patches = normed.view(gt, tp, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    pixel_values = patches.reshape(gt * gh * gw, config.patch_dim)
    grid = torch.tensor([[gt, gh, gw]], dtype=torch.int64, device=dev)
    return ImageBatch(pixel_values=pixel_values, grid_thw=grid)


# ---------------------------------------------------------------------------------------
# Decode + preprocess
# ---------------------------------------------------------------------------------------

_T = TypeVar("_T")
_R = TypeVar("_R")


def _parallel_map(fn: Callable[[_T], _R], items: Sequence[_T], num_threads: int | None) -> list[_R]:
    """Map over items with a short-lived thread pool. libjpeg/libpng/libwebp (through
    torchvision), Pillow's decoders and torch's resize all release the GIL, so threads give
    real parallelism here; a serial loop is used for one item or one thread."""
    workers = num_threads if num_threads is not None else min(8, os.cpu_count() or 1)
    workers = max(1, min(workers, len(items)))
    if workers == 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="media-image") as pool:
        return list(pool.map(fn, items))


def _probe_indexed(
    sources: Sequence[ImageSource], limits: MediaLimits, num_threads: int | None
) -> list[_Probe]:
    n = len(sources)

    def one(i: int) -> _Probe:
        try:
            return _probe(_read_source(sources[i], limits), limits)
        except MediaError as e:
            raise _with_index(e, i, n) from None

    return _parallel_map(one, range(n), num_threads)


def load_images_batch(
    sources: list[ImageSource],
    config: VisionPreprocessConfig = VisionPreprocessConfig(),
    device: torch.device | str = "cpu",
    backend: str = "auto",
    *,
    limits: MediaLimits = DEFAULT_LIMITS,
    num_threads: int | None = None,
) -> ImageBatch:
    """Decode + preprocess many images at once (e.g. every image of every request in a
    scheduler step). Errors name the offending image's index when there are several.

    * torchvision on CPU: decode and resize run image-parallel on a thread pool, then one
      batched patchify/normalise.
    * torchvision on CUDA: plain JPEGs are decoded together by nvJPEG, the rest on CPU;
      resize and normalise on the GPU.
    * dali: decode + resize in one DALI pipeline (``"mixed"`` decoder on CUDA).
    """
    dev = torch.device(device)
    backend = _resolve_backend(backend)
    if not sources:
        return _empty_batch(config, dev)
    n = len(sources)
    probes = _probe_indexed(sources, limits, num_threads)
    targets = []
    for i, p in enumerate(probes):
        try:
            targets.append(config.target_size(*p.out_hw))
        except MediaError as e:
            raise _with_index(e, i, n) from None

    if backend == "dali":
        return _pack(_dali_decode_resize(probes, targets, dev, num_threads), config, dev)

    if dev.type == "cpu":

        def decode_resize(i: int) -> torch.Tensor:
            try:
                img = _decode_cpu(probes[i])
            except MediaError as e:
                raise _with_index(e, i, n) from None
            th, tw = targets[i]
            return tvF.resize(img[None], [th, tw], interpolation=InterpolationMode.BICUBIC, antialias=True)[0]

        return _pack(_parallel_map(decode_resize, range(n), num_threads), config, dev)

    images = _decode_on_device(probes, dev, num_threads)
    return _pack(_resize_torchvision(images, targets), config, dev)


def _decode_on_device(
    probes: Sequence[_Probe], dev: torch.device, num_threads: int | None
) -> list[torch.Tensor]:
    """CUDA decode: all plain JPEGs in one batched nvJPEG call; others on CPU then copied."""
    n = len(probes)
    out: list[torch.Tensor | None] = [None] * n
    jpeg_idx = [i for i, p in enumerate(probes) if p.codec == "jpeg"]
    if jpeg_idx:
        bufs = [_bytes_tensor(probes[i].data) for i in jpeg_idx]
        try:
            decoded = decode_jpeg(bufs, mode=ImageReadMode.RGB, device=dev)
        except RuntimeError:
            # One bad file fails the whole batch: redo one by one to name the culprit.
            decoded = []
            for i, buf in zip(jpeg_idx, bufs):
                try:
                    decoded.append(decode_jpeg(buf, mode=ImageReadMode.RGB, device=dev))
                except RuntimeError as e:
                    err = MediaError(f"corrupt or truncated {probes[i].fmt} image ({_short(e)})")
                    raise _with_index(err, i, n) from None
        for i, img in zip(jpeg_idx, decoded):
            try:
                out[i] = _orient(_check_decoded(img, probes[i]), probes[i].orientation)
            except MediaError as e:
                raise _with_index(e, i, n) from None
    rest = [i for i in range(n) if out[i] is None]

    def cpu_one(i: int) -> torch.Tensor:
        try:
            return _decode_cpu(probes[i]).to(dev, non_blocking=False)
        except MediaError as e:
            raise _with_index(e, i, n) from None

    for i, img in zip(rest, _parallel_map(cpu_one, rest, num_threads)):
        out[i] = img
    return out  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------
# DALI
# ---------------------------------------------------------------------------------------

_DALI_MAX_BATCH = 32
_dali_pipes: dict[tuple[str, int | None], tuple[Any, threading.Lock]] = {}
_dali_pipes_lock = threading.Lock()


def _dali_device_id(dev: torch.device) -> int | None:
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise ValueError(f"the DALI backend supports cpu and cuda devices, not {dev}")
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _dali_pipe(kind: str, device_id: int | None, num_threads: int | None) -> tuple[Any, threading.Lock]:
    """Build (once) and cache a DALI pipeline. kind: "decode" (encoded bytes -> decode ->
    resize) or "resize" (decoded HWC uint8 -> resize). Pipelines are not re-entrant, so
    each comes with a lock."""
    key = (kind, device_id)
    with _dali_pipes_lock:
        if key in _dali_pipes:
            return _dali_pipes[key]
        try:
            import nvidia.dali.fn as fn
            import nvidia.dali.types as types
            from nvidia.dali import pipeline_def
        except ImportError as e:  # a deployment problem, not the user's
            raise RuntimeError("the 'dali' image backend needs nvidia-dali installed") from e

        gpu = device_id is not None

        @pipeline_def(
            batch_size=_DALI_MAX_BATCH,
            num_threads=num_threads or min(8, os.cpu_count() or 1),
            device_id=device_id,
            exec_dynamic=True,
            prefetch_queue_depth=1,  # we feed and run one batch at a time
        )
        def pipe() -> Any:
            size = fn.external_source(name="size", dtype=types.FLOAT, ndim=1)
            if kind == "decode":
                enc = fn.external_source(name="data", dtype=types.UINT8, ndim=1)
                img = fn.decoders.image(
                    enc,
                    device="mixed" if gpu else "cpu",
                    output_type=types.RGB,
                    adjust_orientation=True,
                )
            else:
                img = fn.external_source(name="data", dtype=types.UINT8, ndim=3, layout="HWC")
                if gpu:
                    img = img.gpu()
            # Cubic both ways with antialiasing on downscale: the closest DALI gets to
            # torchvision's bicubic(antialias=True). size is (H, W) for HWC layout.
            return fn.resize(
                img,
                size=size,
                interp_type=types.INTERP_CUBIC,
                antialias=True,
                dtype=types.UINT8,
            )

        p = pipe()
        p.build()
        _dali_pipes[key] = (p, threading.Lock())
        return _dali_pipes[key]


def _dali_run(
    kind: str,
    inputs: list[np.ndarray],
    targets: list[tuple[int, int]],
    dev: torch.device,
    num_threads: int | None,
) -> list[torch.Tensor]:
    """Run inputs through a cached pipeline in chunks; returns CHW uint8 views on dev."""
    device_id = _dali_device_id(dev)
    pipe, lock = _dali_pipe(kind, device_id, num_threads)
    out: list[torch.Tensor] = []
    for s in range(0, len(inputs), _DALI_MAX_BATCH):
        chunk = inputs[s : s + _DALI_MAX_BATCH]
        sizes = [np.array(t, dtype=np.float32) for t in targets[s : s + _DALI_MAX_BATCH]]
        with lock:
            pipe.feed_input("data", chunk)
            pipe.feed_input("size", sizes)
            (res,) = pipe.run()
            out.extend(_dali_to_torch(res, dev))
    return out


def _dali_to_torch(res: Any, dev: torch.device) -> list[torch.Tensor]:
    # Copy out: DALI reuses its output buffers on the next run.
    imgs: list[torch.Tensor] = []
    if dev.type == "cpu":
        for k in range(len(res)):
            imgs.append(torch.from_numpy(np.array(res[k])).permute(2, 0, 1))
        return imgs
    from nvidia.dali.plugin.pytorch import feed_ndarray

    stream = torch.cuda.current_stream(dev)
    for k in range(len(res)):
        t = res[k]
        dst = torch.empty(tuple(t.shape()), dtype=torch.uint8, device=dev)
        feed_ndarray(t, dst, cuda_stream=stream)
        imgs.append(dst.permute(2, 0, 1))
    return imgs


def _dali_resize_decoded(
    images: list[torch.Tensor], targets: list[tuple[int, int]], dev: torch.device
) -> list[torch.Tensor]:
    hwc = [np.ascontiguousarray(img.detach().cpu().permute(1, 2, 0).numpy()) for img in images]
    return _dali_run("resize", hwc, targets, dev, None)


def _dali_decode_resize(
    probes: list[_Probe], targets: list[tuple[int, int]], dev: torch.device, num_threads: int | None
) -> list[torch.Tensor]:
    """Plain JPEG/PNG/WebP decode *and* resize inside DALI; images needing Pillow (alpha,
    GIF, CMYK, 16-bit) are decoded on CPU and only resized by DALI."""
    n = len(probes)
    out: list[torch.Tensor | None] = [None] * n
    fast = [i for i, p in enumerate(probes) if p.codec is not None]
    if fast:
        encoded = [np.frombuffer(probes[i].data, dtype=np.uint8) for i in fast]
        try:
            res = _dali_run("decode", encoded, [targets[i] for i in fast], dev, num_threads)
        except RuntimeError:
            res = []
            for i, enc in zip(fast, encoded):  # name the culprit
                try:
                    res.extend(_dali_run("decode", [enc], [targets[i]], dev, num_threads))
                except RuntimeError:
                    # DALI's own message is a multi-line pipeline dump; keep it out of the API.
                    err = MediaError(f"corrupt or truncated {probes[i].fmt} image (DALI could not decode it)")
                    raise _with_index(err, i, n) from None
        for i, img in zip(fast, res):
            out[i] = img
    rest = [i for i in range(n) if out[i] is None]
    if rest:

        def cpu_one(i: int) -> np.ndarray:
            try:
                return np.ascontiguousarray(_decode_cpu(probes[i]).permute(1, 2, 0).numpy())
            except MediaError as e:
                raise _with_index(e, i, n) from None

        hwc = _parallel_map(cpu_one, rest, num_threads)
        for i, img in zip(rest, _dali_run("resize", hwc, [targets[i] for i in rest], dev, num_threads)):
            out[i] = img
    return out  # type: ignore[return-value]


__all__ = [
    "BACKENDS",
    "ImageBatch",
    "ImageSource",
    "VisionPreprocessConfig",
    "load_image",
    "load_images_batch",
    "preprocess_images",
    "smart_resize",
]
