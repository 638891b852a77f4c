"""Start, watch and stop unmodified SGLang workers (``python -m sglang.launch_server``).

:func:`build_launch` turns a :class:`WorkerSpec` into the argv and environment of one worker;
:func:`start_worker` runs it in its own process group with output in a log file; the returned
:class:`WorkerProcess` waits for ``/health`` (sync or async) and stops the whole group.

Every worker gets the worker site first on ``PYTHONPATH`` (``engine_ext.WORKER_SITE``): its ``sitecustomize``
replaces SGLang's video decoder (torchcodec, else decord) with PyAV in each of the worker's processes, the
decoder and the reading of a video the gateway uses (engine_ext/video_decoder.py).

CPU workers get what SGLang needs to run without a GPU: ``SGLANG_USE_CPU_ENGINE=1``, the
``sgl_kernel`` stand-in on ``PYTHONPATH`` (only where no real ``sgl_kernel`` is installed),
``--attention-backend torch_native``, a bounded KV pool, and one OpenMP thread per available
core (``REVISIT_CPU_THREADS`` overrides). SGLang does not pin threads on CPUs without AMX, so a
CPU worker uses that many intra-op threads in its model process; on a 2-core host that is 2,
and image preprocessing in SGLang's tokenizer process shares the same cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

import engine_ext
from engine_ext.models import PACKAGE as MODEL_PACKAGE
from launcher.config import LauncherConfig
from launcher.cpu_support import PLATFORM_NAME, PLATFORM_SITE, kernel_stand_in_path, thread_binds
from launcher.errors import SGLangVersionError
from launcher.process import DEFAULT_STOP_GRACE_S, WorkerProcess
from launcher.spec import WorkerSpec
from plan.checkpoint import image_max_pixels, weights_dtype
from settings.folders import FILE_MODE, private_folder
from settings.redis_auth import read_password
from settings.secret import DataPlaneSecret, worker_api_key

SGLANG_VERSION = "0.5.23"

# On CPU the KV pool is the smaller of this many tokens and what mem_fraction_static of the free
# RAM holds; without a token cap SGLang's CPU memory probe would size it from most of the RAM.
CPU_MAX_TOTAL_TOKENS = 65536
CPU_MEM_FRACTION_STATIC = 0.1
CPU_WATCHDOG_TIMEOUT_S = 3600


class LaunchPlan(NamedTuple):
    """The command line and complete environment of one worker."""

    argv: list[str]
    env: dict[str, str]


def installed_sglang_version() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def verify_sglang_version(found: str | None) -> str:
    """Return ``found`` if it is ``SGLANG_VERSION``; SGLangVersionError says how to fix it."""
    if found != SGLANG_VERSION:
        raise SGLangVersionError(
            f"engine_ext needs sglang=={SGLANG_VERSION}, found {found or 'no sglang'}; "
            f"install it with: pip install --no-deps sglang=={SGLANG_VERSION} "
            "(and requirements/sglang-cpu.txt on CPU hosts)"
        )
    return found


def check_sglang_version() -> str:
    """The installed SGLang version; SGLangVersionError unless it is ``SGLANG_VERSION``."""
    return verify_sglang_version(installed_sglang_version())


def resolve_dtype(spec: WorkerSpec) -> str:
    """``spec.dtype``, with "auto" replaced by the checkpoint's dtype: SGLang's own "auto" serves
    float32 checkpoints in float16, which loses precision and is slow on CPUs."""
    if spec.dtype != "auto":
        return spec.dtype
    return weights_dtype(spec.model_path) or "auto"


def _prepend_path(entry: Path, current: str | None) -> str:
    return os.pathsep.join([str(entry), *([current] if current else [])])


def shown(argv: list[str]) -> list[str]:
    """``argv`` as logs may show it: the worker's API key left out."""
    return [("***" if previous == "--api-key" else arg) for previous, arg in zip(["", *argv], argv, strict=False)]


def tensor_parallel_size(args: tuple[str, ...] | list[str]) -> int:
    """The ``--tp-size`` (``--tensor-parallel-size``) among SGLang arguments, 1 if absent."""
    names = ("--tp-size", "--tensor-parallel-size", "--tp")
    for at, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name in names:
            return int(value or args[at + 1])
    return 1


