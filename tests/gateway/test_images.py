import io

import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as reference_smart_resize

from gateway.config import ImageLimits, ProcessorSettings
from gateway.errors import InvalidRequest, PayloadTooLarge, UnprocessableImage
from gateway.images import canonicalize, smart_resize
from tests.images_lib import encode, load

PROC = ProcessorSettings()
LIMITS = ImageLimits()


def canon(data: bytes, namespace: str = "ns", model: str = "m", limits: ImageLimits = LIMITS):
    return canonicalize(data, limits=limits, processor=PROC, model=model, namespace=namespace)


@pytest.mark.parametrize(
    "height,width",
    [(1, 1), (28, 28), (55, 57), (224, 224), (512, 300), (1080, 1920), (4000, 3000), (20, 3900), (10000, 10000)],
)
def test_smart_resize_matches_the_qwen_processor(height, width):
    settings = ProcessorSettings(min_pixels=56 * 56, max_pixels=1280 * 28 * 28)
    expected = reference_smart_resize(height, width, factor=28, min_pixels=56 * 56, max_pixels=1280 * 28 * 28)
    assert smart_resize(height, width, settings) == tuple(expected)


def test_extreme_aspect_ratio_is_a_client_error():
    with pytest.raises(InvalidRequest, match="aspect ratio"):
        smart_resize(10, 2100, PROC)


def test_same_pixels_in_png_and_lossless_webp_share_a_key():
    image = load("astronaut.png")
    png = canon(encode(image, "PNG"))
    webp = canon(encode(image, "WEBP", lossless=True))
    assert png.key == webp.key
    assert png.grid == webp.grid


def test_exif_orientation_is_applied_before_keying():
    upright = load("coffee.png").convert("RGB")
    stored = upright.transpose(Image.Transpose.ROTATE_90)  # what a camera writes
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 clockwise to view": undoes the counter-clockwise ROTATE_90
    tagged = encode(stored, "PNG", exif=exif)
    a, b = canon(encode(upright, "PNG")), canon(tagged)
    assert (b.width, b.height) == (upright.width, upright.height)
    assert a.key == b.key


def test_alpha_is_composited_over_white():
    rgba = Image.new("RGBA", (64, 64), (10, 20, 30, 0))
    white = Image.new("RGB", (64, 64), (255, 255, 255))
    assert canon(encode(rgba)).key == canon(encode(white)).key


def test_key_depends_on_namespace_model_and_pixels():
    data = encode(load("astronaut.png"))
    base = canon(data).key
    assert canon(data, namespace="other").key != base
    assert canon(data, model="other").key != base
    changed = load("astronaut.png").copy()
    changed.putpixel((0, 0), (0, 0, 0))
    assert canon(encode(changed)).key != base


def test_rotated_jpeg_is_forwarded_as_png_of_the_keyed_pixels():
    exif = Image.Exif()
    exif[0x0112] = 6
    jpeg = encode(load("astronaut.png").convert("RGB"), "JPEG", quality=80, exif=exif)
    image = canon(jpeg)
    decoded = Image.open(io.BytesIO(image.payload))
    assert image.mime == "image/png" and decoded.format == "PNG" and decoded.mode == "RGB"
    assert canon(image.payload).key == image.key


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg")])
def test_canonical_rgb_png_and_jpeg_are_forwarded_as_they_came(fmt, mime):
    data = encode(load("astronaut.png").convert("RGB"), fmt)
    image = canon(data)
    assert image.payload is data and image.mime == mime
    assert image.data_url.startswith(f"data:{mime};base64,")


def test_palette_and_alpha_images_are_forwarded_as_rgb_png():
    for source in (load("astronaut.png").convert("RGBA"), load("astronaut.png").convert("P")):
        image = canon(encode(source))
        assert image.mime == "image/png"
        assert Image.open(io.BytesIO(image.payload)).mode == "RGB"


def test_grid_follows_the_processor():
    image = canon(encode(Image.new("RGB", (448, 224))))
    assert (image.grid.rows, image.grid.cols) == (8, 16)


def test_pixel_cap_is_checked_before_decoding():
    huge = encode(Image.new("1", (20000, 20000)))  # 50 MB of pixels, a few KB of PNG
    with pytest.raises(PayloadTooLarge, match="20000x20000 = 400000000 pixels; the limit is 10000000"):
        canon(huge, limits=ImageLimits(max_image_pixels=10_000_000))
    with pytest.raises(PayloadTooLarge, match=f"the limit is {LIMITS.max_image_pixels}$"):  # the default, not Pillow's
        canon(huge)


def test_non_image_bytes_are_unprocessable():
    with pytest.raises(UnprocessableImage, match="not a recognised image"):
        canon(b"%PDF-1.4 definitely not an image")


def test_truncated_image_is_unprocessable():
    data = encode(load("astronaut.png").convert("RGB"), "JPEG")
    with pytest.raises(UnprocessableImage, match="corrupt or truncated"):
        canon(data[: len(data) // 2])
