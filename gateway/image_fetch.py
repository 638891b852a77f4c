"""Turning an image URL (``data:`` or ``http(s)``) into bytes, under limits.

Remote fetches go through :class:`AddressGuard`, a network backend that resolves the
host itself and connects to the address it checked. Checking the name and then letting
the HTTP library resolve it again would leave a window for DNS rebinding; here the
check and the connection use the same address, on every redirect hop.
"""

from __future__ import annotations

import asyncio
import binascii
import ipaddress
import socket
from collections.abc import Iterable

import httpcore
import httpx
import pybase64

from gateway.config import ImageLimits
from gateway.errors import InvalidRequest, PayloadTooLarge
from gateway.json_body import CutURL
from gateway.offload import off_loop

_DATA_PREFIX = "data:"


class BlockedAddress(httpx.ConnectError):
    """The URL's host resolves to an address the gateway may not reach."""


# Ranges refused on top of what ``ipaddress`` calls non-global. Some of them it already counts as private or
# reserved on Python 3.11; they are named here anyway, so that the guard does not change with the library's tables
# (whose ``is_global`` has changed between patch releases).
_NON_PUBLIC_V4 = tuple(ipaddress.IPv4Network(n) for n in (
    "0.0.0.0/8",  # "this network"
    "100.64.0.0/10",  # shared address space (carrier-grade NAT): internal hosts, and not private to ipaddress
    "192.0.0.0/24",  # IETF protocol assignments (is_global exempts a few of them)
    "192.88.99.0/24",  # the deprecated 6to4 relay anycast: a way into 2002::/16
    "198.18.0.0/15",  # benchmarking
    "240.0.0.0/4",  # reserved, and the broadcast address 255.255.255.255 in it
))
# IPv6 ranges that carry (or translate to) an IPv4 address, refused whole rather than judged by the embedded one:
# a fetch through them reaches whatever IPv4 host the network's relay or translator sends it to.
_NON_PUBLIC_V6 = tuple(ipaddress.IPv6Network(n) for n in (
    "::/96",  # IPv4-compatible ::a.b.c.d (deprecated), with :: and ::1
    "64:ff9b::/96",  # NAT64, the well-known prefix
    "64:ff9b:1::/48",  # NAT64, local-use prefixes
    "2001::/32",  # Teredo
    "2002::/16",  # 6to4
    "fc00::/7",  # unique local
    "fec0::/10",  # site local (deprecated)
))


