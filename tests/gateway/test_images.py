import io

import numpy as np
import pytest
from PIL import Image, ImageOps
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


def test_rotated_jpeg_is_forwarded_as_the_keyed_pixels_uncompressed():
    exif = Image.Exif()
    exif[0x0112] = 6
    jpeg = encode(load("astronaut.png").convert("RGB"), "JPEG", quality=80, exif=exif)
    image = canon(jpeg)
    decoded = Image.open(io.BytesIO(image.payload))
    assert image.mime == "image/bmp" and decoded.format == "BMP" and decoded.mode == "RGB"
    assert len(image.payload) >= 3 * decoded.width * decoded.height  # nothing to inflate at the worker
    assert canon(image.payload).key == image.key


def test_a_png_is_forwarded_decoded_and_a_jpeg_as_it_came():
    rgb = load("astronaut.png").convert("RGB")
    png, jpeg = encode(rgb, "PNG"), encode(rgb, "JPEG")
    forwarded = canon(png)
    assert forwarded.mime == "image/bmp" and not forwarded.as_uploaded
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(forwarded.payload))), np.asarray(rgb))
    assert forwarded.key == canon(forwarded.payload).key == canon(encode(rgb, "WEBP", lossless=True)).key
    # Its data URL made once, and held instead of the BMP's bytes: a repeat is sent without encoding it again.
    assert forwarded.data_url is forwarded.data_url and forwarded.nbytes == len(forwarded.data_url)
    image = canon(jpeg)
    assert image.payload is jpeg and image.mime == "image/jpeg" and image.as_uploaded
    assert image.data_url.startswith("data:image/jpeg;base64,")


def test_with_forward_decoded_off_a_png_goes_as_it_came_and_re_encodes_as_png():
    limits = ImageLimits(forward_decoded=False)
    rgb = load("astronaut.png").convert("RGB")
    png = encode(rgb, "PNG")
    image = canon(png, limits=limits)
    assert image.payload is png and image.mime == "image/png" and image.as_uploaded
    rgba = canon(encode(rgb.convert("RGBA")), limits=limits)
    assert rgba.mime == "image/png" and Image.open(io.BytesIO(rgba.payload)).format == "PNG"
    assert rgba.key == image.key == canon(png).key  # the same pixels, the same key, whatever the worker gets


def test_palette_and_alpha_images_are_forwarded_as_rgb():
    for source in (load("astronaut.png").convert("RGBA"), load("astronaut.png").convert("P")):
        image = canon(encode(source))
        assert image.mime == "image/bmp"
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


# --- images of more pixels than the model keeps: resized at the gateway, once ---

TINY = ProcessorSettings(min_pixels=56 * 56, max_pixels=1024 * 28 * 28)  # the bundled model's processor


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth colour with fine noise: what a camera's picture looks like to a resize (edges and grain)."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (height // 16 + 1, width // 16 + 1, 3), dtype=np.uint8))
    pixels = np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
    grain = rng.integers(-20, 21, pixels.shape, dtype=np.int16)
    return Image.fromarray(np.clip(pixels + grain, 0, 255).astype(np.uint8))


def tiny(data: bytes, limits: ImageLimits = LIMITS):
    return canonicalize(data, limits=limits, processor=TINY, model="m", namespace="ns")


def test_an_image_larger_than_the_model_keeps_is_forwarded_at_the_models_size():
    source = photo(2400, 1800)
    image = tiny(encode(source))
    h_bar, w_bar = smart_resize(1800, 2400, TINY)
    forwarded = Image.open(io.BytesIO(image.payload))
    assert forwarded.size == (w_bar, h_bar) and forwarded.mode == "RGB" and image.mime == "image/bmp"
    assert not image.as_uploaded
    assert (image.width, image.height) == (2400, 1800)  # what the request's pixels are counted by
    assert (image.grid.rows * 28, image.grid.cols * 28) == (h_bar, w_bar)
    assert tiny(image.payload).key == image.key  # the key is of the pixels the model sees
    assert tiny(encode(source.resize((1200, 900), Image.Resampling.BICUBIC))).key != image.key


def test_the_workers_processor_keeps_the_forwarded_pixels_and_they_are_within_two_levels_of_its_own_resize():
    import torch
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor(size={"shortest_edge": TINY.min_pixels, "longest_edge": TINY.max_pixels})
    for width, height, seed in ((2400, 1800, 0), (1601, 1999, 1), (6320, 700, 2)):
        source = photo(width, height, seed)
        forwarded = Image.open(io.BytesIO(tiny(encode(source)).payload))
        as_sent = processor(images=[forwarded], return_tensors="pt")
        unresized = processor(images=[forwarded], do_resize=False, return_tensors="pt")
        own = processor(images=[source], return_tensors="pt")
        assert torch.equal(as_sent["pixel_values"], unresized["pixel_values"])  # its resize leaves them as they are
        assert torch.equal(as_sent["image_grid_thw"], own["image_grid_thw"])
        # Pillow's bicubic against torchvision's: a level or two of 255 apart, after the processor's normalisation
        two_levels = 2.5 / 255 / min(processor.image_std)
        difference = (as_sent["pixel_values"] - own["pixel_values"]).abs()
        assert difference.max().item() <= two_levels and difference.mean().item() < 0.2 / 255 / min(processor.image_std)


def test_a_large_grey_image_is_resized_as_grey_to_the_same_pixels_as_its_rgb_copy():
    grey = photo(3000, 2000).convert("L")  # what a 170 KB PNG declaring 40 Mpx usually is: resized in 1/4 the memory
    assert tiny(encode(grey)).key == tiny(encode(grey.convert("RGB"))).key


def test_a_large_jpeg_is_decoded_scaled_close_to_its_full_decoding_turned_as_its_exif_says():
    source = photo(4000, 3000)
    exif = Image.Exif()
    exif[0x0112] = 6  # turned by 90 degrees: the model sees it 3000 wide and 4000 high
    data = encode(source, "JPEG", quality=90, exif=exif)
    image = tiny(data)
    h_bar, w_bar = smart_resize(4000, 3000, TINY)
    forwarded = Image.open(io.BytesIO(image.payload))
    assert forwarded.size == (w_bar, h_bar) and (image.width, image.height) == (3000, 4000)
    full = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    reference = np.asarray(full.resize((w_bar, h_bar), Image.Resampling.BICUBIC), dtype=np.int16)
    assert np.abs(np.asarray(forwarded, dtype=np.int16) - reference).mean() < 2.0  # levels of 255


def test_resize_to_model_off_forwards_the_original():
    data = encode(photo(2400, 1800), "JPEG")
    image = tiny(data, limits=ImageLimits(resize_to_model=False))
    assert image.payload is data and image.as_uploaded
