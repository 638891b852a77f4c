"""Image canonicalisation, the exact cache key, and the LLM token grid.

An image becomes *canonical* pixels: decoded with Pillow under a pixel cap (checked
from the header, before any pixel is decoded), EXIF orientation applied, alpha
composited over white, RGB. The exact cache key hashes those pixels together with the
model, the processor settings and the cache namespace, so the same picture sent as
PNG or as a rotated JPEG with an orientation tag gets the same key, while two tenants
never share one unless an operator maps them to one namespace.

An image of more pixels than the model keeps (the processor's ``max_pixels``) is resized
here, once, to the size the model's processor would resize it to (Qwen ``smart_resize``,
bicubic), and those are its canonical pixels: the worker receives them (:func:`encode_pixels`)
and its processor's resize to the size they already have leaves them as they are
(torchvision's resize returns an image of the requested size untouched). A worker then
never decodes more pixels than the model sees, however many the upload declares (a
170 KB PNG can declare 40 Mpx), and the key, the token digests and the features are of
the pixels the model sees. A JPEG is decoded at 1/2, 1/4 or 1/8 scale where that still
leaves at least the model's size (libjpeg's scaled decoding: a fraction of the memory
and the time). The pixels differ from the worker's own resize of the original by
Pillow's bicubic against torchvision's (a level or two of 255, measured in
tests/gateway/test_images.py); ``ImageLimits.resize_to_model`` off forwards originals.

The worker gets the pixels the gateway decoded, uncompressed (``ImageLimits.forward_decoded``), for every image but
an upright RGB JPEG kept at its size, which goes as uploaded: a PNG sent on as it came would be inflated and
unfiltered a second time at the worker (12 ms for an 896-px photo, measured through SGLang).
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass
from typing import cast

import blake3
import pybase64
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
KEY_VERSION = b"revisit-image-key-v2"  # v2: BLAKE3 (v1: BLAKE2b)
_EXIF_ORIENTATION = 0x0112
# Single-frame formats the worker may get as uploaded (a PNG only with ImageLimits.forward_decoded off).
_FORWARDED_AS_IS = {"PNG": "image/png", "JPEG": "image/jpeg"}
_KEY_STRIP_BYTES = 2 << 20  # pixels hashed per strip by content_key
_KEY_WHOLE_BYTES = 16 << 20  # pixels content_key hashes in one piece (past this, in strips)


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
    """One request image, ready to key, plan and forward. What the worker receives decodes to exactly the keyed
    pixels: the uploaded bytes (``uploaded``, forwarded as they came), or the keyed pixels encoded
    (:func:`encode_pixels`) as a data URL (``url``), made once on the intake's thread and kept with the image, so
    that a repeat sends it without a base64 encode of its megabytes (1.8 ms for a 1K-token image)."""

    key: str  # hex digest: the exact cache key
    width: int  # as uploaded (oriented), not as resized to the model's size: what the request's pixels count
    height: int
    grid: TokenGrid
    mime: str
    uploaded: bytes | None = None  # the uploaded bytes, when the worker gets them as they came
    url: str | None = None  # else the data URL of the keyed pixels
    features: TokenFeatures | None = None  # per-token features for approximate matching (gateway/matching)

    def __post_init__(self) -> None:
        if (self.uploaded is None) == (self.url is None):
            raise ValueError("an image is forwarded either as uploaded or as its data URL")

    @property
    def as_uploaded(self) -> bool:
        """Whether the worker gets the uploaded bytes (a client's data: URL may be forwarded as it came)."""
        return self.uploaded is not None

    @property
    def payload(self) -> bytes:
        """The bytes the worker receives (decoded from the data URL when not as uploaded)."""
        if self.uploaded is not None:
            return self.uploaded
        assert self.url is not None
        return pybase64.b64decode(self.url.partition(",")[2])

    @property
    def forwarded_bytes(self) -> int:
        """About how many bytes the worker's copy holds (what base64 encoding it, or copying it, costs)."""
        return len(self.uploaded) if self.uploaded is not None else len(self.url or "")

    @property
    def nbytes(self) -> int:
        """What holding this image costs in memory: what the worker gets and the features."""
        return self.forwarded_bytes + (self.features.nbytes if self.features is not None else 0)

    @property
    def data_url(self) -> str:
        if self.url is not None:
            return self.url
        return data_url(self.payload, self.mime)


def data_url(payload: bytes, mime: str) -> str:
    """A base64 data: URL of ``payload`` (encoded without the GIL)."""
    return f"data:{mime};base64," + pybase64.b64encode_as_string(payload)


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


def _load(image: Image.Image) -> Image.Image:
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
    """The exact cache key: canonical pixels + model + processor settings + namespace (BLAKE3, 256 bits)."""
    header = (
        f"{model}\0{namespace}\0{processor.patch_size},{processor.merge_size},"
        f"{processor.temporal_patch_size},{processor.min_pixels},{processor.max_pixels}\0"
        f"{rgb.width}x{rgb.height}\0"
    )
    digest = blake3.blake3(KEY_VERSION + b"\0" + header.encode())
    # rgb.tobytes(): whole up to _KEY_WHOLE_BYTES (a 1K-token image's pixels copied in 0.35 ms and hashed in 0.4 ms,
    # without the GIL; BLAKE2b took 2.7 ms), in strips past it, the same bytes without a second copy of the image at
    # once (120 MB for 40 Mpx).
    width, height = rgb.size
    if 3 * width * height <= _KEY_WHOLE_BYTES:
        digest.update(rgb.tobytes())
        return digest.hexdigest()
    rows = max(1, _KEY_STRIP_BYTES // (3 * width))
    for top in range(0, height, rows):
        digest.update(rgb.crop((0, top, width, min(height, top + rows))).tobytes())
    return digest.hexdigest()


def image_key(rgb: Image.Image, *, model: str, namespace: str, processor: ProcessorSettings,
              limits: ImageLimits) -> str:
    """The key decoded RGB pixels get as an image (:func:`canonicalize`): of the pixels at the model's size where
    the gateway resizes them. What a video's frames are keyed by, so that a frame sent as an image is known."""
    target = model_size(rgb.width, rgb.height, processor, limits)
    pixels = rgb if target is None else rgb.resize(target, Image.Resampling.BICUBIC)
    return content_key(pixels, model=model, namespace=namespace, processor=processor)


def _canonical_pixels(image: Image.Image, rotated: bool, target: tuple[int, int] | None) -> Image.Image:
    """The decoded ``image`` oriented, made RGB (alpha over white) and resized to ``target`` if given."""
    oriented = ImageOps.exif_transpose(image) if rotated else image
    if target is not None and oriented.mode == "L":  # resized grey, then made RGB: the same pixels, 1/4 the memory
        return oriented.resize(target, Image.Resampling.BICUBIC).convert("RGB")
    rgb = _to_rgb(oriented)
    del oriented  # (a converted copy's source: freed as the resize below runs)
    return rgb if target is None else rgb.resize(target, Image.Resampling.BICUBIC)


def model_size(width: int, height: int, processor: ProcessorSettings, limits: ImageLimits) -> tuple[int, int] | None:
    """(width, height) the gateway resizes an image of ``width x height`` (as oriented) to, or None to keep its
    size: an image of more pixels than the model keeps is resized to the size its processor would give it."""
    if not limits.resize_to_model or width * height <= processor.max_pixels:
        return None
    h_bar, w_bar = smart_resize(height, width, processor)
    return w_bar, h_bar


def encode_pixels(rgb: Image.Image, limits: ImageLimits) -> tuple[bytes, str]:
    """(payload, MIME type): RGB pixels as the worker gets them when not as uploaded. With
    ``limits.forward_decoded`` an uncompressed 24-bit BMP (1.7 ms for an 896-px image, its decode at the worker a
    copy), else a lossless PNG at zlib level 1 (tens of ms each way, a third to half the bytes for a photo)."""
    out = io.BytesIO()
    if limits.forward_decoded:
        rgb.save(out, format="BMP")
        return out.getvalue(), "image/bmp"
    rgb.save(out, format="PNG", compress_level=1)
    return out.getvalue(), "image/png"


def _oriented_size(size: tuple[int, int], orientation: int) -> tuple[int, int]:
    """(width, height) once an EXIF orientation is applied: 5 to 8 turn the image by 90 degrees."""
    return (size[1], size[0]) if orientation in (5, 6, 7, 8) else size


def _draft_jpeg(image: Image.Image, processor: ProcessorSettings, limits: ImageLimits) -> None:
    """Have libjpeg decode ``image`` (a JPEG, its header read, not yet decoded) at the smallest of 1/1, 1/2, 1/4
    and 1/8 scale that still leaves at least the size the gateway resizes it to (a JPEG's EXIF is in its header,
    so its orientation is known before decoding)."""
    orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
    target = model_size(*_oriented_size(image.size, orientation), processor, limits)
    if target is not None:
        image.draft(None, _oriented_size(target, orientation))


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

    An RGB JPEG (and with ``limits.forward_decoded`` off, PNG) the model keeps at its size, with no orientation to
    apply, is forwarded as it came: the worker decodes those bytes with the same Pillow to the same pixels.
    Anything else (a PNG, a rotation, alpha, palette, CMYK, another format, more pixels than the model keeps) goes
    as the keyed pixels (:func:`encode_pixels`).
    """
    image = _open_header(data, limits)
    source_format, source_size = image.format, image.size
    try:  # metadata (EXIF) and mode conversions read more of the file, which may be damaged there too
        if source_format == "JPEG":
            _draft_jpeg(image, processor, limits)
        image = _load(image)
        source_mode = image.mode
        orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
        rotated = orientation not in (0, 1)
        width, height = _oriented_size(source_size, orientation)
        target = model_size(width, height, processor, limits)
        rgb = _canonical_pixels(image, rotated, target)
    except _DECODE_ERRORS as exc:
        raise UnprocessableImage(f"image data is corrupt: {exc}", code="invalid_image") from exc
    del image  # the decoded source, when it was converted or resized: up to 160 MB that need not stay
    grid = token_grid(height, width, processor)
    key = content_key(rgb, model=model, namespace=namespace, processor=processor)
    forwarded_mime = _FORWARDED_AS_IS.get(source_format or "")
    if source_format == "PNG" and limits.forward_decoded:
        forwarded_mime = None  # the worker gets it decoded: no second inflate and unfilter there
    as_uploaded = forwarded_mime is not None and source_mode == "RGB" and not rotated and target is None
    uploaded, url = None, None
    if forwarded_mime is not None and as_uploaded:
        uploaded, mime = data, forwarded_mime
    else:
        payload, mime = encode_pixels(rgb, limits)
        url = data_url(payload, mime)
        del payload
    features = extractor.extract(rgb, (grid.rows, grid.cols), processor.factor) if extractor is not None else None
    return CanonicalImage(key=key, width=width, height=height, grid=grid, mime=mime, uploaded=uploaded, url=url,
                          features=features)
