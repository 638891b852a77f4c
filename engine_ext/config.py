"""engine_ext settings read from the environment, in one place, all prefixed ``REVISIT_``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_CACHE_DIR = "REVISIT_CACHE_DIR"
ENV_CPU_THREADS = "REVISIT_CPU_THREADS"


def default_model_cache_dir() -> Path:
    return Path.home() / ".cache" / "revisit" / "models"


def default_cpu_threads() -> int:
    """All cores this process may use: SGLang's CPU worker runs one model process (tp=1), so
    one intra-op thread per core is the best it can do. A 2-core box gets 2."""
    return max(1, len(os.sched_getaffinity(0)))


@dataclass(frozen=True, kw_only=True)
class EngineExtConfig:
    """Where bundled models are cached and how many CPU threads a CPU worker uses."""

    model_cache_dir: Path
    cpu_threads: int

    def __post_init__(self) -> None:
        if self.cpu_threads < 1:
            raise ValueError(f"{ENV_CPU_THREADS} must be >= 1, got {self.cpu_threads}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EngineExtConfig:
        """Read ``REVISIT_CACHE_DIR`` (the bundled-model cache, default ~/.cache/revisit/models)
        and ``REVISIT_CPU_THREADS`` (default: the cores available); a bad value raises."""
        env = os.environ if environ is None else environ
        cache_dir = env.get(ENV_CACHE_DIR)
        threads = env.get(ENV_CPU_THREADS)
        try:
            cpu_threads = int(threads) if threads else default_cpu_threads()
        except ValueError:
            raise ValueError(f"{ENV_CPU_THREADS} must be an integer, got {threads!r}") from None
        return cls(
            model_cache_dir=Path(cache_dir).expanduser() if cache_dir else default_model_cache_dir(),
            cpu_threads=cpu_threads,
        )
