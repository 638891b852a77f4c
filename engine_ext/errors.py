"""The exceptions engine_ext raises; callers catch :class:`EngineExtError` for all of them."""

from __future__ import annotations


class EngineExtError(Exception):
    """Base of every engine_ext error."""


class BuildError(EngineExtError):
    """A bundled model could not be built into the cache."""


class SGLangVersionError(EngineExtError):
    """The installed SGLang is not the version engine_ext was written against."""


class WorkerError(EngineExtError):
    """A worker process failed to start, died, or did not become ready."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(f"{message}\n--- worker log (tail) ---\n{log_tail}" if log_tail else message)
        self.log_tail = log_tail


class WorkerExitedError(WorkerError):
    """The worker process exited before it became ready."""


class WorkerTimeoutError(WorkerError):
    """The worker did not answer /health in time."""
