"""``revisit serve``: the gateway plus local SGLang workers, as one command.

Builds the bundled model when asked for it, starts the workers side by side, prints a
progress line while they load, runs the gateway, and stops every worker on the way out
(normal exit, Ctrl-C, or a worker that fails to start).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gateway.config import OPEN, GatewayConfig


def say(message: str) -> None:
    print(f"[revisit] {message}", flush=True)


def resolve_model(args: argparse.Namespace) -> tuple[Path, str]:
    """The model folder to serve and the model id clients will use."""
    if args.model != "bundled":
        path = Path(args.model).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise SystemExit(f"revisit: {path} is not a model folder (no config.json)")
        return path, args.served_model_name or path.name
    from bundled import DEFAULT_ARCH, DEFAULT_SIZE, build_model

    arch, size = args.arch or DEFAULT_ARCH, args.size or DEFAULT_SIZE
    path = build_model(arch, size, on_progress=say)
    return path, args.served_model_name or f"{arch.replace('_', '-')}-{size}"


async def _start_all(workers: list, timeout: float) -> None:
    started = time.monotonic()
    pending = {asyncio.create_task(w.wait_ready_async(timeout)): i for i, w in enumerate(workers)}
    ready = 0
    while pending:
        done, _ = await asyncio.wait(pending, timeout=10)
        for task in done:
            index = pending.pop(task)
            task.result()  # raises WorkerError with the log tail if the worker died
            ready += 1
            say(f"worker {index} ready at {workers[index].url} ({time.monotonic() - started:.0f} s)")
        if pending:
            say(f"waiting for {len(pending)} of {len(workers)} worker(s) to load the model "
                f"({time.monotonic() - started:.0f} s)")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


SECRET_VAR = "REVISIT_STORE_SECRET_FILE"


def _share_a_secret() -> None:
    """The gateway and its workers share a deployment secret (settings/secret.py): the one REVISIT_STORE_SECRET_FILE
    names, or this user's own, made once in ~/.cache/revisit/secret (0600), so that stored entries stay valid
    across runs. The workers inherit the variable."""
    if os.environ.get(SECRET_VAR):
        return
    from settings.secret import DataPlaneSecret

    path = Path.home() / ".cache" / "revisit" / "secret"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        DataPlaneSecret.create(path)
    os.environ[SECRET_VAR] = str(path)


def serve_embedded(args: argparse.Namespace, run_gateway: Callable[..., None]) -> int:
    from bundled.errors import BuildError
    from launcher import WorkerSpec, start_worker
    from launcher.errors import LauncherError

    if args.workers < 1:
        raise SystemExit("revisit: --workers must be at least 1")
    model_path, model_id = resolve_model(args)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="revisit-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    # SIGTERM (docker stop, systemd) must unwind like Ctrl-C so the workers, which run
    # in sessions of their own, are stopped rather than orphaned.
    signal.signal(signal.SIGTERM, _interrupt)
    _share_a_secret()
    say(f"starting {args.workers} SGLang worker(s) on {args.device} for {model_id} (logs in {log_dir})")
    started = time.monotonic()
    workers = []
    serving = False
    try:
        for i in range(args.workers):
            spec = WorkerSpec(
                model_path=model_path,
                port=args.worker_port + i,
                device=args.device,
                served_model_name=model_id,
                log_file=log_dir / f"worker-{i}.log",
            )
            workers.append(start_worker(spec))
        asyncio.run(_start_all(workers, args.ready_timeout))
        # The served folder is the model directory: processor settings, layer count and recompute profile come
        # from it, as REVISIT_MODEL_DIR would give them to `revisit gateway`.
        config = GatewayConfig.from_env(
            {**os.environ, "REVISIT_MODEL_DIR": str(model_path)},
            open_by_default=True,  # a laptop's gateway; listed keys (REVISIT_API_KEYS_FILE) turn keys mode on
            model=model_id,
            workers=tuple(w.url for w in workers),
        )
        if config.tenants.mode == OPEN:
            say("open mode: any API key is served (each its own cache namespace); for more than one user, list "
                "keys in REVISIT_API_KEYS_FILE (`revisit keys new NAMESPACE`)")
        elapsed = time.monotonic() - started

        def ready() -> None:
            nonlocal serving
            serving = True
            say(f"ready: http://{args.host}:{args.port}/v1 serves {model_id} "
                f"with {len(workers)} worker(s) (started in {elapsed:.0f} s); Ctrl-C stops")

        run_gateway(config, args.host, args.port, args.log_level, on_ready=ready, access_log=args.access_log)
        return 0
    except (LauncherError, BuildError) as exc:
        say(f"a worker failed to start: {exc}")
        return 1
    except KeyboardInterrupt:
        return 0 if serving else 130
    finally:
        if workers:
            say(f"stopping {len(workers)} worker(s)")
            for worker in workers:
                worker.stop()