def is_public_address(address: str) -> bool:
    """Whether an image or video URL may be fetched from ``address``: a globally routable unicast address that no
    relay or translator maps to another (an IPv4-mapped IPv6 address is judged as its IPv4 address)."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return is_public_address(str(ip.ipv4_mapped))
        if ip.sixtofour is not None or ip.teredo is not None or any(ip in net for net in _NON_PUBLIC_V6):
            return False
    elif any(ip in net for net in _NON_PUBLIC_V4):
        return False
    return ip.is_global and not (
        ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
        or ip.is_reserved or ip.is_unspecified
    )


class AddressGuard(httpcore.AsyncNetworkBackend):
    """Resolves, refuses non-public addresses (unless allowed), connects to the checked address."""

    def __init__(self, allow_private: bool, inner: httpcore.AsyncNetworkBackend | None = None):
        self._allow_private = allow_private
        self._inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable | None = None,
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout
            )
        except (TimeoutError, OSError) as exc:
            raise httpcore.ConnectError(f"cannot resolve {host}: {exc}") from exc
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        if not self._allow_private:
            blocked = [a for a in addresses if not is_public_address(a)]
            if blocked:
                raise BlockedAddress(f"{host} resolves to a non-public address ({blocked[0]})")
        last: Exception | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    address, port, timeout=timeout, local_address=local_address,
                    socket_options=socket_options,
                )
            except httpcore.ConnectError as exc:
                last = exc
        raise httpcore.ConnectError(f"cannot connect to {host}: {last}")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _GuardedTransport(httpx.AsyncHTTPTransport):
    def __init__(self, allow_private: bool):
        super().__init__()
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(),
            max_connections=32,
            network_backend=AddressGuard(allow_private),
        )


class ImageFetcher:
    """Resolves image and video URLs to bytes. One per app; :meth:`aclose` on shutdown."""

    def __init__(self, limits: ImageLimits):
        self._limits = limits
        self._client = httpx.AsyncClient(
            transport=_GuardedTransport(limits.allow_private_urls),
            timeout=httpx.Timeout(limits.fetch_timeout_s),
            follow_redirects=True,
            max_redirects=limits.max_redirects,
            headers={"User-Agent": "revisit-gateway/0.1"},
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def fetch(self, url: str, *, param: str, media: str = "image", limit: int | None = None) -> bytes:
        """The bytes a data: or http(s) URL holds, at most ``limit`` (default: the image limit) of them. ``media``
        ("image" or "video") names what is fetched in errors and in the Accept header."""
        limit = self._limits.max_image_bytes if limit is None else limit
        if url.startswith(_DATA_PREFIX):
            return await off_loop(url_length(url), self._decode_data_url, url, param, media, limit)
        if url.startswith(("http://", "https://")):
            try:
                async with asyncio.timeout(self._limits.fetch_deadline_s):  # a server that drips a byte at a time
                    return await self._fetch_remote(url, param, media, limit)
            except TimeoutError:
                raise InvalidRequest(f"{param}: fetching the {media} took longer than "
                                     f"{self._limits.fetch_deadline_s:g} s", param=param,
                                     code=f"{media}_fetch_timeout") from None
        scheme = url.split(":", 1)[0] if ":" in url else url[:16]
        raise InvalidRequest(
            f"{param}.url must be a data: URL or an http(s) URL, not {scheme!r}", param=f"{param}.url"
        )

    def _decode_data_url(self, url: str, param: str, media: str, limit: int) -> bytes:
        comma = url.find(",", 0, 4096)  # the header is short; the payload is not copied out of the URL
        if comma < 0 or not url.endswith(";base64", 0, comma):
            example = "data:image/png;base64,..." if media == "image" else "data:video/mp4;base64,..."
            raise InvalidRequest(
                f"{param}.url: data URLs must be base64 encoded ({example})",
                param=f"{param}.url",
            )
        source, start, end = (url.source, url.payload_start, url.end) if isinstance(url, CutURL) \
            else (url, comma + 1, len(url))
        if (end - start) * 3 // 4 > limit:
            raise PayloadTooLarge(f"{param}: {media} exceeds {limit} bytes", param=param, code=f"{media}_too_large")
        try:
            return _decode_base64(source, start, end)
        except binascii.Error as exc:
            raise InvalidRequest(f"{param}.url: invalid base64 data: {exc}", param=f"{param}.url") from exc

    async def _fetch_remote(self, url: str, param: str, media: str, limit: int) -> bytes:
        too_large = PayloadTooLarge(f"{param}: {media} exceeds {limit} bytes", param=param, code=f"{media}_too_large")
        try:
            async with self._client.stream("GET", url, headers={"Accept": f"{media}/*"}) as response:
                if response.status_code != 200:
                    raise InvalidRequest(
                        f"{param}: fetching the {media} returned HTTP {response.status_code}", param=param
                    )
                declared = response.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > limit:
                    raise too_large
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
                return b"".join(chunks)
        except BlockedAddress as exc:
            raise InvalidRequest(
                f"{param}: {media} URL refused: {exc}", param=param, code=f"{media}_url_refused"
            ) from exc
        except httpx.TooManyRedirects as exc:
            raise InvalidRequest(f"{param}: too many redirects fetching the {media}", param=param) from exc
        except httpx.TimeoutException as exc:
            raise InvalidRequest(f"{param}: fetching the {media} timed out", param=param) from exc
        except httpx.HTTPError as exc:
            raise InvalidRequest(f"{param}: cannot fetch the {media}: {exc}", param=param) from exc


# Characters per decoding call. pybase64 decodes without the GIL (binascii holds it: 5.7 ms a MiB on a 2-core
# machine, and the event loop waited as long), so what holds it is slicing the URL's text, which copies: the whole
# payload at once is a 27 MB copy into new memory (up to 19 ms of page faults); slices of 1 MiB, and the join of
# their results (bytes.join copies without the GIL), left the loop's worst lag at 1 ms for a 20 MB image, in 11 ms.
_BASE64_SLICE = 1 << 20


def _decode_base64(text: str | bytes | bytearray, start: int = 0, end: int | None = None) -> bytes:
    """Strict base64 decoding of ``text[start:end]`` (surrounding whitespace ignored; a string, or the bytes of a
    body a CutURL lies in), in slices, without holding the GIL for long (see _BASE64_SLICE) or copying the payload
    out first. Raises binascii.Error for what a strict a2b_base64 refuses."""
    end = len(text) if end is None else end
    while start < end and text[start:start + 1].isspace():
        start += 1
    while end > start and text[end - 1:end].isspace():
        end -= 1
    if (end - start) % 4:
        raise binascii.Error("Incorrect padding")
    padding = "=" if isinstance(text, str) else b"="
    if text.find(padding, start, end - 2) != -1:  # type: ignore[arg-type]  # padding only at the very end
        raise binascii.Error("Excess data after padding")
    view = text if isinstance(text, str) else memoryview(text)  # slices of the bytes, not copies
    try:
        return b"".join([pybase64.b64decode(view[at : min(at + _BASE64_SLICE, end)], validate=True)
                         for at in range(start, end, _BASE64_SLICE)])
    except ValueError as exc:  # pybase64 raises binascii.Error, a ValueError; a non-ASCII character, ValueError
        raise binascii.Error(str(exc)) from None


def url_length(url: str) -> int:
    """Characters of a URL, a CutURL's whole (not of the placeholder that stands for its base64)."""
    return url.length if isinstance(url, CutURL) else len(url)
