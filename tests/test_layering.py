"""The layers of core are a total order: every import in ``lamina`` points down it.

Read from the sources (no import runs). :data:`RANKS` gives every package and top-level
module of ``lamina`` a rank; an import may point only within its own package or module,
or to one of strictly lower rank. Every import counts: absolute and relative
(``from . import x``, ``from ..y import z``), at the top or inside a function; only an
import under ``if TYPE_CHECKING:`` (type-only, never run) may point anywhere. A new
package or module that is not in the table fails, so the table stays total. Separately,
the modules' run-time imports (those under ``TYPE_CHECKING`` left out) must form no
cycle. Offences name their file and line.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import lamina

PACKAGE = Path(lamina.__file__).resolve().parent

#: Rank of every package and top-level module of ``lamina`` (``__init__`` is the package's
#: own ``lamina/__init__.py``, the public API). Entries of one rank are peers: neither may
#: import the other. Lower ranks first.
RANKS: dict[str, int] = {
    # 0: the error kinds everything raises
    "errors": 0,
    # 1: leaves that use errors only: value formats, the environment, shared work objects,
    # and the standalone tools (launch-time SLURM/Kubernetes reading, the emulator, the
    # resumable sampler, the plugin scaffold)
    "dtypes": 1,
    "units": 1,
    "versions": 1,
    "envvars": 1,
    "works": 1,
    "launch": 1,
    "emulate": 1,
    "data": 1,
    "scaffold": 1,
    # 2: the device layer, the trace recorder, the plugin hook specs (types only)
    "device": 2,
    "trace": 2,
    "hookspecs": 2,
    # 3: the mechanisms, each independent of the others (graph capture, communication,
    # sharded memory, the execution plan, cross-rank verification), the built-in backends
    # and plugin discovery (which finds backends by entry point, never by import)
    "graph": 3,
    "comm": 3,
    "memory": 3,
    "runtime": 3,
    "verify": 3,
    "backends": 3,
    "plugins": 3,
    # 4: what combines mechanisms: strategies, the session (lamina.init), the simulator.
    # Strategies are given a StrategyContext; only lamina.distribute's sequence (the wrap
    # pipeline, pre-flight, the context's constructor) names the session, under
    # TYPE_CHECKING only
    "strategies": 4,
    "session": 4,
    "simulate": 4,
    # 5: the automatic choice (lamina.distribute(model, "auto")): measures the model,
    # predicts and ranks every strategy, and returns the choice, which distribute()
    # applies; checkpoints (which look up the running session)
    "auto": 5,
    "checkpoint": 5,
    # 6: distribute()
    "api": 6,
    # 7: the public API, lamina/__init__.py
    "__init__": 7,
    # 8: what runs on the public API: the collective benchmarks, and lamina inside the
    # training frameworks (the Lightning strategy, the Hugging Face Trainer path)
    "bench": 8,
    "integrations": 8,
    # 9: the top: the command line and the test harness with the conformance kit
    "cli": 9,
    "testing": 9,
}


@dataclass(frozen=True)
class Import:
    """One import of a ``lamina`` module: where it is, what it names, and whether it runs."""

    path: Path
    line: int
    target: str
    type_only: bool

    def where(self) -> str:
        return f"{self.path.relative_to(PACKAGE.parent)}:{self.line}"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """The dotted name of the module at ``path`` (a package by its ``__init__.py``)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module under ``root``, by dotted name."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _from_base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads from, relative levels resolved."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if node.level - 1 > len(parts) - 1:
        raise AssertionError(f"{module}:{node.lineno}: relative import beyond the top package")
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imports_of(path: Path, modules: dict[str, Path], root: Path = PACKAGE) -> list[Import]:
    """Every import of a module under ``root`` in ``path``, wherever it sits in the file.

    ``from package import name`` names ``package.name`` where that is a module, else
    ``package``. Imports in the body of ``if TYPE_CHECKING:`` are marked type-only (its
    ``else`` branch runs, so it is not).
    """
    module = module_name(path, root)
    top = root.name
    found: list[Import] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        for field, value in ast.iter_fields(node):
            children = value if isinstance(value, list) else [value]
            in_guard = type_only or (
                isinstance(node, ast.If) and field == "body" and _is_type_checking(node.test)
            )
            for child in children:
                if not isinstance(child, ast.AST):
                    continue
                if isinstance(child, ast.Import):
                    targets = [alias.name for alias in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = _from_base(module, path.name == "__init__.py", child)
                    targets = [
                        f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                        for a in child.names
                    ]
                else:
                    targets = []
                for target in dict.fromkeys(targets):
                    if target.split(".")[0] == top:
                        found.append(Import(path, child.lineno, target, in_guard))
                visit(child, in_guard)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def entry_of(module: str) -> str:
    """The package or top-level module of ``lamina`` that ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def entries(root: Path = PACKAGE) -> set[str]:
    """Every package and top-level module under ``root`` (``__init__`` for its own init)."""
    found = set()
    for child in root.iterdir():
        if child.is_dir() and any(child.rglob("*.py")):
            found.add(child.name)
        elif child.suffix == ".py":
            found.add(child.stem)
    return found


def runtime_imports(modules: dict[str, Path], root: Path = PACKAGE) -> dict[str, list[Import]]:
    """Per module, the imports of other modules under ``root`` that run (at the top of the
    file or inside a function; not under ``TYPE_CHECKING``)."""
    return {
        name: [
            i
            for i in imports_of(path, modules, root)
            if not i.type_only and i.target != name and i.target in modules
        ]
        for name, path in modules.items()
    }


def runtime_cycles(modules: dict[str, Path], root: Path = PACKAGE) -> list[list[str]]:
    """Each cycle of run-time imports between modules: its modules, sorted.

    The strongly connected components of more than one module (Tarjan) of
    :func:`runtime_imports`. A package's ``__init__`` running when one of its submodules
    is imported is not an edge: only what a file names is.
    """
    graph = {
        name: sorted({i.target for i in found})
        for name, found in runtime_imports(modules, root).items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, []):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(cycles)


def _files(entry: str) -> Iterator[Path]:
    if entry == "__init__":
        yield PACKAGE / "__init__.py"
    elif (PACKAGE / entry).is_dir():
        yield from sorted((PACKAGE / entry).rglob("*.py"))
    else:
        yield PACKAGE / f"{entry}.py"


# --------------------------------------------------------------------------- the order


def test_the_rank_table_names_every_package_and_module() -> None:
    present = entries()
    assert sorted(present - RANKS.keys()) == [], "add these to RANKS, at the rank they import"
    assert sorted(RANKS.keys() - present) == [], "these are gone from lamina: drop them"


@pytest.mark.parametrize("entry", sorted(RANKS))
def test_every_import_points_to_a_lower_rank(entry: str) -> None:
    modules = all_modules()
    offences = []
    for path in _files(entry):
        for found in imports_of(path, modules):
            if found.type_only:
                continue
            if found.target not in modules:
                offences.append(f"{found.where()} imports {found.target}, which is no module")
                continue
            target = entry_of(found.target)
            if target == entry:
                continue
            if RANKS.get(target, len(RANKS)) >= RANKS[entry]:
                offences.append(
                    f"{found.where()} imports {found.target}: {target} (rank "
                    f"{RANKS.get(target)}) is not below {entry} (rank {RANKS[entry]})"
                )
    assert offences == [], offences


def test_no_runtime_import_cycle() -> None:
    modules = all_modules()
    edges = runtime_imports(modules)
    cycles = [
        f"{', '.join(cycle)}: "
        + "; ".join(
            f"{i.where()} imports {i.target}"
            for name in cycle
            for i in edges[name]
            if i.target in cycle
        )
        for cycle in runtime_cycles(modules)
    ]
    assert cycles == [], "run-time import cycles:\n" + "\n".join(cycles)


#: What ``lamina`` imports to parse a command line and run the subcommands that need no
#: tensors: the launcher a job's every host runs (emulate), the readers of traces and
#: checkpoints, and the front of plan, verify, bench and topo (their ranks import torch).
TORCH_FREE = (
    "lamina",
    "lamina.cli.main",
    "lamina.cli.emulate",
    "lamina.cli.trace",
    "lamina.cli.checkpoint",
    "lamina.cli.plan",
    "lamina.cli.bench",
    "lamina.cli.topo",
    "lamina.errors",
)


def test_the_command_line_and_its_launchers_start_without_torch() -> None:
    # each import of torch costs a process ~3 s of CPU; `lamina emulate` and the per-host
    # launchers of a job must not pay it for nothing
    code = (
        "import importlib, sys\n"
        f"for name in {TORCH_FREE!r}: importlib.import_module(name)\n"
        "import lamina.cli.main as m\n"
        "m.build_parser().parse_args(\n"
        "    ['emulate', '--hosts', '2', '--link', '1gbit', '--', 'x.py'])\n"
        "print(sorted(n for n in sys.modules if n == 'torch' or n.startswith('torch.')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_the_package_still_offers_its_public_names() -> None:
    assert callable(lamina.distribute) and callable(lamina.init)
    assert issubclass(lamina.LaminaError, Exception)
    assert set(lamina.__all__) <= set(dir(lamina))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        lamina.nothing  # noqa: B018


#: The strategy modules that see the session (lamina.distribute's own sequence, composed
#: strategies included).
SESSION_READERS = {"compose.py", "context.py", "preflight.py", "wrap_pipeline.py"}


def test_strategies_see_the_narrow_context_not_the_session() -> None:
    readers = sorted(
        str(path.relative_to(PACKAGE / "strategies"))
        for path in (PACKAGE / "strategies").rglob("*.py")
        if "lamina.session" in path.read_text()
    )
    assert readers == sorted(SESSION_READERS)


def test_strategies_are_given_the_runtime_and_never_look_it_up() -> None:
    calls = []
    for path in sorted((PACKAGE / "strategies").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "current":
                calls.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "current":
                calls.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert calls == [], calls


# --------------------------------------------------------------------------- the reader


def _tree(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "pkg"
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


def test_the_reader_resolves_relative_imports_and_marks_type_only_ones(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {
            "__init__.py": "from . import low\nfrom .high import thing\n",
            "low/__init__.py": "",
            "low/leaf.py": (
                "from typing import TYPE_CHECKING\n"
                "import typing\n"
                "from .. import high\n"
                "from ..low import other\n"
                "from . import other as again\n"
                "if TYPE_CHECKING:\n"
                "    from pkg.high import Thing\n"
                "else:\n"
                "    import pkg.mid\n"
                "if typing.TYPE_CHECKING:\n"
                "    import pkg.top\n"
                "def late():\n"
                "    from pkg import mid\n"
                "    import os\n"
            ),
            "low/other.py": "",
            "high.py": "",
            "mid.py": "",
            "top.py": "",
        },
    )
    modules = all_modules(pkg)
    got = [(i.line, i.target, i.type_only) for i in imports_of(pkg / "low/leaf.py", modules, pkg)]
    assert got == [
        (3, "pkg.high", False),
        (4, "pkg.low.other", False),
        (5, "pkg.low.other", False),
        (7, "pkg.high", True),
        (9, "pkg.mid", False),
        (11, "pkg.top", True),
        (13, "pkg.mid", False),
    ]
    init = [(i.line, i.target) for i in imports_of(pkg / "__init__.py", modules, pkg)]
    assert init == [(1, "pkg.low"), (2, "pkg.high")]
    assert entries(pkg) == {"__init__", "low", "high", "mid", "top"}


def test_the_reader_finds_cycles_through_function_imports_only_at_run_time(
    tmp_path: Path,
) -> None:
    pkg = _tree(
        tmp_path,
        {
            "__init__.py": "from pkg.a import x\n",  # a package init is no edge back
            "a.py": "import pkg.b\nx = 1\n",
            "b.py": "def f():\n    from pkg import a\n",
            "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\n",
            "d.py": "import pkg.c\n",
        },
    )
    assert runtime_cycles(all_modules(pkg), pkg) == [["pkg.a", "pkg.b"]]
