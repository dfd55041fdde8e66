"""Decode + preprocess many images at once (``load_images_batch``), e.g.
every image of every request in a step: the decoding of
``media.image_decode`` and the preprocessing of ``media.vision_preprocess``
(whose docstring gives the backends and how exact each is), on CPU threads,
with nvJPEG on CUDA, or in one DALI pipeline (``media.image_dali``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as tvF

from media.errors import DEFAULT_LIMITS, MediaError, MediaLimits
from media.image_dali import dali_decode_resize
from media.image_decode import (
    ImageProbe,
    ImageSource,
    bytes_tensor,
    check_decoded,
    decode_cpu,
    orient,
    parallel_map,
    probe_image,
    read_source,
    short_error,
    with_index,
)
from media.vision_geometry import VisionPreprocessConfig
from media.vision_preprocess import (
    ImageBatch,
    empty_batch,
    pack,
    resize_torchvision,
    resolve_backend,
)

__all__ = ["load_images_batch"]


def _probe_indexed(
    sources: Sequence[ImageSource], limits: MediaLimits, num_threads: int | None
) -> list[ImageProbe]:
    n = len(sources)

    def one(i: int) -> ImageProbe:
        try:
            return probe_image(read_source(sources[i], limits), limits)
        except MediaError as e:
            raise with_index(e, i, n) from None

    return parallel_map(one, range(n), num_threads)


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
    backend = resolve_backend(backend)
    if not sources:
        return empty_batch(config, dev)
    n = len(sources)
    probes = _probe_indexed(sources, limits, num_threads)
    targets = []
    for i, p in enumerate(probes):
        try:
            targets.append(config.target_size(*p.out_hw))
        except MediaError as e:
            raise with_index(e, i, n) from None

    if backend == "dali":
        return pack(dali_decode_resize(probes, targets, dev, num_threads), config, dev)

    if dev.type == "cpu":

        def decode_resize(i: int) -> torch.Tensor:
            try:
                img = decode_cpu(probes[i])
            except MediaError as e:
                raise with_index(e, i, n) from None
            th, tw = targets[i]
            return tvF.resize(img[None], [th, tw], interpolation=InterpolationMode.BICUBIC, antialias=True)[0]

        return pack(parallel_map(decode_resize, range(n), num_threads), config, dev)

    images = _decode_on_device(probes, dev, num_threads)
    return pack(resize_torchvision(images, targets), config, dev)


def _decode_on_device(
    probes: Sequence[ImageProbe], dev: torch.device, num_threads: int | None
) -> list[torch.Tensor]:
    """CUDA decode: all plain JPEGs in one batched nvJPEG call; others on CPU then copied."""
    n = len(probes)
    out: list[torch.Tensor | None] = [None] * n
    jpeg_idx = [i for i, p in enumerate(probes) if p.codec == "jpeg"]
    if jpeg_idx:
        bufs = [bytes_tensor(probes[i].data) for i in jpeg_idx]
        try:
            decoded = decode_jpeg(bufs, mode=ImageReadMode.RGB, device=dev)
        except RuntimeError:
            # One bad file fails the whole batch: redo one by one to name the culprit.
            decoded = []
            for i, buf in zip(jpeg_idx, bufs):
                try:
                    decoded.append(decode_jpeg(buf, mode=ImageReadMode.RGB, device=dev))
                except RuntimeError as e:
                    err = MediaError(f"corrupt or truncated {probes[i].fmt} image ({short_error(e)})")
                    raise with_index(err, i, n) from None
        for i, img in zip(jpeg_idx, decoded):
            try:
                out[i] = orient(check_decoded(img, probes[i]), probes[i].orientation)
            except MediaError as e:
                raise with_index(e, i, n) from None
    rest = [i for i in range(n) if out[i] is None]

    def cpu_one(i: int) -> torch.Tensor:
        try:
            return decode_cpu(probes[i]).to(dev, non_blocking=False)
        except MediaError as e:
            raise with_index(e, i, n) from None

    for i, img in zip(rest, parallel_map(cpu_one, rest, num_threads)):
        out[i] = img
    return out  # type: ignore[return-value]
