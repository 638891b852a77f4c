"""Traces made from real images on this machine: what users of a screenshot agent, a document assistant and a
video assistant send, with the repeats and near-repeats this gateway exists for.

Every request belongs to a session of one of four families:

- ``doc``: screenshots of a document being read: documentation pages (Debian's python3.11-doc and sqlite3-doc)
  rendered by headless Chromium where both are installed (renders cached in ``render_dir``), else scikit-image's
  scanned page.png and text.png stacked into a long document at screen scale: the first view, then scrolls down
  (by whole lines of tokens, now and then by a few pixels), an edited word (the user typed; a page is rendered
  again with one word of its HTML changed), a look back at an earlier view;
- ``video``: consecutive frames of a clip (the street camera and animations Debian's opencv-doc ships; a camera
  pan over a real photo where they are absent), a frame or two apart;
- ``photo``: a photo uploaded, then uploaded again as JPEG at another quality (the same picture, other bytes);
- ``form``: the project's reader panels being filled in, one field at a time.

Each request either takes its tenant's current session a step further or revisits an image the tenant sent before,
chosen by a Zipf law over how recently each was sent (``zipf``): the most recent most often, old ones now and
then. A revisit sometimes comes after other words than before (a new turn of the chat), so it is an exact hit at a
new position. Arrivals are a Poisson process of ``rate`` requests a second; tenants send in proportion to
``tenant_weights``. Images are written once each (a repeat names the same file); a seed gives the same trace.
"""

from __future__ import annotations

import hashlib
import io
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image

from replay.trace import TraceRequest, write_trace

if TYPE_CHECKING:
    from offline.near_duplicates.docs import Renderer

TOKEN = 28  # pixels per language-model token side (patch 14, merge 2)
FAMILIES = ("doc", "video", "photo", "form")
QUESTIONS = {
    "doc": ("What is this page about?", "Summarise the visible text.", "Which words are in the first line?",
            "Is there a heading on this screen?"),
    "video": ("What happens in this frame?", "Who is in the picture?", "Describe the scene."),
    "photo": ("What is in this photo?", "Describe the picture.", "What colours stand out?"),
    "form": ("What does the form say?", "Which field is empty?", "Read the first row."),
}
LEADS = ("Thanks. Next question.", "Another one about the same screen.", "Look again.")


@dataclass(frozen=True)
class TraceShape:
    """How big and how busy a made trace is."""

    requests: int = 500
    tenants: int = 3
    rate: float = 2.0  # requests a second
    zipf: float = 1.2  # exponent of the revisit law over recency rank
    revisit_share: float = 0.35  # of requests, revisits of an image sent before
    family_weights: tuple[float, ...] = (0.4, 0.25, 0.15, 0.2)  # FAMILIES
    grids: tuple[tuple[int, int], ...] = ((6, 9),)  # image token grids (rows, cols); each session takes one
    max_tokens: int = 4
    stream_share: float = 0.8
    seed: int = 0
    docs: bool = True  # rendered documentation pages for doc sessions, where Chromium and the docs are installed
    render_dir: Path = Path.home() / ".cache" / "revisit" / "renders"


Frame = Image.Image | tuple[Image.Image, str, dict]  # an image, or one with the format and options to save it in


@dataclass
class _Sent:
    path: str
    family: str
    session: str


@dataclass
class _Tenant:
    name: str
    sessions: dict[str, tuple[str, Iterator[Frame]]] = field(default_factory=dict)  # family -> (name, frames)
    sent: list[_Sent] = field(default_factory=list)  # most recent last
    counter: int = 0


class ImageFolder:
    """Writes each distinct image once under images/, named by a digest of its bytes."""

    def __init__(self, out_dir: Path) -> None:
        self.dir = out_dir / "images"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.count = 0

    def save(self, image: Image.Image, fmt: str = "PNG", **options) -> str:
        buffer = io.BytesIO()
        image.save(buffer, format=fmt, **options)
        data = buffer.getvalue()
        name = f"{hashlib.blake2b(data, digest_size=10).hexdigest()}.{'png' if fmt == 'PNG' else 'jpg'}"
        path = self.dir / name
        if not path.exists():
            path.write_bytes(data)
            self.count += 1
        return f"images/{name}"


