"""The reuse plan the gateway sends with a request and the worker executes.

A ``RequestPlan`` holds one ``ImagePlan`` per image of the request, in the order the images appear, and one per
temporal patch of its videos (``patches``, every video's patches in prompt order; a patch is a video's tokens of
two sampled frames, its grid the patch's tokens, planned as an image is but with the vision tower always run over
the whole video):

    miss         full prefill; the worker stores the image's entry (encoder output + KV) under ``key``
    exact        the entry under ``key`` is reused: the vision tower is skipped, keys are moved to this request's
                 positions, and at layer l the first floor(ratios[l] * n) image tokens are recomputed (empty ratios:
                 none; that is exact when the text before the image is the same as when the entry was made)
    approximate  the image is new but similar to the entry ``alias``: its token (r, c) lines up with the alias'
                 token (r - dy, c - dx) for ``shift`` (dy, dx) (a scrolled page, a panned frame, a crop), and
                 ``change_map`` says per token whether it is the same ("="), similar ("~") or changed ("x", also
                 every token with no aligned alias token). Warmup layers [0, W) run every token; from W on the
                 ``reuse`` tokens (B) read the alias' K/V at their aligned tokens, the worker picks the tokens to
                 recompute (R: every changed token, plus ``recompute_share`` of the tokens by the selector's score)
                 and drops the rest (see offline.reference.plans). The ``selector`` names how:

        entropy_aware   B = the lowest-entropy share of the same/similar tokens (the gateway picks it); R is scored
                        by the attention the question pays each token in the warmup, normalised against attention
                        sinks, and never takes a token of B (the design's default)
        attention_only  B = every same/similar token; R by warmup attention, taken out of B
        cacheblend      change-blind: B = every aligned token; R = the tokens whose K/V deviate most from the
                        alias' after the first layer (W = 1), taken out of B
        downstream      B = every same/similar token; R = the tokens that come after a changed one in reading order,
                        nearest to it in the grid first (a causal decoder's tokens that may have taken notes of
                        the changed one's old value), taken out of B; ranked by position, nothing measured
        vlcache         change-blind: B = every aligned token; R = the first tokens of the image, taken out of B
        full_reuse      change-blind: B = every aligned token; nothing recomputed but tokens with no alias token
                        (the naive baseline)

The rule that turns these into R, B and D is engine_ext.selection, shared by the workers and the reference.
``vision`` says where an approximate plan's encoder output comes from: ``full``, the vision tower over the whole
new image; ``partial``, the alias' stored encoder output at every aligned token, and the vision tower over only the
tokens whose pixels differ (changed or similar) and their margin (engine_ext.vision), at their true positions in
the image.

The wire form is compact JSON with a version; a worker refuses a version it does not know (PlanError) rather than
guess, and runs the request without a plan (a full prefill).

Transport: the plan rides in the request id (SGLang's ``rid``, which reaches the model's forward and is unique
among requests in flight): ``rv7.<request id>.<base64 of the zlib'd JSON>.<MAC>.`` The gateway replaces the id in
what it returns to clients, so the plan is never shown to them; anything SGLang appends after the last dot (it
suffixes ids of parallel samples) is ignored.

Authentication: the MAC (keyed BLAKE3, 128 bits, over the request id and the packed plan, under the
deployment secret's "plan" key, :func:`plan_key`) is checked before the plan is read, so only a gateway holding the
secret can make a worker load an entry, reuse another request's K/V or key the encoder cache under a tenant's
scope. A plan whose MAC does not hold is refused (PlanError) and its request runs unplanned.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from plan.errors import PlanError
from plan.ratios import check_ratios
from settings.secret import DataPlaneSecret, mac, same_mac

PLAN_VERSION = 7  # 5: plans carry a MAC; 6: an image plan's ``strategy`` is its ``kind``; 7: videos' patches
RID_PREFIX = f"rv{PLAN_VERSION}."
_MAC_BYTES = 16


def plan_key(secret: DataPlaneSecret) -> bytes:
    """The key plans are authenticated with under the deployment secret (settings/secret.py)."""
    return secret.key("plan")


# The key of a deployment without a secret (a laptop's `revisit serve`, the tests' and benches' own workers).
PUBLIC_PLAN_KEY = plan_key(DataPlaneSecret())


def _plan_mac(key: bytes, request_id: str, packed: str) -> str:
    tag = mac(key, b"revisit-plan", request_id.encode(), packed.encode(), size=_MAC_BYTES)
    return base64.urlsafe_b64encode(tag).decode().rstrip("=")

MISS, EXACT, APPROXIMATE = "miss", "exact", "approximate"
PLAN_KINDS = (MISS, EXACT, APPROXIMATE)
ENTROPY_AWARE, ATTENTION_ONLY, DOWNSTREAM, CACHEBLEND, VLCACHE, FULL_REUSE = (
    "entropy_aware", "attention_only", "downstream", "cacheblend", "vlcache", "full_reuse")
SELECTORS = (ENTROPY_AWARE, ATTENTION_ONLY, DOWNSTREAM, CACHEBLEND, VLCACHE, FULL_REUSE)
CHANGE_AWARE = (ENTROPY_AWARE, ATTENTION_ONLY, DOWNSTREAM)  # never reuse a changed token: it is always in R
CHANGE_BLIND = (CACHEBLEND, VLCACHE, FULL_REUSE)  # the baselines that reuse changed tokens too
FULL_PASS, PARTIAL_PASS = "full", "partial"
VISION_PASSES = (FULL_PASS, PARTIAL_PASS)
SAME, SIMILAR, CHANGED = "=", "~", "x"  # the change map's characters
_KEY_RE = re.compile(r"^[0-9a-f]{64}$")
_CHANGE_MAP_RE = re.compile(r"^[=~x]*$")


@dataclass(frozen=True, kw_only=True)
class ImagePlan:
    key: str  # this image's exact key
    kind: str  # miss, exact or approximate (PLAN_KINDS)
    tokens: int  # LLM tokens of the image (grid h * w)
    grid: tuple[int, int]
    ratios: tuple[float, ...] = ()  # exact: per layer
    alias: str | None = None  # approximate: the matched entry's key
    alias_grid: tuple[int, int] | None = None  # approximate: the alias' grid (a crop's alias is larger)
    shift: tuple[int, int] = (0, 0)  # approximate: (dy, dx) in tokens, see the module docstring
    change_map: str = ""  # approximate: one of "=~x" per token
    similarity: float = 0.0  # approximate: the match's score (reported, not executed)
    warmup_layers: int = 0  # approximate: W
    reuse: tuple[int, ...] = ()  # approximate: B, token indices of this image
    recompute_share: float = 0.0  # approximate: rho
    selector: str = ENTROPY_AWARE  # approximate: how R, B and D are chosen (SELECTORS; the gateway sends its own)
    vision: str = FULL_PASS  # approximate: the vision pass, full or partial (see the module docstring)
    store: bool = True  # whether the worker writes the entry when it computes the image exactly (a miss, or an
    # approximate plan it had to run as a full prefill)
    derive: bool = False  # approximate: whether the worker stores the K/V it computed approximately as a derived
    # entry (store.entry.EntryHeader.derived_from), so that the image's next sight is an exact hit; it does only
    # where nothing was dropped (D empty: the entry then holds exactly the K/V the request attended to)
    prefix_digest: str = ""  # the gateway's digest of the prompt before the image; the worker records it in the entry

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not _KEY_RE.match(self.key):
            raise PlanError(f"key must be 64 lowercase hex characters, got {self.key!r:.80}")
        if not isinstance(self.prefix_digest, str) or len(self.prefix_digest) > 128:
            raise PlanError("prefix_digest must be a string of at most 128 characters")
        if self.kind not in PLAN_KINDS:
            raise PlanError(f"kind must be one of {PLAN_KINDS}, got {self.kind!r}")
        if len(self.grid) != 2 or any(not isinstance(g, int) or g <= 0 for g in self.grid):
            raise PlanError(f"grid must be two positive ints, got {self.grid!r}")
        if self.tokens != self.grid[0] * self.grid[1]:
            raise PlanError(f"tokens {self.tokens} != grid {self.grid[0]} x {self.grid[1]}")
        object.__setattr__(self, "ratios", check_ratios(self.ratios))
        if self.kind != EXACT and self.ratios:
            raise PlanError("ratios belong to exact plans")
        if self.kind == APPROXIMATE:
            if self.alias is None or not _KEY_RE.match(self.alias) or self.alias == self.key:
                raise PlanError("an approximate plan needs an alias key other than its own")
            reuse = tuple(int(i) for i in self.reuse)
            if any(not 0 <= i < self.tokens for i in reuse) or len(set(reuse)) != len(reuse):
                raise PlanError(f"reuse must be distinct token indices in [0, {self.tokens})")
            object.__setattr__(self, "reuse", tuple(sorted(reuse)))
            if not 0.0 <= self.recompute_share <= 1.0 or self.warmup_layers < 0:
                raise PlanError("recompute_share must be in [0, 1] and warmup_layers >= 0")
            self._check_alignment()
        elif (self.alias is not None or self.alias_grid is not None or self.reuse or self.recompute_share
              or self.warmup_layers or self.change_map or self.shift != (0, 0) or self.similarity
              or self.vision != FULL_PASS or self.derive):
            raise PlanError("alias, alias_grid, shift, change_map, similarity, reuse, recompute_share, "
                            "warmup_layers, a partial vision pass and derive belong to approximate plans")
        if self.vision not in VISION_PASSES:
            raise PlanError(f"vision must be one of {VISION_PASSES}, got {self.vision!r}")

    def _check_alignment(self) -> None:
        if self.selector not in SELECTORS:
            raise PlanError(f"selector must be one of {SELECTORS}, got {self.selector!r}")
        alias_grid = self.alias_grid or self.grid
        if len(alias_grid) != 2 or any(not isinstance(g, int) or g <= 0 for g in alias_grid):
            raise PlanError(f"alias_grid must be two positive ints, got {self.alias_grid!r}")
        object.__setattr__(self, "alias_grid", tuple(alias_grid))
        if len(self.shift) != 2 or any(not isinstance(d, int) for d in self.shift):
            raise PlanError(f"shift must be two ints, got {self.shift!r}")
        object.__setattr__(self, "shift", tuple(self.shift))
        if len(self.change_map) != self.tokens or not _CHANGE_MAP_RE.match(self.change_map):
            raise PlanError(f"change_map must hold one of '=~x' per token ({self.tokens})")
        for i in self.reuse:
            if self.alias_token(i) is None:
                raise PlanError(f"reuse token {i} has no aligned alias token")
            if self.change_map[i] == CHANGED and self.selector in CHANGE_AWARE:
                raise PlanError(f"reuse token {i} is changed; {self.selector} never reuses changed tokens")

    def alias_token(self, token: int) -> int | None:
        """The alias token aligned with this image's token (row-major index), or None where there is none."""
        rows_alias, cols_alias = self.alias_grid or self.grid
        row, col = divmod(token, self.grid[1])
        row, col = row - self.shift[0], col - self.shift[1]
        if 0 <= row < rows_alias and 0 <= col < cols_alias:
            return row * cols_alias + col
        return None

    def to_dict(self) -> dict[str, Any]:
        # Every field is a scalar, a string or a tuple of scalars: a shallow copy (asdict's deep one took a tenth of
        # a millisecond a request), its tuples as lists.
        data = {name: getattr(self, name) for name in _IMAGE_PLAN_FIELDS}
        data["grid"] = list(self.grid)
        data["ratios"] = list(self.ratios)
        data["reuse"] = list(self.reuse)
        data["shift"] = list(self.shift)
        if self.alias_grid is not None:
            data["alias_grid"] = list(self.alias_grid)
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
            values["shift"] = tuple(values.get("shift", (0, 0)))
            if values.get("alias_grid") is not None:
                values["alias_grid"] = tuple(values["alias_grid"])
            return cls(**values)
        except (KeyError, TypeError) as exc:
            raise PlanError(f"bad image plan: {exc}") from None


