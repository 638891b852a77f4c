"""Traces from logs that name images by hash: per request, an arrival time, the hashes of its images and maybe a
tenant and a prompt (what public VLM traces publish instead of the images themselves).

The CSV needs a time column (``timestamp``, ``time`` or ``arrival_time``: seconds, or ISO 8601 date-times) and an
image column (``image_hashes``, ``image_hash`` or ``hashes``: hashes separated by ``;``, ``|`` or spaces; empty
for a text-only request). Optional: ``tenant`` (or ``user``, ``user_id``) and ``prompt`` (or ``question``).

Each distinct hash becomes a distinct real image (a crop of one of scikit-image's photos or scanned pages, or a
frame of a clip), the same one wherever the hash repeats: the trace keeps the log's exact repeats and its timing.
What a hash cannot say, how alike two different images were, is not invented: imported traces have no
near-duplicates.
"""

from __future__ import annotations

import csv
import hashlib
import random
from datetime import datetime
from pathlib import Path

from PIL import Image

from replay.maker import TOKEN, ImageFolder, chat_messages
from replay.trace import TraceError, TraceRequest, write_trace

TIME_COLUMNS = ("timestamp", "time", "arrival_time")
IMAGE_COLUMNS = ("image_hashes", "image_hash", "hashes")
TENANT_COLUMNS = ("tenant", "user", "user_id")
PROMPT_COLUMNS = ("prompt", "question")


def _column(header: list[str], names: tuple[str, ...], path: Path, required: bool) -> str | None:
    found = next((name for name in names if name in header), None)
    if found is None and required:
        raise TraceError(f"{path}: no {' / '.join(names)} column (columns: {', '.join(header)})")
    return found


def _seconds(value: str, where: str) -> float:
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(value.strip().replace("Z", "+00:00")).timestamp()
    except ValueError as exc:
        raise TraceError(f"{where}: {value!r} is neither seconds nor an ISO 8601 time") from exc


def import_hashes(csv_path: Path, out_dir: Path, *, tokens: tuple[int, int] = (6, 9), seed: int = 0) -> Path:
    """Write out_dir/trace.jsonl and images/ from a CSV of arrival times and image hashes."""
    try:
        with csv_path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            header = list(reader.fieldnames or [])
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise TraceError(f"{csv_path}: cannot read: {exc}") from exc
    time_col = _column(header, TIME_COLUMNS, csv_path, True)
    image_col = _column(header, IMAGE_COLUMNS, csv_path, True)
    tenant_col = _column(header, TENANT_COLUMNS, csv_path, False)
    prompt_col = _column(header, PROMPT_COLUMNS, csv_path, False)
    assert time_col is not None and image_col is not None
    parsed = []
    for number, row in enumerate(rows, start=2):
        where = f"{csv_path}:{number}"
        hashes = [h for h in (row.get(image_col) or "").replace("|", " ").replace(";", " ").split() if h]
        parsed.append((_seconds(row.get(time_col) or "", where), hashes,
                       (row.get(tenant_col) if tenant_col else None) or "tenant-0",
                       (row.get(prompt_col) if prompt_col else None) or "What is in this image?"))
    if not parsed:
        raise TraceError(f"{csv_path}: no rows")
    parsed.sort(key=lambda row: row[0])
    start = parsed[0][0]
    images = ImageFolder(out_dir)
    pool = _Pool(tokens, seed)
    paths: dict[str, str] = {}
    requests = []
    for index, (at, hashes, tenant, prompt) in enumerate(parsed):
        for image_hash in hashes:
            if image_hash not in paths:
                paths[image_hash] = images.save(pool.next())
        content: list[dict] = [{"type": "image_url", "image_url": {"url": paths[h]}} for h in hashes]
        body = {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": prompt}]}]
                if hashes else [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0}
        if len(hashes) == 1:  # the maker's own layout, so that both kinds of trace read alike
            body["messages"] = chat_messages(paths[hashes[0]], prompt, None)
        requests.append(TraceRequest(index=index, t=at - start, tenant=tenant, body=body,
                                     meta={"family": "imported", "step": "imported"}))
    return write_trace(out_dir / "trace.jsonl", requests, name=csv_path.stem, made_by="revisit trace import",
                       source=str(csv_path), length=len(requests), images=len(paths))


class _Pool:
    """Distinct real images, one after another, each a crop of a photo or a scanned page at its own place."""

    def __init__(self, tokens: tuple[int, int], seed: int) -> None:
        from offline.near_duplicates.scans import photos, scan_for, skimage_image

        self.rows, self.cols = tokens
        self.rng = random.Random(f"import:{seed}")
        self.sources = [skimage_image(name) for name in photos()] + [scan_for(False).image]
        self.seen: set[bytes] = set()

    def next(self) -> Image.Image:
        width, height = self.cols * TOKEN, self.rows * TOKEN
        while True:
            source = self.rng.choice(self.sources)
            scale = self.rng.uniform(max(width / source.width, height / source.height, 0.3), 1.5)
            scaled = source.resize((max(width, round(source.width * scale)), max(height, round(source.height * scale))))
            x, y = self.rng.randint(0, scaled.width - width), self.rng.randint(0, scaled.height - height)
            image = scaled.crop((x, y, x + width, y + height)).convert("RGB")
            digest = hashlib.blake2b(image.tobytes(), digest_size=16).digest()
            if digest not in self.seen:
                self.seen.add(digest)
                return image
