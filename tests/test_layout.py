"""The layout shows the design: each top-level package is one concern, and imports only where the request path
allows. Read from the source with ast, so a lazy import inside a function counts as much as one at the top."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "engine_ext", "store", "dashboards", "plan", "settings", "launcher", "bundled", "offline",
            "soak", "replay")

# package -> the first-party packages it may import. The gateway and the engine extension never import each other;
# both speak through plan (the wire format) and store (the shared KV store).
ALLOWED = {
    "plan": {"settings"},
    "settings": set(),
    "store": {"settings"},
    "dashboards": set(),
    "engine_ext": {"plan", "store", "settings"},
    "gateway": {"plan", "store", "settings", "dashboards"},
    "launcher": {"plan", "settings", "bundled", "engine_ext"},
    "bundled": {"settings"},
    "offline": {"plan", "bundled", "engine_ext", "store", "settings"},
    # The soak drives a running gateway from outside, as clients and operators do: over HTTP, never by import.
    "soak": {"launcher", "bundled", "offline", "plan", "store", "settings"},
    # Replay drives a running gateway from outside too; its traces are made of the offline tools' real images.
    "replay": {"offline", "bundled", "settings"},
}
# The one composition root that starts workers next to the gateway (``revisit serve``).
EXCEPTIONS = {"gateway/embedded.py": {"launcher", "bundled"},
              # The console command names the replay tool's commands (it serves nothing of the gateway's).
              "gateway/cli.py": {"replay"}}
# What the launcher may take from the engine extension: the package's location and its model package's name.
LAUNCHER_FROM_ENGINE_EXT = {"engine_ext", "engine_ext.models"}


def _imports(path: Path) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.append(node.module)
    return modules


def _sources(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "stub_site" not in p.parts)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_follow_the_layout(package: str) -> None:
    wrong = []
    for path in _sources(package):
        relative = str(path.relative_to(ROOT))
        allowed = ALLOWED[package] | EXCEPTIONS.get(relative, set()) | {package}
        for module in _imports(path):
            top = module.split(".")[0]
            if top in PACKAGES and top not in allowed:
                wrong.append(f"{relative} imports {module}")
            if package == "launcher" and top == "engine_ext" and module not in LAUNCHER_FROM_ENGINE_EXT:
                wrong.append(f"{relative} imports {module}: the launcher only names the engine extension")
    assert not wrong, "\n".join(wrong)


def test_every_package_is_installed_linted_and_type_checked() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^\t\$\(BIN\)/mypy$", makefile, re.M), "make test does not run mypy"
    for package in PACKAGES:
        assert f"{package}*" in pyproject["tool"]["setuptools"]["packages"]["find"]["include"], package
        assert package in pyproject["tool"]["mypy"]["files"], f"mypy does not check {package}"
        assert re.search(rf"ruff check[^\n]* {package}\b", makefile), f"make test does not lint {package}"
        assert (ROOT / package / "__init__.py").is_file()


def _closure(start: set[str]) -> set[str]:
    """The first-party packages start needs, following imports transitively (dashboards and tests aside)."""
    needed, todo = set(), list(start)
    while todo:
        package = todo.pop()
        if package in needed:
            continue
        needed.add(package)
        for path in _sources(package):
            relative = str(path.relative_to(ROOT))
            if relative in EXCEPTIONS:  # revisit serve is not what the images run
                continue
            todo += [m.split(".")[0] for m in _imports(path) if m.split(".")[0] in PACKAGES]
    return needed


@pytest.mark.parametrize(("dockerfile", "entry"),
                         [("gateway.Dockerfile", "gateway"), ("worker.Dockerfile", "launcher")])
def test_images_copy_what_their_entry_point_imports(dockerfile: str, entry: str) -> None:
    copied = set(re.findall(r"^COPY (\w+) ", (ROOT / "docker" / dockerfile).read_text(), re.M))
    missing = _closure({entry}) - copied
    assert not missing, f"{dockerfile} runs {entry} but does not copy {sorted(missing)}"