def make_trace(out_dir: Path, shape: TraceShape = TraceShape(), *,
               progress: Callable[[int, int], None] | None = None) -> Path:
    """Write ``out_dir/trace.jsonl`` and its images; returns the trace's path."""
    rng = random.Random(f"trace:{shape.seed}")
    images = ImageFolder(out_dir)
    tenants = [_Tenant(name=f"tenant-{i}") for i in range(shape.tenants)]
    weights = [1.0 / (i + 1) for i in range(shape.tenants)]  # a few busy tenants, more quiet ones
    sources = _Sources(shape, rng)
    requests: list[TraceRequest] = []
    t = 0.0
    for index in range(shape.requests):
        t += rng.expovariate(shape.rate)
        tenant = rng.choices(tenants, weights)[0]
        if tenant.sent and rng.random() < shape.revisit_share:
            sent = _zipf_pick(tenant.sent, shape.zipf, rng)
            lead = rng.choice(LEADS) if rng.random() < 0.3 else None
            meta = {"family": sent.family, "session": sent.session, "step": "revisit"}
        else:
            family = rng.choices(FAMILIES, shape.family_weights)[0]
            current = tenant.sessions.get(family)
            frame = next(current[1], None) if current is not None and rng.random() >= 0.08 else None
            if frame is None:  # a new session: the first of this family, one ran out, or now and then anyway
                tenant.counter += 1
                current = (f"{family}-{tenant.counter}", sources.session(family))
                tenant.sessions[family] = current
                frame = next(current[1])
            assert current is not None
            session = current[0]
            image, fmt, options = frame if isinstance(frame, tuple) else (frame, "PNG", {})
            sent = _Sent(images.save(image, fmt, **options), family, session)
            tenant.sent.append(sent)
            lead = None
            meta = {"family": family, "session": session, "step": "new"}
        body: dict = {"messages": chat_messages(sent.path, rng.choice(QUESTIONS[sent.family]), lead),
                      "max_tokens": shape.max_tokens, "temperature": 0}
        if rng.random() < shape.stream_share:
            body["stream"] = True
        requests.append(TraceRequest(index=index, t=t, tenant=tenant.name, body=body, meta=meta))
        if progress is not None:
            progress(index + 1, shape.requests)
    return write_trace(out_dir / "trace.jsonl", requests, name=f"made-{shape.seed}", made_by="revisit trace make",
                       length=len(requests), images=images.count, tenants=shape.tenants, rate=shape.rate,
                       zipf=shape.zipf, grids=[list(grid) for grid in shape.grids], families=list(FAMILIES))


def chat_messages(path: str, question: str, lead: str | None) -> list[dict]:
    content: list[dict] = [{"type": "image_url", "image_url": {"url": path}}, {"type": "text", "text": question}]
    messages = [{"role": "user", "content": content}]
    if lead is not None:  # a later turn: the image comes after other words than the first time
        messages = [{"role": "user", "content": lead}, {"role": "assistant", "content": "Sure."}, *messages]
    return messages


def _zipf_pick(sent: list[_Sent], exponent: float, rng: random.Random) -> _Sent:
    ranks = range(1, len(sent) + 1)
    weights = [rank ** -exponent for rank in ranks]
    return sent[-rng.choices(list(ranks), weights)[0]]


