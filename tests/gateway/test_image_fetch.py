import base64
import binascii
import os

import pytest

from gateway.config import ImageLimits
from gateway.errors import InvalidRequest, PayloadTooLarge
from gateway.image_fetch import _BASE64_SLICE, ImageFetcher, _decode_base64, is_public_address
from tests.http_server import serve

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)
ROUTES = {
    "/a.png": (200, {"Content-Type": "image/png"}, PNG),
    "/big.png": (200, {"Content-Type": "image/png"}, b"\0" * 5000),
    "/hop": (302, {"Location": "/a.png"}, b""),
    "/loop": (302, {"Location": "/loop"}, b""),
}


@pytest.mark.parametrize(
    "address,public",
    [
        ("8.8.8.8", True), ("2001:4860:4860::8888", True),
        ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.9", False), ("192.168.1.1", False),
        ("169.254.169.254", False), ("0.0.0.0", False), ("::1", False), ("fe80::1", False),
        ("::ffff:127.0.0.1", False), ("fc00::1", False), ("224.0.0.1", False),
    ],
)
def test_public_address_classification(address, public):
    assert is_public_address(address) is public


async def fetch(url: str, **limits) -> bytes:
    fetcher = ImageFetcher(ImageLimits(**limits))
    try:
        return await fetcher.fetch(url, param="messages[0].content[0].image_url")
    finally:
        await fetcher.aclose()


async def test_loopback_url_is_refused_by_default():
    with serve(ROUTES) as base:
        with pytest.raises(InvalidRequest, match="non-public address") as info:
            await fetch(base + "/a.png")
    assert info.value.code == "image_url_refused"


async def test_localhost_name_is_refused_too():
    with serve(ROUTES) as base:
        with pytest.raises(InvalidRequest, match="non-public"):
            await fetch(base.replace("127.0.0.1", "localhost") + "/a.png")


async def test_allowed_private_url_is_fetched_and_redirects_followed():
    with serve(ROUTES) as base:
        assert await fetch(base + "/a.png", allow_private_urls=True) == PNG
        assert await fetch(base + "/hop", allow_private_urls=True) == PNG
        with pytest.raises(InvalidRequest, match="redirects"):
            await fetch(base + "/loop", allow_private_urls=True)
        with pytest.raises(InvalidRequest, match="HTTP 404"):
            await fetch(base + "/missing.png", allow_private_urls=True)
        with pytest.raises(PayloadTooLarge):
            await fetch(base + "/big.png", allow_private_urls=True, max_image_bytes=1000)


async def test_unreachable_host_is_a_client_error():
    with pytest.raises(InvalidRequest, match="cannot fetch"):
        await fetch("http://127.0.0.1:9/x.png", allow_private_urls=True, fetch_timeout_s=2)


async def test_data_urls():
    assert await fetch("data:image/png;base64," + base64.b64encode(PNG).decode()) == PNG
    with pytest.raises(InvalidRequest, match="invalid base64"):
        await fetch("data:image/png;base64,iVBORw0K$$$!!")
    with pytest.raises(InvalidRequest, match="must be base64"):
        await fetch("data:image/png,rawbytes")
    with pytest.raises(PayloadTooLarge):
        await fetch("data:image/png;base64," + "A" * 4000, max_image_bytes=1000)


async def test_other_schemes_are_refused():
    with pytest.raises(InvalidRequest, match="'file'"):
        await fetch("file:///etc/passwd")


def test_large_data_urls_decode_in_slices_exactly_as_one_strict_call() -> None:
    data = os.urandom(3 * _BASE64_SLICE + 5)  # several slices, and padding at the end
    encoded = base64.b64encode(data).decode()
    assert _decode_base64(encoded) == data == binascii.a2b_base64(encoded, strict_mode=True)
    url = "data:image/png;base64,"
    assert _decode_base64(url + encoded, len(url)) == data  # decoded where it sits in its URL
    assert _decode_base64(url + " \n" + encoded + "\r\n ", len(url)) == data  # whitespace around it ignored
    assert _decode_base64(url + base64.b64encode(b"abc").decode() + "\n", len(url)) == b"abc"  # one slice
    broken = encoded[: _BASE64_SLICE - 2] + "==" + encoded[_BASE64_SLICE:]  # padding where a slice ends
    for bad in (broken, encoded[:-1], encoded[:100] + "*" + encoded[101:]):
        with pytest.raises(binascii.Error):
            binascii.a2b_base64(bad, strict_mode=True)
        with pytest.raises(binascii.Error):
            _decode_base64(bad)
