"""What one SGLang worker should be: :class:`WorkerSpec`, a frozen value passed to the launcher."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Device = Literal["cpu", "cuda"]
DEVICES: tuple[Device, ...] = ("cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """One SGLang worker. ``extra_args`` go last on SGLang's command line, so they override the
    launcher's defaults; ``env`` is applied last to its environment."""

    model_path: Path
    host: str = "127.0.0.1"
    port: int = 30000
    device: Device = "cpu"
    served_model_name: str | None = None  # None: SGLang names the model after model_path
    dtype: str = "auto"  # "auto": the checkpoint's dtype (see launcher.resolve_dtype)
    extra_args: tuple[str, ...] = ()
    log_file: Path | None = None  # None: a new file under the temp directory
    cpu_threads: int | None = None  # None: REVISIT_CPU_THREADS, else all available cores
    max_total_tokens: int | None = None  # None: launcher.CPU_MAX_TOTAL_TOKENS on CPU, SGLang's on GPU
    random_seed: int = 0
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")

    @property
    def url(self) -> str:
        """Where clients on this host reach the worker."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"
