"""The folder tree is the architecture: every import in core points down the layers.

Read from the sources (no import runs), so a module that reaches up a layer fails here
with its file and line, whether the import is at the top or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lamina

PACKAGE = Path(lamina.__file__).resolve().parent

#: Layer (package under lamina/) -> lamina packages and modules it must never import.
#: What a standalone package (it depends on ``lamina.errors`` and itself only) may not import.
STANDALONE = (
    "device", "graph", "comm", "memory", "runtime", "strategies", "session", "api", "verify",
    "cli", "backends", "trace",
)  # fmt: skip
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "device": ("graph", "comm", "memory", "runtime", "strategies", "session", "api", "cli"),
    "graph": ("comm", "memory", "runtime", "strategies", "session", "api", "cli", "verify"),
    "comm": ("graph", "memory", "runtime", "strategies", "session", "api", "cli", "verify"),
    "memory": ("comm", "runtime", "strategies", "session", "api", "cli", "verify"),
    "runtime": ("strategies", "session", "api", "cli", "verify"),
    "verify": ("strategies", "session", "api", "cli", "graph", "memory"),
    "strategies": ("api", "cli"),
    "simulate": ("strategies", "session", "api", "cli"),
    "checkpoint": ("cli",),
    # launch tools: they start processes and read the environment, nothing of lamina's
    "emulate": STANDALONE,
    "data": STANDALONE,
    "launch": STANDALONE,
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every ``import lamina...`` / ``from lamina... import`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] == "lamina"]


def _layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_above_it(layer: str) -> None:
    offences = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for line, module in _imports(path):
            if _layer_of(module) in FORBIDDEN[layer]:
                offences.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert offences == [], offences


def test_strategies_are_given_the_runtime_and_never_look_it_up() -> None:
    calls = []
    for path in sorted((PACKAGE / "strategies").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "current":
                calls.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "current":
                calls.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert calls == [], calls
