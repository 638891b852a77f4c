"""A started worker process: readiness, log tail and shutdown of its whole process group."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from launcher.readiness import ProgressCallback, wait_ready, wait_ready_async
from launcher.spec import WorkerSpec

DEFAULT_STOP_GRACE_S = 15.0
LOG_TAIL_LINES = 60
_KILL_SETTLE_S = 5.0
SHARED_MEMORY = Path("/dev/shm")
# What SGLang's processes leave in shared memory when they are killed rather than exit (its load-snapshot slots,
# multiprocessing's named semaphores, its pid-stamped segments): removed by stop() and kill() when the worker had
# them open. Pid-stamped segments (sgl_shm_<kind>_<pid>_<rand>, SGLang's own naming: a request's multimodal inputs
# in passage between its processes, written and closed) go when their creator was one of the worker's processes.
LEFT_BEHIND = ("sglang_loads_", "sem.mp-", "sgl_shm_")
STAMPED = "sgl_shm_"


class WorkerProcess:
    """A running worker: the leader of its own process group, logging to ``log_file``.

    SGLang's server process starts its scheduler and detokenizer (and a multiprocessing resource
    tracker) in the same group; ``stop()`` ends all of them. Usable as a context manager that
    stops the worker on exit.
    """

    def __init__(self, spec: WorkerSpec, process: subprocess.Popen[bytes], log_file: Path, *,
                 key_folder: Path | None = None) -> None:
        self.spec = spec
        self.process = process
        self.log_file = log_file
        self.key_folder = key_folder  # the private folder of its API key's file (launch.key_off_the_command_line)
        self.started_at = time.time()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def url(self) -> str:
        return self.spec.url

    def exit_code(self) -> int | None:
        return self.process.poll()

    def is_running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout: float, on_progress: ProgressCallback | None = None) -> float:
        """Block until ``/health`` answers 200; see :func:`launcher.readiness.wait_ready`."""
        return wait_ready(self.url, timeout, on_progress, worker=self)

    async def wait_ready_async(self, timeout: float, on_progress: ProgressCallback | None = None) -> float:
        """Await ``/health`` answering 200; see :func:`launcher.readiness.wait_ready_async`."""
        return await wait_ready_async(self.url, timeout, on_progress, worker=self)

    def live_processes(self) -> list[int]:
        """Pids of the worker's process group that are still running (zombies excluded)."""
        return live_group_members(self.pid)

    def stop(self, grace: float = DEFAULT_STOP_GRACE_S) -> int:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds; returns the leader's
        exit code once no process of the group runs any more. Safe to call more than once."""
        pids = self.live_processes()
        held = shared_memory_of(pids) | stamped_by(pids)
        if self.is_running():
            _signal_group(self.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # Children can outlive the leader or ignore SIGTERM: clear the whole group.
        if self.live_processes():
            _signal_group(self.pid, signal.SIGKILL)
        return self._reap(held)

    def kill(self) -> int:
        """End the worker as a crash would (SIGKILL, no chance to clean up), then clear what it held in shared
        memory. The group is stopped first, so what it holds at that instant is known; stopped, it runs no
        further, so for its requests and its store writes this is a SIGKILL at the moment of the SIGSTOP."""
        _signal_group(self.pid, signal.SIGSTOP)
        pids = self.live_processes()
        held = shared_memory_of(pids) | stamped_by(pids)
        _signal_group(self.pid, signal.SIGKILL)
        return self._reap(held)

    def _reap(self, held: set[Path]) -> int:
        """Wait for the leader's exit code and the group's end; then remove what it left in shared memory."""
        code = self.process.wait()
        if self.key_folder is not None:
            shutil.rmtree(self.key_folder, ignore_errors=True)
        deadline = time.monotonic() + _KILL_SETTLE_S
        while self.live_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.live_processes():
            _remove_left_behind(held | orphaned_semaphores(self.started_at))
        return code

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _remove_left_behind(held: set[Path]) -> None:
    for path in held:
        if path.name.startswith(LEFT_BEHIND):
            path.unlink(missing_ok=True)


def stamped_by(pids: list[int]) -> set[Path]:
    """SGLang's pid-stamped segments (sgl_shm_<kind>_<pid>_<rand>) made by these processes."""
    wanted = {str(pid) for pid in pids}
    found = set()
    for path in SHARED_MEMORY.glob(f"{STAMPED}*"):
        parts = path.name.split("_")  # sgl, shm, the kind (perhaps several parts), pid, rand
        if len(parts) >= 5 and parts[-2] in wanted:
            found.add(path)
    return found


def orphaned_semaphores(since: float) -> set[Path]:
    """Python's named semaphores (``sem.mp-*``) made since ``since`` that no running process holds any more.

    A short-lived process SGLang spawns while it starts makes one and exits without unlinking it, so it is
    held by no worker process by the time the worker is stopped. A semaphore no process maps is no lock of
    anyone's any more: removing it frees its file and changes nothing for anybody."""
    made = set()
    for path in SHARED_MEMORY.glob("sem.mp-*"):
        try:
            if path.stat().st_ctime >= since:
                made.add(path)
        except OSError:
            continue
    if not made:
        return set()
    return made - shared_memory_of([int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()])


def shared_memory_of(pids: list[int]) -> set[Path]:
    """The files under /dev/shm these processes have open or mapped (read from /proc; what vanishes meanwhile is
    skipped)."""
    held: set[Path] = set()
    prefix = f"{SHARED_MEMORY}/"
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith(prefix) and not target.endswith("(deleted)"):
                held.add(Path(target))
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(prefix) and not fields[5].endswith("(deleted)"):
                held.add(Path(fields[5]))
    return held


def live_group_members(pgid: int) -> list[int]:
    """Running (not zombie) processes whose process group is ``pgid``, read from /proc.

    Zombies are left out on purpose: orphaned children are re-parented to PID 1, which does not
    reap them promptly in every container, yet they hold no resources.
    """
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        # The fields after the parenthesised command name: state, ppid, pgrp, ...
        state, _ppid, pgrp = stat.rpartition(")")[2].split()[:3]
        if int(pgrp) == pgid and state not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
