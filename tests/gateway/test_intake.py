"""Intake: what the worker is sent for each image."""

from __future__ import annotations

import base64
import io
import json

from PIL import Image

from gateway.config import GatewayConfig
from gateway.image_fetch import ImageFetcher
from gateway.intake import Intake
from tests.images_lib import data_url, encode, load, small


def body(*urls: str) -> bytes:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": [*parts, {"type": "text",
                                                                                          "text": "hi"}]}]}).encode()


async def test_data_urls_forwarded_as_uploaded_are_not_encoded_again() -> None:
    config = GatewayConfig(model="m", workers=("http://127.0.0.1:1",))
    intake = Intake(config, ImageFetcher(config.images))
    jpeg = encode(small("astronaut.png").convert("RGB"), "JPEG")  # an RGB JPEG: forwarded as it came
    # Labelled with another type, so that a re-encoded copy (labelled image/bmp) would show.
    as_uploaded = data_url(jpeg, "application/octet-stream")
    padded = data_url(jpeg, "application/octet-stream") + "\n"  # accepted here, refused by SGLang's strict decode
    rgba = data_url(encode(load("astronaut.png").convert("RGBA")))  # composited over white: new pixels
    png = data_url(encode(small("coffee.png").convert("RGB")))  # forwarded decoded (ImageLimits.forward_decoded)
    result = await intake.process(body(as_uploaded, padded, rgba, png), namespace="n")
    urls = [part["image_url"]["url"] for part in result.upstream_body["messages"][0]["content"][:4]]
    assert urls[0] == as_uploaded  # the client's own string, not a re-encoded copy
    assert urls[1] == data_url(jpeg, "image/jpeg") and urls[2] != rgba
    for url, image in zip(urls[2:], result.images[2:], strict=True):
        assert url.startswith("data:image/bmp;base64,")
        rewritten = base64.b64decode(url.partition(",")[2])
        assert rewritten == image.payload and Image.open(io.BytesIO(rewritten)).mode == "RGB"
    assert [image.as_uploaded for image in result.images] == [True, True, False, False]
    # What the upstream body holds beside the client's bytes (it is encoded off the loop by this size).
    assert result.rewritten_bytes == len(jpeg) + len(urls[2]) + len(urls[3])


async def test_an_image_named_by_its_uuid_is_served_by_that_name_in_its_namespace_only() -> None:
    from gateway.errors import InvalidRequest

    config = GatewayConfig(model="m", workers=("http://127.0.0.1:1",))
    intake = Intake(config, ImageFetcher(config.images))
    url = data_url(encode(small("astronaut.png").convert("RGB")))

    def named(uuid: str, with_url: bool) -> bytes:
        part = {"type": "image_url", "image_url": {"url": url} if with_url else None, "uuid": uuid}
        return json.dumps({"model": "m", "messages": [{"role": "user", "content": [part]}]}).encode()

    first = await intake.process(named("sku-1", True), namespace="n")
    again = await intake.process(named("sku-1", False), namespace="n")
    assert again.images[0].key == first.images[0].key
    assert again.upstream_body["messages"][0]["content"][0]["image_url"]["url"] == first.images[0].data_url
    for uuid, namespace in (("sku-1", "other"), ("sku-2", "n")):
        try:
            await intake.process(named(uuid, False), namespace=namespace)
        except InvalidRequest as exc:
            assert exc.param == "messages[0].content[0].uuid" and exc.code == "unknown_image_uuid"
        else:
            raise AssertionError(f"{uuid} in {namespace} was served")
