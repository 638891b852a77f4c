"""Keeping K/V that no full prefill computes out of SGLang's prefix cache.

SGLang's prefix cache (the radix tree) keys K/V by token ids (an image's tokens by the image's hash), under the
request's ``extra_key`` (the gateway's tenant scope) and ``cache_salt``. A later request whose prompt starts with the
same tokens is served the K/V the tree holds instead of computing them. That is right only for K/V a full prefill
would have computed: an exact hit of an entry made after other text (moved), one read from a derived entry, or one
with layers recomputed, and every approximate hit, compute image K/V that differ from a full prefill's, and no later
request may take them for it.

Such a request is marked *private* by the executor while it runs (``PRIVATE.mark``, with the first row of its
first such image); when SGLang then inserts what it computed into the tree (at each checkpoint of a chunked
prefill, and when it finishes), only the rows before that one go in (the text before the image, computed as a full
prefill computes it), and the request carries SGLang's own flag for K/V the token ids do not determine
(``Req.skip_radix_cache_insert``, which SGLang sets for embedding overrides), so no later checkpoint of it inserts
more. Its prompt is still *matched* against the tree: the text before its image, computed exactly by an earlier
request, is not computed again.

``install`` wraps ``checkpoint`` and ``on_release`` of SGLang's prefix caches (every ``BasePrefixCache`` subclass
that defines them, including subclasses defined later); it is called when the executor is made, in every worker
process, before SGLang makes its tree.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from typing import Any

log = logging.getLogger(__name__)

_WRAPPED = "__revisit_private__"


class PrivateRequests:
    """Running requests whose K/V, from some row on, no later request may be served: by request id, that row (the
    first row of its first image computed otherwise than a full prefill would). Marked from the forward (SGLang's
    overlap scheduler runs it on a thread of its own), read where SGLang inserts into its tree; bounded, oldest
    forgotten first (an id is dropped at its first insert, which flags the request, so only requests aborted
    before any insert stay until pushed out)."""

    def __init__(self, capacity: int = 65536) -> None:
        self._capacity = capacity
        self._rids: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self.withheld_count = 0

    def mark(self, rid: str, exact_until: int) -> None:
        """K/V of ``rid`` at rows >= ``exact_until`` are not what a full prefill computes."""
        with self._lock:
            self._rids[rid] = min(exact_until, self._rids.get(rid, exact_until))
            self._rids.move_to_end(rid)
            while len(self._rids) > self._capacity:
                self._rids.popitem(last=False)

    def __contains__(self, rid: object) -> bool:
        with self._lock:
            return rid in self._rids

    def insertable(self, req: Any, up_to: int) -> int | None:
        """How far SGLang may insert ``req``'s K/V into its tree when it asks to insert up to ``up_to``: all of it
        for a request not marked; for a marked one, only rows before ``exact_until`` that the tree does not hold
        already, and from then on nothing (the request is flagged as SGLang flags K/V its token ids do not
        determine, ``skip_radix_cache_insert``, and forgotten here). None: insert nothing."""
        if getattr(req, "skip_radix_cache_insert", False):
            return None
        with self._lock:
            exact_until = self._rids.pop(str(getattr(req, "rid", "")), None)
            if exact_until is None:
                return up_to
            self.withheld_count += 1
        req.skip_radix_cache_insert = True
        # Rows the tree already owns for the request (its matched prefix, earlier inserts): an insert that ends
        # before them would hand rows back to the request that the tree still holds. Unknown: insert nothing.
        held = getattr(getattr(req, "kv", None), "cache_protected_len", None)
        limit = min(exact_until, up_to)
        return limit if isinstance(held, int) and limit > held else None


PRIVATE = PrivateRequests()


def install(private: PrivateRequests = PRIVATE) -> int:
    """Wrap SGLang's prefix caches (the module docstring); how many classes were wrapped now (0 when every one
    already was). Raises RuntimeError if SGLang's trees do not have the methods wrapped (another SGLang version)."""
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    wrapped = 0
    pending = [BasePrefixCache]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        wrapped += _wrap(cls, private)
    if not getattr(BasePrefixCache, _WRAPPED, False):
        original = BasePrefixCache.__dict__.get("__init_subclass__")

        def init_subclass(cls, **kwargs) -> None:  # a prefix cache defined after install is wrapped too
            if original is not None:
                original.__func__(cls, **kwargs)
            else:
                super(BasePrefixCache, cls).__init_subclass__(**kwargs)
            _wrap(cls, private)

        BasePrefixCache.__init_subclass__ = classmethod(init_subclass)
        setattr(BasePrefixCache, _WRAPPED, True)
    for tree in (RadixCache, UnifiedRadixCache):
        if not all(getattr(getattr(tree, name, None), _WRAPPED, False) for name in ("checkpoint", "on_release")):
            raise RuntimeError(f"SGLang's {tree.__name__} has no checkpoint and on_release to wrap: K/V of reuse "
                               "would be kept as a full prefill's")
    return wrapped


def _wrap(cls: type, private: PrivateRequests) -> int:
    """Wrap the methods ``cls`` itself defines; 1 if it defined any not yet wrapped."""
    done = 0
    checkpoint = cls.__dict__.get("checkpoint")
    if checkpoint is not None and not getattr(checkpoint, _WRAPPED, False) and \
            not getattr(checkpoint, "__isabstractmethod__", False):
        @functools.wraps(checkpoint)
        def withholding_checkpoint(self, req, *, up_to: int, **kwargs):
            limit = private.insertable(req, up_to)
            if limit is None:
                req.revisit_inserted_nothing = True  # for on_release, which SGLang tells it went into the tree
                return None
            return checkpoint(self, req, up_to=limit, **kwargs)

        setattr(withholding_checkpoint, _WRAPPED, True)
        cls.checkpoint = withholding_checkpoint  # type: ignore[attr-defined]
        done = 1
    on_release = cls.__dict__.get("on_release")
    if on_release is not None and not getattr(on_release, _WRAPPED, False):
        @functools.wraps(on_release)
        def truthful_on_release(self, req, *, checkpointed: bool, **kwargs):
            # SGLang decided to checkpoint before asking the tree; a withheld insert put nothing in it.
            inserted = checkpointed and not getattr(req, "revisit_inserted_nothing", False)
            return on_release(self, req, checkpointed=inserted, **kwargs)

        setattr(truthful_on_release, _WRAPPED, True)
        cls.on_release = truthful_on_release  # type: ignore[attr-defined]
        done = 1
    return done