def build_launch(spec: WorkerSpec, base_env: Mapping[str, str] | None = None) -> LaunchPlan:
    """The argv and full environment that start ``spec`` (nothing is started)."""
    config = LauncherConfig.from_env(base_env)
    env = dict(os.environ if base_env is None else base_env)
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(spec.model_path),
        "--host", spec.host,
        "--port", str(spec.port),
        "--device", spec.device,
        "--dtype", resolve_dtype(spec),
        "--random-seed", str(spec.random_seed),
        "--enable-cache-report",
        # The engine extension counts what it executed on the worker's /metrics (engine_ext/executor/events.py).
        "--enable-metrics",
    ]  # fmt: skip
    if spec.served_model_name:
        argv += ["--served-model-name", spec.served_model_name]
    env |= {
        "SGLANG_EXTERNAL_MODEL_PACKAGE": MODEL_PACKAGE,
        "HF_HUB_OFFLINE": "1",  # nothing is downloaded at run time
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    # engine_ext must be importable by the worker even when the project is not installed. The worker site comes
    # first: its sitecustomize makes every worker process decode videos with PyAV (engine_ext/video_decoder.py).
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(engine_ext.WORKER_SITE), env.get("PYTHONPATH"), str(Path(engine_ext.__file__).parent.parent))
        if p
    )
    # SGLang 0.5.23 resizes images by the checkpoint's processor config; this variable only bounds
    # its own resize paths (video frames). Keeping both equal keeps every path on one bound.
    max_pixels = image_max_pixels(spec.model_path)
    if max_pixels:
        env["SGLANG_IMAGE_MAX_PIXELS"] = str(max_pixels)
    if spec.device == "cpu":
        threads = str(spec.cpu_threads or config.cpu_threads)
        argv += [
            "--attention-backend", "torch_native",
            "--mem-fraction-static", str(CPU_MEM_FRACTION_STATIC),
            "--max-total-tokens", str(spec.max_total_tokens or CPU_MAX_TOTAL_TOKENS),
            # Without it the idle scheduler polls in a loop and keeps one core at 100%.
            "--sleep-on-idle",
            # One CPU forward of a large image can take minutes (the real-size vision tower alone takes 50 s
            # for 1,024 tokens); SGLang's default 300 s watchdog would kill the worker mid-prefill.
            "--watchdog-timeout", str(CPU_WATCHDOG_TIMEOUT_S),
        ]  # fmt: skip
        env |= {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        stand_in = kernel_stand_in_path()
        if stand_in is not None:
            env["PYTHONPATH"] = _prepend_path(stand_in, env["PYTHONPATH"])
        ranks = tensor_parallel_size(spec.extra_args)
        if ranks > 1:
            # SGLang's supported way to run tensor-parallel ranks on CPUs: its CPU platform as an out-of-tree plugin
            # without PyNccl (launcher/cpu_support/platform_site), and each rank's threads bound to its own cores.
            cores = sorted(os.sched_getaffinity(0))[: int(threads)] if hasattr(os, "sched_getaffinity") else list(
                range(int(threads)))
            per_rank = str(max(1, len(cores) // ranks))
            env |= {"SGLANG_PLATFORM": PLATFORM_NAME, "SGLANG_CPU_OMP_THREADS_BIND": thread_binds(cores, ranks),
                    "OMP_NUM_THREADS": per_rank, "MKL_NUM_THREADS": per_rank}
            env["PYTHONPATH"] = _prepend_path(PLATFORM_SITE, env["PYTHONPATH"])
    else:
        env.pop("SGLANG_USE_CPU_ENGINE", None)  # inherited from a CPU host's environment
        if spec.max_total_tokens:
            argv += ["--max-total-tokens", str(spec.max_total_tokens)]
    argv += list(spec.extra_args)
    env |= spec.env
    # With a deployment secret, the worker serves only whoever holds it (the gateways): SGLang's API key, derived
    # from the secret (settings/secret.py). /health and /metrics stay open, as SGLang keeps them.
    api_key = worker_api_key(DataPlaneSecret.read(Path(env["REVISIT_STORE_SECRET_FILE"])) if
                             env.get("REVISIT_STORE_SECRET_FILE") else DataPlaneSecret())
    if api_key is not None:
        argv += ["--api-key", api_key]
    # The outcomes' server password (settings/redis_auth.py), read now: a worker whose file is missing or unusable
    # does not start, rather than fail to leave every outcome.
    if env.get("REVISIT_STORE_OUTCOMES_PASSWORD_FILE"):
        read_password(Path(env["REVISIT_STORE_OUTCOMES_PASSWORD_FILE"]))
    return LaunchPlan(argv=argv, env=env)


KEY_FILE_NAME = "sglang-api-key.yaml"


def key_off_the_command_line(argv: list[str], folder: Path) -> list[str]:
    """``argv`` with SGLang's ``--api-key KEY`` replaced by ``--config FILE``: a YAML file in ``folder`` (made
    private: settings/folders.py) holding the key alone, mode 0600. A command line is readable by every user of the
    host (``ps``, /proc/PID/cmdline), the file only by this one; SGLang reads it once, as it starts. A command line
    with a ``--config`` of its own (SGLang takes one) is returned as it is."""
    if "--api-key" not in argv or "--config" in argv:
        return argv
    at = argv.index("--api-key")
    private_folder(folder, what="the worker's key folder")
    path = folder / KEY_FILE_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    with open(fd, "w", closefd=True) as file:
        file.write(f"api-key: {json.dumps(argv[at + 1])}\n")  # a JSON string is a YAML one
    return [*argv[:at], "--config", str(path), *argv[at + 2 :]]


def start_worker(spec: WorkerSpec) -> WorkerProcess:
    """Start ``spec`` in a new process group and return at once (see ``WorkerProcess.wait_ready``).

    Raises SGLangVersionError before starting anything if the installed SGLang is not
    ``SGLANG_VERSION``. The caller owns the returned worker and must ``stop()`` it.
    """
    check_sglang_version()
    argv, env = build_launch(spec)
    key_folder = Path(tempfile.mkdtemp(prefix=f"revisit-worker-{spec.port}-"))  # removed when the worker stops
    argv = key_off_the_command_line(argv, key_folder)
    if spec.log_file is not None:
        log_file = spec.log_file
        log_file.parent.mkdir(parents=True, exist_ok=True)
    else:
        fd, name = tempfile.mkstemp(prefix=f"sglang-worker-{spec.port}-", suffix=".log")
        os.close(fd)
        log_file = Path(name)
    with open(log_file, "wb") as log:
        log.write(f"$ {' '.join(shown(argv))}\n".encode())
        log.flush()
        process = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return WorkerProcess(spec, process, log_file, key_folder=key_folder)


def stop_worker(worker: WorkerProcess, grace: float = DEFAULT_STOP_GRACE_S) -> int:
    """``worker.stop(grace)``: SIGTERM the group, SIGKILL after ``grace`` s; the exit code."""
    return worker.stop(grace)

