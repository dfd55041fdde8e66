"""The NVIDIA DALI image path: decode (nvJPEG, ``"mixed"`` on CUDA; CPU with
``device_id=None``) and resize in one pipeline, fed with the encoded bytes."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import torch

from media.errors import MediaError
from media.image_decode import ImageProbe, decode_cpu, parallel_map, with_index


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


def dali_resize_decoded(
    images: list[torch.Tensor], targets: list[tuple[int, int]], dev: torch.device
) -> list[torch.Tensor]:
    hwc = [np.ascontiguousarray(img.detach().cpu().permute(1, 2, 0).numpy()) for img in images]
    return _dali_run("resize", hwc, targets, dev, None)


def dali_decode_resize(
    probes: list[ImageProbe], targets: list[tuple[int, int]], dev: torch.device, num_threads: int | None
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
                    raise with_index(err, i, n) from None
        for i, img in zip(fast, res):
            out[i] = img
    rest = [i for i in range(n) if out[i] is None]
    if rest:

        def cpu_one(i: int) -> np.ndarray:
            try:
                return np.ascontiguousarray(decode_cpu(probes[i]).permute(1, 2, 0).numpy())
            except MediaError as e:
                raise with_index(e, i, n) from None

        hwc = parallel_map(cpu_one, rest, num_threads)
        for i, img in zip(rest, _dali_run("resize", hwc, [targets[i] for i in rest], dev, num_threads)):
            out[i] = img
    return out  # type: ignore[return-value]
