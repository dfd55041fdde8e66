"""Image decoding (``load_image``): reading, probing and decoding one image.

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
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torchvision.io import ImageReadMode, decode_jpeg, decode_png, decode_webp

from media.errors import DEFAULT_LIMITS, MediaError, MediaLimits

ImageSource = str | os.PathLike[str] | bytes | bytearray | memoryview

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


def read_source(source: ImageSource, limits: MediaLimits) -> bytes:
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
class ImageProbe:
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


def probe_image(data: bytes, limits: MediaLimits) -> ImageProbe:
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
            detail = "unreadable header" if isinstance(e, UnidentifiedImageError) else short_error(e)
            raise MediaError(f"corrupt or truncated {name} image ({detail})") from None
        if isinstance(e, UnidentifiedImageError):
            raise MediaError(
                f"unsupported image format or not an image; expected {_FORMAT_NAMES}", status=415
            ) from None
        raise MediaError(f"corrupt image header ({short_error(e)})") from None

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
    return ImageProbe(
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


def bytes_tensor(data: bytes) -> torch.Tensor:
    # bytearray: torch.frombuffer wants a writable buffer (bytes would warn); the copy is
    # of the compressed data, small next to the decode.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _decode_fast_cpu(p: ImageProbe) -> torch.Tensor:
    buf = bytes_tensor(p.data)
    # EXIF orientation is applied by us (same code for every decoder), not by torchvision.
    if p.codec == "jpeg":
        return decode_jpeg(buf, mode=ImageReadMode.RGB)
    if p.codec == "png":
        return decode_png(buf, mode=ImageReadMode.RGB)
    return decode_webp(buf, mode=ImageReadMode.RGB)


def _decode_pil(p: ImageProbe) -> torch.Tensor:
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
        raise MediaError(f"corrupt or truncated {p.fmt} image ({short_error(e)})") from None
    # CHW view of HWC memory (channels_last): torchvision's resize is fastest on it and
    # gives bit-identical results.
    return torch.from_numpy(arr).permute(2, 0, 1)


def short_error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return msg[:120]


def orient(img: torch.Tensor, orientation: int) -> torch.Tensor:
    op = _ORIENT_OPS.get(orientation)
    return img if op is None else op(img)


def check_decoded(img: torch.Tensor, p: ImageProbe) -> torch.Tensor:
    if img.dtype != torch.uint8 or img.dim() != 3 or tuple(img.shape) != (3, p.height, p.width):
        raise MediaError(f"corrupt {p.fmt} image (decoded size does not match its header)")
    return img


def decode_cpu(p: ImageProbe) -> torch.Tensor:
    if p.codec is not None:
        try:
            img = _decode_fast_cpu(p)
        except RuntimeError as e:
            raise MediaError(f"corrupt or truncated {p.fmt} image ({short_error(e)})") from None
    else:
        img = _decode_pil(p)
    return orient(check_decoded(img, p), p.orientation)


def load_image(source: ImageSource, *, limits: MediaLimits = DEFAULT_LIMITS) -> torch.Tensor:
    """Decode a JPEG/PNG/WebP/GIF (first frame) file or byte string to RGB uint8 [3, H, W].

    Transparency is composited on white; EXIF orientation is applied. Raises
    ``MediaError``: 413 if the file or the pixel count (read from the header, before
    decoding) exceeds ``limits``; 415 for non-image or unsupported data; 400 for empty,
    truncated or corrupt data. The result may be a non-contiguous (channels-last) view.
    """
    return decode_cpu(probe_image(read_source(source, limits), limits))


def with_index(e: MediaError, i: int, n: int) -> MediaError:
    return e if n == 1 else MediaError(f"image {i}: {e}", status=e.status)


_T = TypeVar("_T")
_R = TypeVar("_R")


def parallel_map(fn: Callable[[_T], _R], items: Sequence[_T], num_threads: int | None) -> list[_R]:
    """Map over items with a short-lived thread pool. libjpeg/libpng/libwebp (through
    torchvision), Pillow's decoders and torch's resize all release the GIL, so threads give
    real parallelism here; a serial loop is used for one item or one thread."""
    workers = num_threads if num_threads is not None else min(8, os.cpu_count() or 1)
    workers = max(1, min(workers, len(items)))
    if workers == 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="media-image") as pool:
        return list(pool.map(fn, items))
