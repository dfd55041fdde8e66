"""What every video decode path outputs: the ``VideoFrames`` result, the stream
tick a sampling target picks, and a decoded frame converted to upright RGB at
the output size.

Sharing these is what makes the sequential and the chunked decode return the
very same frames and pixels (see ``media.video`` for the sampling semantics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
import torch

from media.errors import MediaError

# Resize filter for ``size=``: cheap, and fine for downscaling by < 2x, which
# is what the encoder's resize to a patch grid mostly does.
_INTERPOLATION = "BILINEAR"


@dataclass
class VideoFrames:
    frames: torch.Tensor  # uint8 [T, H, W, 3], upright RGB
    timestamps: torch.Tensor  # float64 [T], the sampling targets in seconds from start


def target_pts(t: float, time_base: Fraction, start_pts: int) -> int:
    # Exact (Fraction of the float) so every path floors identically.
    return start_pts + math.floor(Fraction(t) / time_base)


def convert_frame(frame: av.VideoFrame, conv_w: int, conv_h: int, rot_k: int) -> np.ndarray:
    """RGB24 at (conv_w, conv_h) (the pre-rotation size), then rotated upright.

    Always passing the size also normalises mid-stream resolution changes."""
    arr = frame.to_ndarray(
        format="rgb24", width=conv_w, height=conv_h, interpolation=_INTERPOLATION
    )
    return np.rot90(arr, rot_k) if rot_k else arr


def output_geometry(
    frame_w: int, frame_h: int, rot_k: int, size: tuple[int, int] | None
) -> tuple[int, int, int, int]:
    """-> (out_h, out_w, conv_w, conv_h): upright output size and the size to
    convert to before rotating (swapped for quarter turns)."""
    if rot_k % 2:
        up_h, up_w = frame_w, frame_h
    else:
        up_h, up_w = frame_h, frame_w
    if size is not None:
        out_h, out_w = int(size[0]), int(size[1])
        if out_h <= 0 or out_w <= 0:
            raise MediaError("size must be positive", 400)
    else:
        out_h, out_w = up_h, up_w
    conv_w, conv_h = (out_h, out_w) if rot_k % 2 else (out_w, out_h)
    return out_h, out_w, conv_w, conv_h
