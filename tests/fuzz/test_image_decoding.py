"""Malformed image files: whatever the bytes, decoding gives a canonical image or a client error (400, 413, 422),
never another exception. Hypothesis mutates real files of every accepted format (bit flips, truncation, spliced
garbage, forged header sizes), and a few hand-made hostile ones are always tried."""

from __future__ import annotations

import io
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from gateway.config import ImageLimits, ProcessorSettings
from gateway.errors import ClientError
from gateway.images import canonicalize
from tests.images_lib import encode, small

LIMITS = ImageLimits(max_image_pixels=4_000_000)
PROCESSOR = ProcessorSettings()
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


def seeds() -> dict[str, bytes]:
    picture = small("coffee.png", (64, 48))
    out = {fmt: encode(picture.convert("P") if fmt == "GIF" else picture, fmt) for fmt in FORMATS}
    out["PNG-alpha"] = encode(picture.convert("RGBA"))
    animated = io.BytesIO()
    picture.convert("P").save(animated, "GIF", save_all=True, append_images=[picture.convert("P").rotate(90)])
    out["GIF-animated"] = animated.getvalue()
    return out


SEEDS = seeds()


def decode(data: bytes) -> None:
    try:
        canonical = canonicalize(data, limits=LIMITS, processor=PROCESSOR, model="m", namespace="ns")
    except ClientError as exc:
        assert 400 <= exc.status_code < 500 and str(exc)
        return
    assert canonical.key and canonical.grid.tokens > 0


def png_claiming(width: int, height: int, idat: bytes = b"") -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


HOSTILE = {
    "empty": b"",
    "png signature only": b"\x89PNG\r\n\x1a\n",
    "a PNG claiming 60000 x 60000": png_claiming(60000, 60000, zlib.compress(b"\x00" * 100)),
    "a PNG claiming 0 x 10": png_claiming(0, 10),
    "a PNG whose data does not inflate": png_claiming(8, 8, b"not zlib at all"),
    "a PNG whose data is a zip bomb's start": png_claiming(1999, 1999, zlib.compress(b"\x00" * 12_000_000)),
    "a JPEG cut after its header": SEEDS["JPEG"][:200],
    "a GIF with a huge logical screen": b"GIF89a" + struct.pack("<HH", 65535, 65535) + b"\x00\x00\x00;",
    "text": b"<svg xmlns='http://www.w3.org/2000/svg'/>",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_files_are_client_errors(name: str) -> None:
    decode(HOSTILE[name])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.sampled_from(sorted(SEEDS)), data=st.data())
def test_mutated_files_decode_or_are_client_errors(seed: str, data) -> None:
    raw = bytearray(SEEDS[seed])
    kind = data.draw(st.sampled_from(["flip", "truncate", "splice", "header"]))
    if kind == "flip":
        for at in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=16)):
            raw[at] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "splice":
        at = data.draw(st.integers(0, len(raw)))
        raw[at:at] = data.draw(st.binary(min_size=1, max_size=256))
    else:  # overwrite bytes near the start, where formats keep their sizes and counts
        at = data.draw(st.integers(0, min(64, len(raw) - 4)))
        raw[at:at + 4] = data.draw(st.binary(min_size=4, max_size=4))
    decode(bytes(raw))


def test_the_seeds_themselves_decode() -> None:
    for name, raw in SEEDS.items():
        assert canonicalize(raw, limits=LIMITS, processor=PROCESSOR, model="m", namespace="ns").key, name
        Image.open(io.BytesIO(raw)).verify()
