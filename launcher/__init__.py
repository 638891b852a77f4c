"""Start, watch and stop unmodified SGLang workers with the engine extension registered.

Runs outside the workers: in ``revisit serve`` (the embedded default), in the container entry point
(``python -m launcher.worker``), in the tests and the benches. It imports neither torch nor SGLang.

- :mod:`launcher.spec`: ``WorkerSpec``, what one worker should be.
- :mod:`launcher.launch`: ``build_launch`` (argv and environment) and ``start_worker``.
- :mod:`launcher.process`: ``WorkerProcess``, a started worker's process group, log tail and shutdown.
- :mod:`launcher.readiness`: waiting for ``/health``, sync and async.
- :mod:`launcher.worker`: the foreground command compose runs.
- :mod:`launcher.cpu_support`: the ``sgl_kernel`` stand-in a CPU-only host needs.
- :mod:`launcher.config`, :mod:`launcher.errors`: its settings and its exception tree.
"""

from launcher.errors import LauncherError, SGLangVersionError, WorkerError, WorkerExitedError, WorkerTimeoutError
from launcher.launch import (
    CPU_MAX_TOTAL_TOKENS,
    SGLANG_VERSION,
    LaunchPlan,
    build_launch,
    check_sglang_version,
    resolve_dtype,
    start_worker,
    stop_worker,
    verify_sglang_version,
)
from launcher.process import WorkerProcess, live_group_members
from launcher.readiness import wait_ready, wait_ready_async
from launcher.spec import Device, WorkerSpec

__all__ = [
    "CPU_MAX_TOTAL_TOKENS", "SGLANG_VERSION", "Device", "LaunchPlan", "LauncherError", "SGLangVersionError",
    "WorkerError", "WorkerExitedError", "WorkerProcess", "WorkerSpec", "WorkerTimeoutError", "build_launch",
    "check_sglang_version", "live_group_members", "resolve_dtype", "start_worker", "stop_worker",
    "verify_sglang_version", "wait_ready", "wait_ready_async",
]