_IMAGE_PLAN_FIELDS = tuple(f.name for f in fields(ImagePlan))


@dataclass(frozen=True, kw_only=True)
class RequestPlan:
    images: tuple[ImagePlan, ...] = field(default_factory=tuple)
    # One per temporal patch of the request's videos, in prompt order (a patch's vision pass is the whole video's:
    # an approximate patch plan is a full pass)
    patches: tuple[ImagePlan, ...] = field(default_factory=tuple)
    # The tenant's cache scope (a digest of its namespace, never the name): the worker keys SGLang's encoder-output
    # cache by it, so that no namespace is served, or can time, another's image embeddings. "" for none.
    scope: str = ""
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]{0,64}", self.scope):
            raise PlanError("scope must be up to 64 characters of [A-Za-z0-9_-]")
        if any(p.vision != FULL_PASS for p in self.patches):
            raise PlanError("a video's patches have no partial vision pass")

    @property
    def reported(self) -> bool:
        """Whether the gateway reads back what ran (plan.outcome): not for plans that only carry the scope (every
        image a miss that is not stored, as when reuse is off)."""
        return any(p.kind != MISS or p.store for p in self.images + self.patches)

    def to_json(self) -> str:
        data: dict[str, Any] = {"version": self.version, "scope": self.scope,
                                "images": [p.to_dict() for p in self.images]}
        if self.patches:
            data["patches"] = [p.to_dict() for p in self.patches]
        return json.dumps(data, separators=(",", ":"))

    def to_rid(self, request_id: str, *, key: bytes) -> str:
        """A request id for SGLang that carries this plan, authenticated under ``key`` (:func:`plan_key`)."""
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", request_id):
            raise PlanError("request_id must be 1-64 characters of [A-Za-z0-9_-]")
        packed = base64.b64encode(zlib.compress(self.to_json().encode(), 6)).decode()
        return f"{RID_PREFIX}{request_id}.{packed}.{_plan_mac(key, request_id, packed)}."

    @staticmethod
    def request_id(rid: object) -> str | None:
        """The gateway's request id inside a plan-carrying rid (to_rid's ``request_id``); None for other ids."""
        if not isinstance(rid, str) or not rid.startswith(RID_PREFIX):
            return None
        request_id = rid[len(RID_PREFIX):].split(".", 1)[0]
        return request_id if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", request_id) else None

    @classmethod
    def from_rid(cls, rid: object, *, key: bytes) -> RequestPlan | None:
        """The plan a request id carries; None for ids without one. Raises PlanError for a damaged one, or one not
        authenticated under ``key`` (:func:`plan_key`): forged, or made under another secret."""
        if not isinstance(rid, str) or not rid.startswith(RID_PREFIX):
            return None
        parts = rid[len(RID_PREFIX) :].split(".")
        if len(parts) < 4:
            raise PlanError("request id has the plan prefix but no authenticated plan")
        if not same_mac(_plan_mac(key, parts[0], parts[1]).encode(), parts[2].encode()):
            raise PlanError("the plan's MAC does not hold: forged, or made under another secret")
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
        patches = data.get("patches", [])
        if not isinstance(patches, list):
            raise PlanError("plan patches must be a list")
        scope = data.get("scope", "")
        if not isinstance(scope, str):
            raise PlanError("plan scope must be a string")
        return cls(images=tuple(ImagePlan.from_dict(p) for p in images),
                   patches=tuple(ImagePlan.from_dict(p) for p in patches), scope=scope)
