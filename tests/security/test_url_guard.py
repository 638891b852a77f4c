"""Image and video URLs may only reach public hosts: every range that leads to an internal one is refused, including
those the standard library counts as public (shared address space, IPv6 transition ranges), and the guard refuses
before any connection is made."""

from __future__ import annotations

import httpcore
import pytest

from gateway.config import ImageLimits
from gateway.errors import InvalidRequest
from gateway.image_fetch import ImageFetcher, is_public_address

REFUSED = {
    "100.64.0.1": "shared address space (carrier-grade NAT)",
    "100.127.255.254": "shared address space, its last host",
    "0.0.0.0": "unspecified",
    "0.1.2.3": "this network, 0.0.0.0/8",
    "10.1.2.3": "private",
    "127.0.0.1": "loopback",
    "169.254.169.254": "link local (cloud metadata)",
    "172.16.0.9": "private",
    "192.0.0.8": "IETF protocol assignments, 192.0.0.0/24 (one is_global lets through)",
    "192.0.0.170": "IETF protocol assignments, 192.0.0.0/24",
    "192.88.99.1": "6to4 relay anycast",
    "192.168.1.1": "private",
    "198.18.0.1": "benchmarking, 198.18.0.0/15",
    "198.19.255.254": "benchmarking, its last host",
    "224.0.0.1": "multicast",
    "240.0.0.1": "reserved, 240.0.0.0/4",
    "255.255.255.255": "limited broadcast",
    "::": "unspecified",
    "::1": "loopback",
    "::127.0.0.1": "IPv4-compatible, of loopback",
    "::8.8.8.8": "IPv4-compatible (deprecated), even of a public address",
    "::ffff:127.0.0.1": "IPv4-mapped loopback",
    "::ffff:100.64.0.1": "IPv4-mapped shared address space",
    "::ffff:198.18.0.1": "IPv4-mapped benchmarking",
    "64:ff9b::7f00:1": "NAT64 well-known prefix, to loopback",
    "64:ff9b::a00:1": "NAT64 well-known prefix, to 10.0.0.1",
    "64:ff9b::808:808": "NAT64 well-known prefix, even to a public address",
    "64:ff9b:1::a00:1": "NAT64 local-use prefix",
    "2001::1": "Teredo",
    "2001:0:4136:e378:8000:63bf:3fff:fdd2": "Teredo, a real-shaped one",
    "2002:7f00:1::": "6to4 of 127.0.0.1",
    "2002:a00:1::1": "6to4 of 10.0.0.1",
    "2002:6440:1::": "6to4 of 100.64.0.1",
    "2002:808:808::1": "6to4, even of a public address",
    "fc00::1": "unique local",
    "fd12:3456:789a::1": "unique local",
    "fe80::1": "link local",
    "fe80::1%1": "link local with a scope",
    "fec0::1": "site local (deprecated)",
    "ff02::1": "multicast",
}
PUBLIC = ["8.8.8.8", "1.1.1.1", "93.184.216.34", "::ffff:8.8.8.8", "2606:4700:4700::1111", "2001:4860:4860::8888",
          "2a00:1450:4001:80e::200e"]


@pytest.mark.parametrize("address", sorted(REFUSED))
def test_non_public_ranges_are_refused(address: str) -> None:
    assert is_public_address(address) is False, REFUSED[address]


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_stay_public(address: str) -> None:
    assert is_public_address(address) is True


@pytest.mark.parametrize("url", ["http://100.64.0.1:9/x.png", "http://[2002:7f00:1::]:9/x.png",
                                 "https://[64:ff9b::7f00:1]:9/x.png"])
async def test_fetcher_refuses_before_connecting(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    connects: list[str] = []

    async def connect_tcp(self, host, port, *args, **kwargs):  # the guard's inner backend: the real connect
        connects.append(host)
        raise httpcore.ConnectError("no connection in this test")

    monkeypatch.setattr(httpcore.AnyIOBackend, "connect_tcp", connect_tcp)
    fetcher = ImageFetcher(ImageLimits())
    try:
        with pytest.raises(InvalidRequest, match="non-public address") as info:
            await fetcher.fetch(url, param="messages[0].content[0].image_url")
    finally:
        await fetcher.aclose()
    assert info.value.code == "image_url_refused"
    assert connects == []
