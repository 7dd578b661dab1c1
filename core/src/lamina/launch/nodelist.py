"""SLURM's compressed host lists (``node[01-03,07],gpu-a1``) and task counts (``2(x3),1``)."""

from __future__ import annotations

import re

from lamina.errors import ConfigError

_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top_level(text: str, what: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts: list[str] = []
    depth = 0
    current = ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"{what}={text!r} has a ']' without '['; fix the host list")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise ConfigError(f"{what}={text!r} has an unclosed '['; fix the host list")
    parts.append(current)
    return parts


def _expand_range(spec: str, text: str, what: str) -> list[str]:
    """``01-03`` -> ``01 02 03`` (zero padding kept), ``7`` -> ``7``."""
    start, _, end = spec.partition("-")
    if not start.isdigit() or (end and not end.isdigit()):
        raise ConfigError(f"{what}={text!r}: {spec!r} is not a number or a range like 01-03")
    if not end:
        return [start]
    first, last = int(start), int(end)
    if last < first:
        raise ConfigError(f"{what}={text!r}: range {spec!r} runs backwards; write {end}-{start}")
    width = len(start)
    return [str(k).zfill(width) for k in range(first, last + 1)]


def _expand_entry(entry: str, text: str, what: str) -> list[str]:
    """One host pattern (any number of bracket groups) -> its host names, in order."""
    opening = entry.find("[")
    if opening < 0:
        return [entry]
    closing = entry.index("]", opening)
    prefix, body, rest = entry[:opening], entry[opening + 1 : closing], entry[closing + 1 :]
    values = [v for spec in body.split(",") for v in _expand_range(spec, text, what)]
    tails = _expand_entry(rest, text, what)
    return [prefix + value + tail for value in values for tail in tails]


def expand_nodelist(text: str, what: str = "SLURM_JOB_NODELIST") -> list[str]:
    """The host names of a SLURM host list, in order; ``what`` names the variable in
    errors. ``node[01-03,07],gpu-a1`` -> ``node01 node02 node03 node07 gpu-a1``."""
    if not text.strip():
        raise ConfigError(f"{what} is empty; run under srun/sbatch, which set it")
    hosts: list[str] = []
    for entry in _split_top_level(text.strip(), what):
        if not entry:
            raise ConfigError(f"{what}={text!r} has an empty entry; fix the host list")
        hosts += _expand_entry(entry, text, what)
    return hosts


def expand_task_counts(text: str, what: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Tasks on each node: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.split(","):
        match = _COUNT.match(part.strip())
        if match is None:
            raise ConfigError(
                f"{what}={text!r}: {part!r} is not a count like 4 or 2(x3); run under srun"
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts
