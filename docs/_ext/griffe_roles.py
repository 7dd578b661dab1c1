"""A Griffe extension for the documentation site (mkdocs.yml loads it).

lamina's docstrings are reST-flavoured: references are Sphinx roles (``:func:`init```,
``:class:`~lamina.errors.ConfigError```) and a paragraph ending in ``::`` introduces an
indented literal block. Markdown knows neither, so, in the loaded docstrings only (the
sources are not touched), each role becomes an optional cross-reference of
mkdocs-autorefs (a link where the target is documented on the site, plain code where it
is not, never a warning), and a trailing ``::`` becomes ``:`` (the indented block that
follows is already a code block in Markdown).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

#: ``:role:`target``` and ``:role:`text <target>```; a leading ``~`` shows the last part.
ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):`([^`]+)`")
#: A reST literal-block marker at the end of a line: ``a three-line test file::``.
LITERAL = re.compile(r"(?<=\S)::$", re.MULTILINE)


def _target_and_text(body: str) -> tuple[str, str]:
    titled = re.fullmatch(r"(.*?)\s*<([^>]+)>", body)
    if titled:
        return titled.group(2).lstrip("~."), titled.group(1)
    target = body.lstrip("~.")
    text = target.rsplit(".", 1)[-1] if body.startswith("~") else target
    return target, text


def _resolve(obj: griffe.Object | griffe.Alias, target: str) -> str:
    """``target``'s full path as seen from ``obj``: a name in an enclosing scope (its own
    members, its class's, its module's) resolves there; anything else is taken as written."""
    first, _, rest = target.partition(".")
    scope: Any = obj
    while scope is not None:
        try:
            members = scope.members
        except Exception:  # an alias whose target is not loaded
            members = {}
        if first in members:
            base = members[first].path
            return f"{base}.{rest}" if rest else base
        scope = scope.parent
    return target


def _rewrite(obj: griffe.Object) -> None:
    docstring = obj.docstring
    if docstring is None or ":" not in docstring.value:
        return

    def link(match: re.Match[str]) -> str:
        target, text = _target_and_text(match.group(1))
        full = _resolve(obj, target)
        return f'<autoref identifier="{full}" optional><code>{text}</code></autoref>'

    docstring.value = LITERAL.sub(":", ROLE.sub(link, docstring.value))


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles in every docstring of a loaded package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        seen: set[int] = set()
        todo: list[griffe.Object] = [pkg]
        while todo:
            obj = todo.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            _rewrite(obj)
            todo.extend(m for m in obj.members.values() if not m.is_alias)
