"""Qwen2-VL / Qwen2.5-VL image geometry: the resize target and the token count of
an image or a video frame, known from its size alone.

Plain arithmetic, apart from the torchvision preprocessing (``media.vision_preprocess``):
a server counts an image's tokens from its header before decoding it, and a process
that never preprocesses (a text-only server, a worker) imports no torchvision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from media.errors import MediaError

__all__ = ["MAX_ASPECT_RATIO", "VIDEO_PREPROCESS", "VisionPreprocessConfig", "smart_resize"]

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


# transformers' Qwen2-VL video processor sizes frames between 128 and 768 merge windows.
VIDEO_PREPROCESS = VisionPreprocessConfig(min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28)
