from gateway.config import ImageLimits, ProcessorSettings
from gateway.image_memo import CanonicalMemo
from gateway.images import canonicalize
from tests.images_lib import encode, small


def canon(data: bytes, namespace: str):
    return canonicalize(data, limits=ImageLimits(), processor=ProcessorSettings(), model="m", namespace=namespace)


def test_memo_returns_what_was_put_per_namespace():
    data = encode(small("astronaut.png"))
    digest = CanonicalMemo.digest(data)
    memo = CanonicalMemo(budget_bytes=10 * 1024 * 1024)
    assert memo.get("a", digest) is None
    image = canon(data, "a")
    memo.put("a", digest, image)
    assert memo.get("a", digest) is image
    assert memo.get("b", digest) is None  # another tenant decodes for itself
    assert (memo.hits, memo.misses) == (1, 2)


def test_memo_stays_within_its_budget_evicting_least_recently_used():
    images = [encode(small(name)) for name in ("astronaut.png", "coffee.png", "chelsea.png")]
    one = canon(images[0], "a").nbytes + 512
    memo = CanonicalMemo(budget_bytes=int(one * 2.5))
    digests = [CanonicalMemo.digest(d) for d in images]
    memo.put("a", digests[0], canon(images[0], "a"))
    memo.put("a", digests[1], canon(images[1], "a"))
    assert memo.get("a", digests[0]) is not None  # now most recently used
    memo.put("a", digests[2], canon(images[2], "a"))
    assert memo.bytes_used <= memo._budget
    assert memo.get("a", digests[1]) is None and memo.get("a", digests[0]) is not None


def test_zero_budget_remembers_nothing():
    data = encode(small("astronaut.png"))
    memo = CanonicalMemo(budget_bytes=0)
    memo.put("a", CanonicalMemo.digest(data), canon(data, "a"))
    assert len(memo) == 0
