"""``lamina plugin new NAME [--dir D]``: start a backend package from lamina's template."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lamina.scaffold import BackendNames, backend_names, write_backend_package


def _installed_backends() -> dict[str, str | None]:
    """Backend name -> the distribution providing it, for every backend installed here."""
    from lamina.plugins import load_plugins

    registry = load_plugins()
    return {
        name: registry.records[entry.plugin].distribution
        for name, entry in registry.backends.items()
    }


def _shown(path: Path) -> str:
    """``path`` as a command line needs it: ``pip install -e NAME`` wants ``./NAME``."""
    relative = not path.is_absolute() and path.parts[:1] not in ((".",), ("..",))
    return f"./{path}" if relative else str(path)


def _next_steps(names: BackendNames, folder: Path) -> list[str]:
    backend_py = _shown(folder / "src" / names.package / "backend.py")
    return [
        "next steps:",
        f"  pip install -e {_shown(folder)}",
        f"  pytest -q {_shown(folder / 'tests')}    # the conformance kit against "
        f"backend '{names.name}'",
        f"  LAMINA_BACKEND={names.name} lamina info",
        f"then replace each method body in {backend_py} with the vendor call its docstring "
        "names (docs/plugin-authors.md)",
    ]


def _cmd_new(args: argparse.Namespace) -> int:
    names = backend_names(args.name, _installed_backends())
    folder: Path = args.dir if args.dir is not None else Path(names.distribution)
    written = write_backend_package(names, folder)
    print(
        f"created {names.distribution} (import package {names.package}, backend "
        f"'{names.name}') in {_shown(folder)}:"
    )
    print("\n".join(f"  {path}" for path in written))
    print("\n".join(_next_steps(names, folder)))
    return 0


def add_plugin_parser(subparsers: Any) -> None:
    """Register ``lamina plugin`` and its subcommands."""
    plugin = subparsers.add_parser("plugin", help="tools for plugin authors")
    commands = plugin.add_subparsers(dest="plugin_command", required=True, metavar="COMMAND")
    new = commands.add_parser(
        "new",
        help="create a backend package from lamina's template",
        description=(
            "Create lamina-backend-NAME: import package lamina_NAME, backend and entry point "
            "NAME, its conformance tests and README; it runs on the host CPU until ported."
        ),
    )
    new.add_argument(
        "name", metavar="NAME", help="backend name: lowercase letters, digits, underscores"
    )
    new.add_argument(
        "--dir",
        type=Path,
        default=None,
        metavar="D",
        help="the folder to create (default: ./lamina-backend-NAME); it must not exist",
    )
    new.set_defaults(func=_cmd_new)
