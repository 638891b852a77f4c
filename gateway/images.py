"""Image canonicalisation, the exact cache key, and the LLM token grid.

An image becomes *canonical* pixels: decoded with Pillow under a pixel cap (checked
from the header, before any pixel is decoded), EXIF orientation applied, alpha
composited over white, RGB. The exact cache key hashes those pixels together with the
model, the processor settings and the cache namespace, so the same picture sent as
PNG or as a rotated JPEG with an orientation tag gets the same key, while two tenants
never share one unless an operator maps them to one namespace.
"""

from __future__ import annotations

import base64
import hashlib
import io
import math
import struct
from dataclasses import dataclass
from typing import cast

from PIL import Image, ImageOps, UnidentifiedImageError

from gateway.config import ImageLimits, ProcessorSettings
from gateway.errors import InvalidRequest, PayloadTooLarge, UnprocessableImage
from gateway.matching.features import Extractor, TokenFeatures

# The gateway's own pixel cap (ImageLimits.max_image_pixels, checked from the header before any pixel is decoded)
# is the one clients hear about; Pillow's built-in one would otherwise refuse first, with its own figure.
Image.MAX_IMAGE_PIXELS = None

# What Pillow raises for bytes that are not a well-formed image (found by tests/fuzz/test_image_decoding.py).
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error)
ACCEPTED_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"})
MAX_ASPECT_RATIO = 200  # the Qwen-VL processors refuse more elongated images
KEY_VERSION = b"revisit-image-key-v1"
_EXIF_ORIENTATION = 0x0112
_FORWARDED_AS_IS = {"PNG": "image/png", "JPEG": "image/jpeg"}  # single-frame formats only
_KEY_STRIP_BYTES = 2 << 20  # pixels hashed per strip by content_key


@dataclass(frozen=True, slots=True)
class TokenGrid:
    """The image's LLM token grid after the processor's resize and patch merge."""

    rows: int
    cols: int

    @property
    def tokens(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True, slots=True)
class CanonicalImage:
    """One request image, ready to key, plan and forward."""

    key: str  # hex digest: the exact cache key
    width: int
    height: int
    grid: TokenGrid
    payload: bytes  # what the worker receives: bytes that decode to exactly the keyed pixels
    mime: str
    as_uploaded: bool = False  # payload is the uploaded bytes themselves (a data: URL can be forwarded as it came)
    features: TokenFeatures | None = None  # per-token features for approximate matching (gateway/matching)

    @property
    def nbytes(self) -> int:
        """What holding this image costs in memory: its payload and its features."""
        return len(self.payload) + (self.features.nbytes if self.features is not None else 0)

    @property
    def data_url(self) -> str:
        return f"data:{self.mime};base64," + base64.b64encode(self.payload).decode("ascii")