class _Sources:
    """The real images sessions are made of, each session's sized to one of the trace's token grids (chosen at
    random when it starts, so the sizes mix through the trace and an image's repeats keep its size)."""

    def __init__(self, shape: TraceShape, rng: random.Random) -> None:
        from offline.near_duplicates.scans import photos, scan_for

        if not shape.grids:
            raise ValueError("a trace needs at least one image grid")
        self.grids = shape.grids
        self.rng = rng
        self.scan = scan_for(max(cols for _, cols in shape.grids) * TOKEN > scan_for(False).image.width)
        self.photos = photos()
        self.clips = _clips()
        self.sites: list[list[Path]] = []
        self.renderer: Renderer | None = None
        if shape.docs:
            self.sites, self.renderer = _doc_sites(shape.render_dir)

    def session(self, family: str) -> Iterator[Frame]:
        rows, cols = self.rng.choice(self.grids) if len(self.grids) > 1 else self.grids[0]
        frames = {"doc": self._doc, "video": self._video, "photo": self._photo, "form": self._form}[family]
        return frames(rows, cols)

    def _doc(self, rows: int, cols: int) -> Iterator[Frame]:
        if self.renderer is not None and self.sites:
            yield from self._rendered_doc(rows, cols)
        else:
            yield from self._scanned_doc(rows, cols)

    def _rendered_doc(self, rows: int, cols: int) -> Iterator[Frame]:
        from offline.near_duplicates.docs import edit_html

        assert self.renderer is not None
        pages = self.rng.choice(self.sites)
        html = self.renderer.html(self.rng.choice(pages))
        view_w, view_h = cols * TOKEN, rows * TOKEN
        width, height = max(RENDER_WIDTH, view_w), max(RENDER_HEIGHT, 2 * view_h)  # a window as wide as the view
        page = self.renderer.render(html, width, height)
        x = self.rng.randrange(0, max(1, (width - view_w) // TOKEN)) * TOKEN
        y = 0
        for _ in range(self.rng.randint(6, 14)):
            yield page.crop((x, y, x + view_w, y + view_h))
            action = self.rng.random()
            if action < 0.55:
                y = min(height - view_h, y + TOKEN * self.rng.randint(1, 3))
            elif action < 0.7:
                y = min(height - view_h, y + self.rng.randint(3, TOKEN - 3))
            elif (edited := edit_html(html, self.rng)) is not None:
                html = edited[0]
                page = self.renderer.render(html, width, height)

    def _scanned_doc(self, rows: int, cols: int) -> Iterator[Frame]:
        from offline.near_duplicates.pairs import EDIT_WORDS
        from offline.near_duplicates.scans import replace_word

        page = self.scan.image
        height, width = rows * TOKEN, cols * TOKEN
        x = self.rng.randrange(0, max(1, page.width - width) // TOKEN + 1) * TOKEN
        y = self.rng.randrange(0, max(1, (page.height - height) // 2))
        for _ in range(self.rng.randint(6, 14)):
            yield page.crop((x, y, x + width, y + height))
            action = self.rng.random()
            if action < 0.55:  # scroll down by whole token rows
                y = min(page.height - height, y + TOKEN * self.rng.randint(1, 3))
            elif action < 0.7:  # a small scroll that does not line up with the tokens
                y = min(page.height - height, y + self.rng.randint(3, TOKEN - 3))
            else:  # an edit of one word in view
                inside = [box for box in self.scan.words
                          if x <= box[0] and box[2] <= x + width and y + 2 <= box[1] and box[3] <= y + height - 2]
                if inside:
                    page = replace_word(page, self.rng.choice(inside), self.rng.choice(EDIT_WORDS))

    def _video(self, rows: int, cols: int) -> Iterator[Frame]:
        frames = list(self._clip_frames(rows, cols)) if self.clips else []
        yield from frames or self._pan_frames(rows, cols)  # a clip shorter than the start chosen: a pan instead

    def _clip_frames(self, rows: int, cols: int) -> Iterator[Frame]:
        import av

        clip = self.rng.choice(self.clips)
        start, stride, count = self.rng.randint(0, 120), self.rng.choice((1, 2, 3)), self.rng.randint(6, 14)
        wanted = set(range(start, start + stride * count, stride))
        with av.open(str(clip), "r") as container:
            for index, frame in enumerate(container.decode(video=0)):
                if index in wanted:
                    yield _fit(frame.to_image(), rows, cols)
                if index >= max(wanted):
                    break

    def _pan_frames(self, rows: int, cols: int) -> Iterator[Frame]:
        photo = _skimage(self.rng.choice(self.photos))
        scale = max(cols * TOKEN * 2 / photo.width, rows * TOKEN * 2 / photo.height, 1.0)
        photo = photo.resize((math.ceil(photo.width * scale), math.ceil(photo.height * scale)))
        x, y = self.rng.randint(0, photo.width // 4), self.rng.randint(0, photo.height // 4)
        for _ in range(self.rng.randint(6, 14)):
            yield photo.crop((x, y, x + cols * TOKEN, y + rows * TOKEN))
            x = min(photo.width - cols * TOKEN, x + self.rng.randint(2, 9))
            y = min(photo.height - rows * TOKEN, y + self.rng.randint(0, 4))

    def photo_upload(self, rows: int, cols: int) -> Frame:
        return _fit(_skimage(self.rng.choice(self.photos)), rows, cols)

    def _photo(self, rows: int, cols: int) -> Iterator[Frame]:
        picture = self.photo_upload(rows, cols)
        assert isinstance(picture, Image.Image)
        yield picture
        for quality in self.rng.sample((92, 85, 75, 60), self.rng.randint(1, 3)):
            yield picture, "JPEG", {"quality": quality}

    def _form(self, rows: int, cols: int) -> Iterator[Frame]:
        from bundled.reader.panels import changed, random_panel

        panel = random_panel(self.rng)
        for _ in range(self.rng.randint(4, 10)):
            yield _fit(panel.render(), rows, cols)
            if len(panel.keys) > 1:
                panel, _ = changed(panel, self.rng, 1)


def _fit(image: Image.Image, rows: int, cols: int) -> Image.Image:
    """The image scaled to cover rows x cols tokens and centre-cropped to exactly that."""
    image = image.convert("RGB")
    width, height = cols * TOKEN, rows * TOKEN
    scale = max(width / image.width, height / image.height)
    scaled = image.resize((max(width, round(image.width * scale)), max(height, round(image.height * scale))),
                          Image.Resampling.BICUBIC)
    left, top = (scaled.width - width) // 2, (scaled.height - height) // 2
    return scaled.crop((left, top, left + width, top + height))


RENDER_WIDTH, RENDER_HEIGHT = 812, 1680  # a browser window, as offline.near_duplicates renders pages


def _doc_sites(render_dir: Path) -> tuple[list[list[Path]], Renderer | None]:
    """The documentation sites' pages and a renderer, or nothing where Chromium or the docs are missing."""
    from offline.near_duplicates.docs import DOC_SITES, Renderer, find_chromium, site_pages

    chromium = find_chromium()
    sites = [pages for _, root, globs in DOC_SITES if root.is_dir() and len(pages := site_pages(root, globs)) >= 4]
    if chromium is None or not sites:
        return [], None
    render_dir.mkdir(parents=True, exist_ok=True)
    return sites, Renderer(chromium, render_dir)


def _skimage(name: str) -> Image.Image:
    from offline.near_duplicates.scans import skimage_image

    return skimage_image(name)


def _clips() -> list[Path]:
    from offline.near_duplicates.video import CLIPS, OPENCV_DATA

    return [OPENCV_DATA / name for name in CLIPS if (OPENCV_DATA / name).exists()]
