"""The reuse plan the gateway sends with a request and the worker executes.

A ``RequestPlan`` holds one ``ImagePlan`` per image of the request, in the order the images appear:

    miss         full prefill; the worker stores the image's entry (encoder output + KV) under ``key``
    exact        the entry under ``key`` is reused: the vision tower is skipped, keys are moved to this request's
                 positions, and at layer l the first floor(ratios[l] * n) image tokens are recomputed (empty ratios:
                 none; that is exact when the text before the image is the same as when the entry was made)
    approximate  the image is new but similar to the entry ``alias`` (same grid): warmup layers on every token,
                 then ``reuse`` tokens read the alias' late-layer KV, the worker picks ``recompute_share`` of the
                 tokens by attention to recompute, and drops the rest (see offline.reference.plans)

The wire form is compact JSON with a version; a worker refuses a version it does not know (PlanError) rather than
guess, and runs the request without a plan (a full prefill).

Transport: the plan rides in the request id (SGLang's ``rid``, which reaches the model's forward and is unique
among requests in flight): ``rv2.<request id>.<base64 of the zlib'd JSON>.`` The gateway replaces the id in what
it returns to clients, so the plan is never shown to them; anything SGLang appends after the last dot (it suffixes
ids of parallel samples) is ignored.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from plan.errors import PlanError
from plan.ratios import check_ratios

PLAN_VERSION = 2
RID_PREFIX = f"rv{PLAN_VERSION}."

MISS, EXACT, APPROXIMATE = "miss", "exact", "approximate"
STRATEGIES = (MISS, EXACT, APPROXIMATE)
_KEY_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, kw_only=True)
class ImagePlan:
    key: str  # this image's exact key
    strategy: str
    tokens: int  # LLM tokens of the image (grid h * w)
    grid: tuple[int, int]
    ratios: tuple[float, ...] = ()  # exact: per layer
    alias: str | None = None  # approximate: the matched entry's key
    warmup_layers: int = 0  # approximate: W
    reuse: tuple[int, ...] = ()  # approximate: B, token indices
    recompute_share: float = 0.0  # approximate: rho
    selector: str = "default"  # which token selection (baselines are chosen per request for evaluation)
    store: bool = True  # miss: whether the worker writes the entry
    prefix_digest: str = ""  # the gateway's digest of the prompt before the image; the worker records it in the entry

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not _KEY_RE.match(self.key):
            raise PlanError(f"key must be 64 lowercase hex characters, got {self.key!r:.80}")
        if not isinstance(self.prefix_digest, str) or len(self.prefix_digest) > 128:
            raise PlanError("prefix_digest must be a string of at most 128 characters")
        if self.strategy not in STRATEGIES:
            raise PlanError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if len(self.grid) != 2 or any(not isinstance(g, int) or g <= 0 for g in self.grid):
            raise PlanError(f"grid must be two positive ints, got {self.grid!r}")
        if self.tokens != self.grid[0] * self.grid[1]:
            raise PlanError(f"tokens {self.tokens} != grid {self.grid[0]} x {self.grid[1]}")
        object.__setattr__(self, "ratios", check_ratios(self.ratios))
        if self.strategy != EXACT and self.ratios:
            raise PlanError("ratios belong to exact plans")
        if self.strategy == APPROXIMATE:
            if self.alias is None or not _KEY_RE.match(self.alias) or self.alias == self.key:
                raise PlanError("an approximate plan needs an alias key other than its own")
            reuse = tuple(int(i) for i in self.reuse)
            if any(not 0 <= i < self.tokens for i in reuse) or len(set(reuse)) != len(reuse):
                raise PlanError(f"reuse must be distinct token indices in [0, {self.tokens})")
            object.__setattr__(self, "reuse", tuple(sorted(reuse)))
            if not 0.0 <= self.recompute_share <= 1.0 or self.warmup_layers < 0:
                raise PlanError("recompute_share must be in [0, 1] and warmup_layers >= 0")
        elif self.alias is not None or self.reuse or self.recompute_share or self.warmup_layers:
            raise PlanError("alias, reuse, recompute_share and warmup_layers belong to approximate plans")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["grid"] = list(self.grid)
        data["ratios"] = list(self.ratios)
        data["reuse"] = list(self.reuse)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ImagePlan:
        if not isinstance(data, Mapping):
            raise PlanError("an image plan must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise PlanError(f"unknown image plan fields {sorted(unknown)}")
        try:
            values = dict(data)
            values["grid"] = tuple(values["grid"])
            values["ratios"] = tuple(values.get("ratios", ()))
            values["reuse"] = tuple(values.get("reuse", ()))
            return cls(**values)
        except (KeyError, TypeError) as exc:
            raise PlanError(f"bad image plan: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class RequestPlan:
    images: tuple[ImagePlan, ...] = field(default_factory=tuple)
    version: int = PLAN_VERSION

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "images": [p.to_dict() for p in self.images]},
                          separators=(",", ":"))

    def to_rid(self, request_id: str) -> str:
        """A request id for SGLang that carries this plan (see the module docstring)."""
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", request_id):
            raise PlanError("request_id must be 1-64 characters of [A-Za-z0-9_-]")
        packed = base64.b64encode(zlib.compress(self.to_json().encode(), 6)).decode()
        return f"{RID_PREFIX}{request_id}.{packed}."

    @classmethod
    def from_rid(cls, rid: object) -> RequestPlan | None:
        """The plan a request id carries; None for ids without one. Raises PlanError for a damaged one."""
        if not isinstance(rid, str) or not rid.startswith(RID_PREFIX):
            return None
        parts = rid[len(RID_PREFIX) :].split(".")
        if len(parts) < 3:
            raise PlanError("request id has the plan prefix but no plan")
        try:
            text = zlib.decompress(base64.b64decode(parts[1], validate=True), bufsize=1 << 16)
        except (binascii.Error, zlib.error, ValueError) as exc:
            raise PlanError(f"request id carries a damaged plan: {exc}") from None
        return cls.from_json(text)

    @classmethod
    def from_json(cls, text: str | bytes) -> RequestPlan:
        try:
            data = json.loads(text)
        except (ValueError, TypeError) as exc:
            raise PlanError(f"plan is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise PlanError("a plan must be a JSON object")
        if data.get("version") != PLAN_VERSION:
            raise PlanError(f"plan version {data.get('version')!r} is not {PLAN_VERSION}")
        images = data.get("images")
        if not isinstance(images, list):
            raise PlanError("plan images must be a list")
        return cls(images=tuple(ImagePlan.from_dict(p) for p in images))
