"""Qwen2-VL / Qwen2.5-VL vision preprocessing of decoded images and video frames.

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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as tvF

from media.errors import MediaError
from media.image_dali import dali_resize_decoded
from media.image_decode import with_index
from media.vision_geometry import VIDEO_PREPROCESS, VisionPreprocessConfig

BACKENDS = ("auto", "torchvision", "dali")


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


def resolve_backend(backend: str) -> str:
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
            raise with_index(e, i, len(images)) from None
    return out


def resize_torchvision(
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


def pack(
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


def empty_batch(config: VisionPreprocessConfig, device: torch.device) -> ImageBatch:
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
    backend = resolve_backend(backend)
    if not images:
        return empty_batch(config, dev)
    for i, img in enumerate(images):
        _check_image(img, i)
    targets = _targets(images, config)
    if backend == "dali":
        resized = dali_resize_decoded(list(images), targets, dev)
    else:
        resized = resize_torchvision([img.to(dev, non_blocking=True) for img in images], targets)
    return pack(resized, config, dev)


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
