"""The launcher's settings: how many CPU threads a CPU worker uses (``REVISIT_CPU_THREADS``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from settings import PREFIX, EnvReader

ENV_CPU_THREADS = PREFIX + "CPU_THREADS"


def default_cpu_threads() -> int:
    """All cores this process may use: SGLang's CPU worker runs one model process (tp=1), so
    one intra-op thread per core is the best it can do. A 2-core box gets 2."""
    return max(1, len(os.sched_getaffinity(0)))


class LauncherConfigError(ValueError):
    """A launcher setting has a bad value."""


@dataclass(frozen=True, kw_only=True)
class LauncherConfig:
    cpu_threads: int

    def __post_init__(self) -> None:
        if self.cpu_threads < 1:
            raise LauncherConfigError(f"{ENV_CPU_THREADS} must be >= 1, got {self.cpu_threads}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LauncherConfig:
        """``REVISIT_CPU_THREADS`` (default: the cores available); a bad value raises LauncherConfigError."""
        env = EnvReader(environ, error=LauncherConfigError)
        return cls(cpu_threads=env.integer(ENV_CPU_THREADS) or default_cpu_threads())
