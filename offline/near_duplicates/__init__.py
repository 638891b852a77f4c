"""A labelled set of image pairs for measuring approximate image matching: A is the cached image, B the new request's.

Matching decides whether a new image may reuse a cached image's KV cache. Measuring a matcher needs pairs whose
answer is known: near-duplicates that should match (an edited word, a scrolled page, a filled-in form, the next video
frame, a re-encoded or cropped photo) and look-alikes that must never match (different pages of one site, different
panels of one style), each with which of B's tokens no longer show what A showed. Every pair is built here from real
images that are installed, so nothing is downloaded and a seed gives the same set.

Token grid: every image is cropped (or first scaled up) to sides that are multiples of 28 pixels, the size of one
language-model token (patch 14, spatial merge 2), with 4 to about 4,500 tokens, so nothing downstream resizes it and
token (r, c) is pixels [28r, 28r + 28) x [28c, 28c + 28). Default pairs have about 300 to 1,300 tokens;
``large=True`` builds a few of each family at about 4,000 tokens, for figures at that size.

Labels (:class:`Pair`): ``near_duplicate`` is True where B should match A, False where it must never match, None where
there is no verdict (frames far apart). ``changed`` marks B's tokens that do not show A's token at the aligned
position; ``shift`` (dy, dx) in whole tokens says which position is aligned (B's token (r, c) shows A's token
(r - dy, c - dx)). For lossless edits (doc_edit, form_fill, doc_scroll_whole) a token is changed if any pixel differs
from the aligned one by more than 24 of 255 in any channel, or if the aligned token lies outside A. Video frames are
lossy and noisy, so there a token is changed if its mean absolute difference exceeds 12. Re-encoded, brightened and
cropped photos change nothing that matters: all False. Partial-token scrolls have no whole-token alignment
(``shift`` and ``changed`` None) but show the same page, so they are labelled True; whether reuse pays for them is
the benchmark's to measure. Unrelated pairs have no correspondence (``shift`` and ``changed`` None). ``motion``
(dy, dx) says in pixels how far B's content moved where a pair was made by moving it by any number of pixels (a
partial scroll, a synthetic pan); ``Pair.true_motion()`` adds the whole-token families' shifts (``motion_px`` in
labels.json).

Sources, all offline:

- scikit-image's bundled data: photos, and the scans page.png (printed text) and text.png (handwriting), scaled
  2x (4x when large) and stacked into one tall "document" that scrolls; an edit paints over one printed word's box
  (found as a run of ink in page.png) with its background and draws another word with Pillow's default font;
- the project's own panels (:mod:`bundled.reader.panels`), laid out on larger grids: forms and tables, where one
  field is one or two cells, so an edit changes only those tokens;
- optional, with ``render_dir``: documentation pages (Debian's python3.11-doc and sqlite3-doc) rendered by headless
  Chromium, edited by changing one word of the HTML and rendering again; renders are cached in ``render_dir``;
- video: the clips that Debian's opencv-doc ships (/usr/share/doc/opencv-doc/examples/data: vtest.avi, a static
  street camera; Megamind.avi, an animation; tree.avi), decoded by Debian's ffmpeg. Where either is missing, the
  video families are synthetic: a camera pan over a large real photo (consecutive frames a few pixels apart, not
  token-aligned; distant frames far apart), and their names say so ("video-pan/...").

Missing optional sources are skipped and said so in ``notes`` (and the log).

Modules:

- :mod:`~offline.near_duplicates.pairs`: :class:`Pair`, the families, the token grid and the change rules;
- :mod:`~offline.near_duplicates.scans`: scikit-image's photos and scanned pages;
- :mod:`~offline.near_duplicates.panels`: the reader panels, forms and tables;
- :mod:`~offline.near_duplicates.docs`: documentation pages rendered by Chromium;
- :mod:`~offline.near_duplicates.video`: video clips, and the synthetic-pan fallback;
- :mod:`~offline.near_duplicates.unrelated`: unrelated pairs across sources;
- :mod:`~offline.near_duplicates.build`: :func:`build_pairs`, :func:`summary` and :func:`write`;
- ``__main__``: the command line below.

    python -m offline.near_duplicates --out DIR [--render-dir DIR] [--large] [--seed N] [--per-family N]
"""

from offline.near_duplicates.build import build_pairs, summary, write
from offline.near_duplicates.docs import edit_html as edit_html
from offline.near_duplicates.pairs import (
    DEFAULT_TOKENS,
    EXACT_THRESHOLD,
    FAMILIES,
    LARGE_TOKENS,
    LOSSLESS_FAMILIES,
    MAX_TOKENS,
    TOKEN,
    VIDEO_THRESHOLD,
    Pair,
    changed_exact,
    changed_video,
    grid,
)
from offline.near_duplicates.video import find_clips as find_clips
from offline.near_duplicates.video import video_pairs as video_pairs

__all__ = [
    "DEFAULT_TOKENS", "EXACT_THRESHOLD", "FAMILIES", "LARGE_TOKENS", "LOSSLESS_FAMILIES", "MAX_TOKENS", "TOKEN",
    "VIDEO_THRESHOLD", "Pair", "build_pairs", "changed_exact", "changed_video", "grid", "summary", "write",
]
