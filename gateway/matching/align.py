"""The fine stage: align a new image's tokens with a cached image's, and say how each token changed.

Alignment first looks for a global shift of whole tokens (a page scrolled by some rows, a panned frame, a crop
that kept the token boundaries) from the token digests: every digest that occurs exactly once in both images votes
for the displacement between its two positions; the displacement with the most votes wins if it has enough of them
and more than no shift at all. New token (r, c) is then compared with cached token (r - dy, c - dx).

Each new token is then

    same      its digest equals the aligned cached token's: the model sees the same pixels there
    similar   not the same, but the cosine of the two descriptors is at least ``patch_threshold``, no cell of
              its shades moved by more than ``max_shade_change`` grey levels (so a glyph edited in one corner of
              a token, which a cosine over the whole token barely sees, is changed, while re-encoding noise is not)
              and its mean colour (chroma) moved no more than that either (a swatch redrawn in another colour of
              the same grey level: orange to pink moves no shade by more than 14 levels)
    changed   anything else, including tokens with no cached token at their aligned position (scrolled in)

and the image's similarity is the mean cosine over the aligned tokens, leaving out positions that are blank in
both images (a blank margin is equal in unrelated pages and says nothing about whether they are the same page).
Tokens with no aligned token (a page scrolled by a fifth of its height brings a fifth in new) are not part of the
similarity: they are changed, and how many changed is the planner's guard's to judge. Nor are changed tokens whose
content is known to have moved out of reach (``out_of_reach``: a region of a video frame whose motion was found but
is not planned, gateway/matching/moved.py): their content is elsewhere, not different, and they are recomputed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from gateway.matching.features import TokenFeatures, chroma_change, shade_change

SAME, SIMILAR, CHANGED = 0, 1, 2
CHANGE_CODES = "=~x"  # the change map's wire form: one character per token (plan.ImagePlan.change_map)


@dataclass(frozen=True, eq=False)
class Alignment:
    """How a new image lines up with one cached image (its alias)."""

    shift: tuple[int, int]  # (dy, dx): new token (r, c) shows alias token (r - dy, c - dx)
    alias_index: np.ndarray  # (n,) int64: the alias token aligned with each new token, -1 where there is none
    cosine: np.ndarray  # (n,) float32; 0 where there is no aligned token
    changes: np.ndarray  # (n,) uint8: SAME, SIMILAR or CHANGED
    similarity: float  # the image-level score (see the module docstring)
    # Pixels the content moved beyond the shift (dy, dx), when it moved by part of a token (gateway/matching/moved.py):
    # the new image's features were then taken with its content moved back by this much.
    offset: tuple[int, int] = (0, 0)

    @property
    def change_map(self) -> str:
        return "".join(CHANGE_CODES[c] for c in self.changes.tolist())

    def count(self, kind: int) -> int:
        return int((self.changes == kind).sum())

    @property
    def changed_share(self) -> float:
        """The share of the new image's tokens that changed (what the planner's guard judges)."""
        return float((self.changes == CHANGED).mean()) if len(self.changes) else 0.0


def moved_by(alignment: Alignment, offset: tuple[int, int]) -> Alignment:
    """An alignment of features taken with the content moved back by ``offset`` pixels: no token is the same (the
    model sees other pixels there), those that were are similar."""
    changes = alignment.changes.copy()
    changes[changes == SAME] = SIMILAR
    return replace(alignment, changes=changes, offset=offset)


def reported(similarity: float) -> float:
    """A similarity as plans and headers report it: four places, rounded down (a near-duplicate never reads as 1)."""
    return math.floor(similarity * 1e4) / 1e4


def find_shift(new: TokenFeatures, alias: TokenFeatures, *, min_votes: int = 4, min_share: float = 0.05) -> \
        tuple[int, int]:
    """The whole-token displacement most of the tokens that are unique in both images agree on; (0, 0) when none
    has at least max(min_votes, min_share of those tokens) votes and more votes than (0, 0)."""
    new_unique, new_pos = _unique_positions(new.digests)
    alias_unique, alias_pos = _unique_positions(alias.digests)
    common, in_new, in_alias = np.intersect1d(new_unique, alias_unique, assume_unique=True, return_indices=True)
    if len(common) == 0:
        return (0, 0)
    new_rc = np.divmod(new_pos[in_new], new.grid[1])
    alias_rc = np.divmod(alias_pos[in_alias], alias.grid[1])
    dy, dx = new_rc[0] - alias_rc[0], new_rc[1] - alias_rc[1]
    span = alias.grid[1] + new.grid[1]
    codes = (dy + alias.grid[0]) * span + (dx + alias.grid[1])  # one integer per displacement
    values, votes = np.unique(codes, return_counts=True)
    best = int(np.argmax(votes))
    zero_code = alias.grid[0] * span + alias.grid[1]
    zero_votes = int(votes[values == zero_code].sum())
    if votes[best] < max(min_votes, min_share * len(common)) or votes[best] <= zero_votes:
        return (0, 0)
    row, col = divmod(int(values[best]), span)
    return (row - alias.grid[0], col - alias.grid[1])


def align(new: TokenFeatures, alias: TokenFeatures, *, shift: tuple[int, int], patch_threshold: float,
          max_shade_change: int, blank_entropy: float, out_of_reach: np.ndarray | None = None) -> Alignment:
    """Compare new with alias under the given shift (see the module docstring); ``out_of_reach``: (n,) bool, the new
    tokens whose content moved where it is not lined up again, left out of the similarity where they changed."""
    rows, cols = new.grid
    r, c = np.divmod(np.arange(rows * cols), cols)
    ar, ac = r - shift[0], c - shift[1]
    inside = (ar >= 0) & (ar < alias.grid[0]) & (ac >= 0) & (ac < alias.grid[1])
    alias_index = np.where(inside, ar * alias.grid[1] + ac, -1)
    aligned = alias_index[inside]
    cosine = np.zeros(rows * cols, np.float32)
    cosine[inside] = np.einsum("nd,nd->n", new.vectors[inside].astype(np.float32),
                               alias.vectors[aligned].astype(np.float32))
    same = np.zeros(rows * cols, bool)
    same[inside] = new.digests[inside] == alias.digests[aligned]
    cosine[same] = 1.0
    changes = np.full(rows * cols, CHANGED, np.uint8)
    steady = np.zeros(rows * cols, bool)
    steady[inside] = (shade_change(new.shades[inside], alias.shades[aligned]) <= max_shade_change) & \
        (chroma_change(new.chroma[inside], alias.chroma[aligned]) <= max_shade_change)
    changes[steady & (cosine >= patch_threshold)] = SIMILAR
    changes[same] = SAME
    alias_entropy = np.zeros(rows * cols, np.float32)
    alias_entropy[inside] = alias.entropy[aligned]
    informative = inside & ((new.entropy.astype(np.float32) > blank_entropy) | (alias_entropy > blank_entropy))
    if out_of_reach is not None:
        informative &= ~(out_of_reach & (changes == CHANGED))
    scored = informative if informative.any() else inside
    similarity = float(cosine[scored].mean()) if scored.any() else 0.0
    return Alignment(shift=shift, alias_index=alias_index, cosine=cosine, changes=changes, similarity=similarity)


def _unique_positions(digests: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The digests that occur once, sorted, and the index where each occurs."""
    values, first, counts = np.unique(digests, return_index=True, return_counts=True)
    once = counts == 1
    return values[once], first[once]