def smart_resize(height: int, width: int, processor: ProcessorSettings) -> tuple[int, int]:
    """The resized (height, width) that Qwen-VL's image processor will use."""
    factor = processor.factor
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidRequest(
            f"image aspect ratio {max(height, width) / min(height, width):.0f}:1 exceeds {MAX_ASPECT_RATIO}:1"
        )
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > processor.max_pixels:
        beta = math.sqrt(height * width / processor.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < processor.min_pixels:
        beta = math.sqrt(processor.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def token_grid(height: int, width: int, processor: ProcessorSettings) -> TokenGrid:
    h_bar, w_bar = smart_resize(height, width, processor)
    return TokenGrid(rows=h_bar // processor.factor, cols=w_bar // processor.factor)


def _open_header(data: bytes, limits: ImageLimits) -> Image.Image:
    """The image with its header read and checked (format, size, the per-image pixel cap); no pixel decoded."""
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError as exc:
        raise UnprocessableImage("image data is not a recognised image format", code="invalid_image") from exc
    except Image.DecompressionBombError as exc:
        raise PayloadTooLarge(f"image is too large: {exc}", code="image_too_large") from exc
    except _DECODE_ERRORS as exc:  # a header that is cut short or does not parse
        raise UnprocessableImage(f"image data is corrupt or truncated: {exc}", code="invalid_image") from exc
    if image.format not in ACCEPTED_FORMATS:
        raise UnprocessableImage(
            f"image format {image.format} is not accepted; use one of {', '.join(sorted(ACCEPTED_FORMATS))}",
            code="invalid_image",
        )
    width, height = image.size
    if width < 1 or height < 1:
        raise UnprocessableImage("image has no pixels", code="invalid_image")
    if width * height > limits.max_image_pixels:
        raise PayloadTooLarge(
            f"image is {width}x{height} = {width * height} pixels; the limit is {limits.max_image_pixels}",
            code="image_too_large",
        )
    return image


def image_size(data: bytes, limits: ImageLimits) -> tuple[int, int]:
    """(width, height) from the image's header, checked as :func:`canonicalize` checks it, without decoding a pixel
    (Pillow reads the header only): what a request's pixel budget is counted from. Cheap, but it parses the header
    (a PNG's compressed text chunks, a JPEG's markers): off the event loop for large data."""
    size: tuple[int, int] = _open_header(data, limits).size
    return size


def _open_checked(data: bytes, limits: ImageLimits) -> Image.Image:
    image = _open_header(data, limits)
    try:
        image.load()  # decode now, under the cap, so truncation surfaces here
    except Image.DecompressionBombError as exc:
        raise PayloadTooLarge(f"image is too large: {exc}", code="image_too_large") from exc
    except _DECODE_ERRORS as exc:
        raise UnprocessableImage(f"image data is corrupt or truncated: {exc}", code="invalid_image") from exc
    return image


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")  # (converting to its own mode copies it)
        bands = cast(tuple[tuple[int, int], ...], rgba.getextrema())  # one (min, max) per band
        if bands[3] == (255, 255):  # opaque (many screenshots): compositing would give these very pixels
            return rgba.convert("RGB")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        background.alpha_composite(rgba)
        return background.convert("RGB")
    return image.convert("RGB")


def content_key(rgb: Image.Image, *, model: str, namespace: str, processor: ProcessorSettings) -> str:
    """The exact cache key: canonical pixels + model + processor settings + namespace."""
    digest = hashlib.blake2b(digest_size=32)
    header = (
        f"{model}\0{namespace}\0{processor.patch_size},{processor.merge_size},"
        f"{processor.temporal_patch_size},{processor.min_pixels},{processor.max_pixels}\0"
        f"{rgb.width}x{rgb.height}\0"
    )
    digest.update(KEY_VERSION + b"\0" + header.encode())
    # rgb.tobytes(), in strips: the same bytes without a second copy of the image (120 MB for 40 Mpx) at once.
    width, height = rgb.size
    rows = max(1, _KEY_STRIP_BYTES // (3 * width))
    for top in range(0, height, rows):
        digest.update(rgb.crop((0, top, width, min(height, top + rows))).tobytes())
    return digest.hexdigest()


def canonicalize(
    data: bytes,
    *,
    limits: ImageLimits,
    processor: ProcessorSettings,
    model: str,
    namespace: str,
    extractor: Extractor | None = None,
) -> CanonicalImage:
    """Decode, orient and key one image, and with an extractor compute its per-token features on the grid the
    model will see. CPU-bound: run it off the event loop.

    An RGB PNG or JPEG with no orientation to apply is forwarded as it came: the worker
    decodes those bytes with the same Pillow to the same pixels. Anything else (a rotation,
    alpha, palette, CMYK, another format) is re-encoded as a lossless PNG of the keyed pixels.
    """
    image = _open_checked(data, limits)
    source_format, source_mode = image.format, image.mode
    try:  # metadata (EXIF) and mode conversions read more of the file, which may be damaged there too
        rotated = image.getexif().get(_EXIF_ORIENTATION, 1) not in (0, 1)
        oriented = ImageOps.exif_transpose(image) if rotated else image
        rgb = _to_rgb(oriented)
    except _DECODE_ERRORS as exc:
        raise UnprocessableImage(f"image data is corrupt: {exc}", code="invalid_image") from exc
    del image, oriented  # the decoded source, when it was converted: up to 160 MB that need not stay
    grid = token_grid(rgb.height, rgb.width, processor)
    key = content_key(rgb, model=model, namespace=namespace, processor=processor)
    forwarded_mime = _FORWARDED_AS_IS.get(source_format or "")
    as_uploaded = forwarded_mime is not None and source_mode == "RGB" and not rotated
    if forwarded_mime is not None and as_uploaded:
        payload, mime = data, forwarded_mime
    else:
        out = io.BytesIO()
        rgb.save(out, format="PNG", compress_level=1)
        payload, mime = out.getvalue(), "image/png"
    features = extractor.extract(rgb, (grid.rows, grid.cols), processor.factor) if extractor is not None else None
    return CanonicalImage(key=key, width=rgb.width, height=rgb.height, grid=grid, payload=payload, mime=mime,
                          as_uploaded=as_uploaded, features=features)
