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


def has_real_sgl_kernel() -> bool:
    """Whether an ``sgl_kernel`` other than the stand-in is importable here."""
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or spec.origin is None:
        return False
    return not Path(spec.origin).resolve().is_relative_to(STUB_SITE)


def kernel_stand_in_path() -> Path | None:
    """The directory to prepend to a CPU worker's ``PYTHONPATH``, or None if not needed."""
    return None if has_real_sgl_kernel() else STUB_SITE
