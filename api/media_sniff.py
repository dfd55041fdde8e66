"""What kind of media some bytes are: image, video or audio by their magic bytes,
the kind a client declared (media type or file name extension), and the refusal
for bytes that are no media we take. Pure functions of the bytes and names: the
uploads, the chat content parts and the demo sniff with them."""

from __future__ import annotations

import codecs
from dataclasses import dataclass

MEDIA_KINDS = ("image", "video", "audio")

# Enough for every signature below; MPEG-TS needs a second sync byte at 188
# (192 + 4 for M2TS), the rest fit in the first 64 bytes.
SNIFF_BYTES = 512

_ISO_AUDIO_BRANDS = frozenset({b"M4A ", b"M4B ", b"M4P ", b"F4A ", b"F4B "})
# HEIF/AVIF stills are ISO BMFF too; calling them "video" would route photos to the video decoder.
_ISO_IMAGE_BRANDS = frozenset({b"heic", b"heix", b"heim", b"heis", b"mif1", b"msf1", b"avif", b"avis"})
# Old QuickTime files may start with another top-level atom instead of 'ftyp'.
_QUICKTIME_ATOMS = frozenset({b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot"})
_BMP_DIB_HEADER_SIZES = frozenset({12, 16, 40, 52, 56, 64, 108, 124})


def sniff_media_kind(head: bytes) -> str | None:
    """"image" / "video" / "audio" from the magic bytes at the start of a file, else None."""
    for sniff in (_sniff_image, _sniff_container, _sniff_audio_stream):
        kind = sniff(head)
        if kind is not None:
            return kind
    return None


def _sniff_image(head: bytes) -> str | None:
    if head.startswith((b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a")):
        return "image"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image"
    # "BM" alone is too weak (plain text may start with it): also require a known DIB header size.
    if head[:2] == b"BM" and len(head) >= 18 and int.from_bytes(head[14:18], "little") in _BMP_DIB_HEADER_SIZES:
        return "image"
    return None


def _sniff_container(head: bytes) -> str | None:
    box = head[4:8]
    if box == b"ftyp":
        brand = head[8:12]
        if brand in _ISO_AUDIO_BRANDS:
            return "audio"
        return "image" if brand in _ISO_IMAGE_BRANDS else "video"
    if box in _QUICKTIME_ATOMS:
        return "video"
    if head[:4] == b"RIFF":
        return {b"AVI ": "video", b"WAVE": "audio"}.get(head[8:12])
    if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
        return "audio"
    if head[:4] == b"OggS":
        # Ogg is usually Vorbis/Opus audio; a Theora stream header makes it video.
        return "video" if b"\x80theora" in head[:SNIFF_BYTES] else "audio"
    if head.startswith((b"\x1a\x45\xdf\xa3", b"FLV\x01", b"\x00\x00\x01\xba")):
        return "video"
    if _is_mpeg_ts(head):
        return "video"
    if head.startswith((b"fLaC", b"#!AMR", b"caff", b"ID3")):
        return "audio"
    return None


def _is_mpeg_ts(head: bytes) -> bool:
    # One sync byte is common in arbitrary data; two a packet apart is not.
    ts = len(head) > 188 and head[0] == 0x47 and head[188] == 0x47
    m2ts = len(head) > 196 and head[4] == 0x47 and head[196] == 0x47  # 4-byte timestamp before each packet
    return ts or m2ts


def _sniff_audio_stream(head: bytes) -> str | None:
    """Raw MP3 / AAC ADTS streams, recognised by their 11/12-bit frame sync."""
    if len(head) < 3 or head[0] != 0xFF:
        return None
    b1, b2 = head[1], head[2]
    if b1 & 0xF6 == 0xF0:  # ADTS: 12-bit sync, layer 00 (0xFFF1 / 0xFFF9 and their CRC variants)
        return "audio"
    layer = (b1 >> 1) & 0b11
    bitrate, sample_rate = b2 >> 4, (b2 >> 2) & 0b11
    if b1 & 0xE0 == 0xE0 and layer != 0 and bitrate != 0xF and sample_rate != 0b11:
        return "audio"
    return None


# Well-formed files that are not media we take, named so a client learns what it sent
# (415) instead of being told its file is damaged (400).
_OTHER_FORMATS: tuple[tuple[bytes, str], ...] = (
    (b"%PDF-", "a PDF document"),
    (b"PK\x03\x04", "a ZIP archive"),
    (b"PK\x05\x06", "a ZIP archive"),
    (b"\x1f\x8b", "a gzip archive"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive"),
    (b"Rar!\x1a\x07", "a RAR archive"),
    (b"II*\x00", "a TIFF image, a format we do not decode"),
    (b"MM\x00*", "a TIFF image, a format we do not decode"),
    (b"8BPS", "a Photoshop image, a format we do not decode"),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", "an Office document"),
    (b"SQLite format 3\x00", "an SQLite database"),
    (b"\x7fELF", "an executable"),
)
# Text may hold tabs, newlines and form feeds; other control characters mean binary data.
_TEXT_CONTROLS = frozenset("\t\n\r\f")


def sniff_other_format(head: bytes) -> str | None:
    """What a file that is not media is ("a PDF document", "plain text"), when we can tell."""
    for magic, name in _OTHER_FORMATS:
        if head.startswith(magic):
            return name
    return "plain text" if _is_text(head) else None


def _is_text(head: bytes) -> bool:
    try:
        # Incremental, so a character cut by the end of `head` is not an error.
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return bool(text) and all(c.isprintable() or c in _TEXT_CONTROLS for c in text)


@dataclass(frozen=True)
class DeclaredType:
    """The media kind a client said some bytes are, and where it said so (for messages)."""

    kind: str  # "image" | "video" | "audio"
    source: str  # "image/png", "by the file name 'clip.mp4'", "by its part type 'image_url'"


# File name extensions of the media containers clients send, for parts that come as
# application/octet-stream. A fixed table: the mimetypes module reads the machine's
# /etc/mime.types, which would make the answers differ between hosts.
_EXTENSION_KINDS = {
    **dict.fromkeys(("png", "jpg", "jpeg", "jpe", "gif", "webp", "bmp", "heic", "heif", "avif"), "image"),
    **dict.fromkeys(("mp4", "m4v", "mov", "qt", "mkv", "webm", "avi", "ts", "m2ts", "mts", "flv", "ogv",
                     "mpg", "mpeg", "3gp", "3g2", "wmv"), "video"),
    **dict.fromkeys(("wav", "mp3", "flac", "ogg", "oga", "opus", "m4a", "aac", "aif", "aiff", "aifc", "amr",
                     "caf", "weba", "wma"), "audio"),
}


def declared_type(content_type: str | None = None, filename: str | None = None) -> DeclaredType | None:
    """The media kind declared by a media type (a data: URL's, a part's Content-Type),
    else by a file name's extension; None when neither names image, video or audio."""
    mime = (content_type or "").split(";", 1)[0].strip().lower()
    major = mime.partition("/")[0]
    if major in MEDIA_KINDS:
        return DeclaredType(major, mime)
    name = filename or ""
    kind = _EXTENSION_KINDS.get(name.rpartition(".")[2].lower()) if "." in name else None
    return None if kind is None else DeclaredType(kind, f"by the file name {filename!r}")


def refusal_for_unrecognised(subject: str, head: bytes, declared: DeclaredType | None) -> tuple[int, str]:
    """(HTTP status, message) for bytes that sniff as no media kind we know.

    400 when they are empty, or when the client declared a media kind they are not
    (as OpenAI answers an invalid image); 415 for a recognisable file of another
    kind, and for undeclared bytes we cannot place.
    """
    if not head:
        return 400, f"{subject} is empty"
    other = sniff_other_format(head)
    if other is not None:
        return 415, f"unsupported media type: {subject} is {other}, not an image, video or audio file"
    if declared is not None:
        return 400, f"{subject} is not a valid {declared.kind} (declared {declared.source})"
    return 415, f"unsupported media type: {subject} is not an image, video or audio format we recognize"
