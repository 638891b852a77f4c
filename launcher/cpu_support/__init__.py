"""What a CPU-only host needs to run an unmodified SGLang worker.

The one piece is a stand-in for the ``sgl_kernel`` extension (see ``stub_site/sgl_kernel``),
whose CPU build is not on PyPI. It sits in a directory that is never on ``sys.path`` by itself;
:func:`kernel_stand_in_path` returns that directory only when the real package is missing, and
the launcher prepends it to ``PYTHONPATH`` of CPU workers alone.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

STUB_SITE = Path(__file__).resolve().parent / "stub_site"
# SGLang's CPU platform declared out of tree and without PyNccl, for tensor-parallel CPU workers (see the module in it).
PLATFORM_SITE = Path(__file__).resolve().parent / "platform_site"
PLATFORM_NAME = "revisit_cpu"


def thread_binds(cores: list[int], ranks: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for ``ranks`` tensor-parallel ranks over ``cores``: each rank its own
    contiguous share ("0-3|4-7"), or every rank all of them when there are fewer cores than ranks."""
    if ranks < 1 or not cores:
        raise ValueError(f"need at least one rank and one core, got {ranks} and {cores}")
    if len(cores) < ranks:
        share = ",".join(map(str, cores))
        return "|".join([share] * ranks)
    size = len(cores) // ranks
    parts = [cores[r * size : (r + 1) * size] for r in range(ranks)]
    return "|".join(",".join(map(str, part)) for part in parts)


def has_real_sgl_kernel() -> bool:
    """Whether an ``sgl_kernel`` other than the stand-in is importable here."""
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or spec.origin is None:
        return False
    return not Path(spec.origin).resolve().is_relative_to(STUB_SITE)


def kernel_stand_in_path() -> Path | None:
    """The directory to prepend to a CPU worker's ``PYTHONPATH``, or None if not needed."""
    return None if has_real_sgl_kernel() else STUB_SITE
