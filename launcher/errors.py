"""The exceptions the launcher raises; callers catch :class:`LauncherError` for all of them."""

from __future__ import annotations


class LauncherError(Exception):
    """Base of every launcher error."""


class SGLangVersionError(LauncherError):
    """The installed SGLang is not the version the engine extension was written against."""


class WorkerError(LauncherError):
    """A worker process failed to start, died, or did not become ready."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(f"{message}\n--- worker log (tail) ---\n{log_tail}" if log_tail else message)
        self.log_tail = log_tail


class WorkerExitedError(WorkerError):
    """The worker process exited before it became ready."""


class WorkerTimeoutError(WorkerError):
    """The worker did not answer /health in time."""
