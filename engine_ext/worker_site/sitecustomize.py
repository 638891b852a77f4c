"""Run by Python at start-up in every SGLang worker process (the launcher puts this directory first on
``PYTHONPATH``): SGLang's video decoder becomes PyAV (engine_ext/video_decoder.py), and SGLang's server arguments
are logged without the worker's API key (derived from the deployment secret, settings/secret.py: whoever reads a
worker's log must not be able to post to it).

SGLang's modules bind ``VideoDecoderWrapper`` by name when they are imported (``from
sglang.srt.utils.video_decoder import VideoDecoderWrapper`` in sglang.srt.utils.common, the multimodal processors,
...), so the class is replaced inside SGLang's module the moment that module has run, before any other module can
import it: an import hook for that one module, which then leaves ``sys.meta_path``. Nothing else is imported at
start-up; a process that never imports SGLang's video decoder never imports PyAV or SGLang on its account.

Without PyAV (a GPU image built without it) SGLang's own decoder stays, and the worker says so on stderr.
A ``sitecustomize`` that this one shadows (a distribution's, further on ``sys.path``) still runs, after it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

TARGET = "sglang.srt.utils.video_decoder"
SERVER_ARGS = "sglang.srt.server_args"
ENGINE = "sglang.srt.entrypoints.engine"
HIDDEN_ARGS = ("api_key", "admin_api_key")
HERE = os.path.dirname(os.path.abspath(__file__))


def _install_decoder(module: ModuleType) -> None:
    try:
        from engine_ext.video_decoder import install
    except ImportError as exc:
        print(f"revisit worker site: video parts are decoded by SGLang's own decoder, not PyAV: {exc}",
              file=sys.stderr)
        return
    install(module)


def _hide_api_keys(module: ModuleType) -> None:
    """ServerArgs' repr (logged at start) with the API keys shown as '***'."""
    server_args = getattr(module, "ServerArgs", None)
    if server_args is None:
        return
    shown = server_args.__repr__

    def __repr__(self: Any) -> str:  # noqa: N807 (the method it replaces)
        text = shown(self)
        for name in HIDDEN_ARGS:
            value = getattr(self, name, None)
            if value:
                text = text.replace(repr(value), "'***'")
        return text

    server_args.__repr__ = __repr__


def _hide_logged_api_keys(module: ModuleType) -> None:
    """The server arguments SGLang's engine logs at start, with the API keys shown as '***'."""
    logged = getattr(module, "_server_args_for_logging", None)
    if logged is None:
        return

    def _server_args_for_logging(server_args: Any) -> Any:
        shown = logged(server_args)
        if isinstance(shown, dict):
            shown = {k: ("***" if k in HIDDEN_ARGS and v else v) for k, v in shown.items()}
        return shown

    setattr(module, "_server_args_for_logging", _server_args_for_logging)  # noqa: B010 (the module is typed)


INSTALLERS = {TARGET: _install_decoder, SERVER_ARGS: _hide_api_keys, ENGINE: _hide_logged_api_keys}


class _InstallAfterLoading(importlib.abc.Loader):
    """Runs SGLang's module with its own loader, then what is installed in it (INSTALLERS)."""

    def __init__(self, loader: Any, install: Any) -> None:
        self._loader = loader
        self._install = install

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._install(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ...: the real loader's
        return getattr(self._loader, name)


class WorkerSiteHook(importlib.abc.MetaPathFinder):
    """Installs what INSTALLERS names into each of those SGLang modules as it is first imported; leaves
    ``sys.meta_path`` once every one has been."""

    def __init__(self) -> None:
        self._pending = set(INSTALLERS) - set(sys.modules)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._pending:
            return None
        self._pending.discard(fullname)
        if not self._pending:
            sys.meta_path.remove(self)
        spec = _find_elsewhere(self, fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _InstallAfterLoading(spec.loader, INSTALLERS[fullname])
        return spec


def _find_elsewhere(hook: WorkerSiteHook, fullname: str) -> importlib.machinery.ModuleSpec | None:
    """The module's spec as the finders after this hook give it."""
    present = hook in sys.meta_path
    if present:
        sys.meta_path.remove(hook)
    try:
        return importlib.util.find_spec(fullname)
    finally:
        if present:
            sys.meta_path.insert(0, hook)


def _run_shadowed_sitecustomize() -> None:
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == HERE:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception as exc:  # as site.py treats a failing sitecustomize
                print(f"Error in sitecustomize ({spec.origin}); set PYTHONVERBOSE for traceback: {exc!r}",
                      file=sys.stderr)
            return


if not any(isinstance(f, WorkerSiteHook) for f in sys.meta_path) and set(INSTALLERS) - set(sys.modules):
    sys.meta_path.insert(0, WorkerSiteHook())
_run_shadowed_sitecustomize()
