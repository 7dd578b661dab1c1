"""Compile each distinct graph of a compiled step once per job, and once across jobs.

Inside :class:`~.graph_collectives.CheckedBackend`, :class:`CompileOnce` replaces every
rank compiling its captured graph with Inductor at the same time:

1. each rank hashes its graph (:func:`graph_key`: the graph's code, its inputs' shapes,
   strides and dtypes, the backend and its settings, torch's version) and the ranks
   exchange the hashes over the control group;
2. each rank first loads the cache file of its hash where one exists
   (:func:`cache_dir`); where every rank holding a hash loaded it, each compiles from its
   caches on its own (nothing is waited for or sent). Otherwise the lowest rank holding
   a hash (its *leader*) compiles it, while the ranks holding the same hash wait; it
   then sends them torch's cache artifacts
   (``torch.compiler.save_cache_artifacts``) through ``torch.distributed``;
3. they load the artifacts (``torch.compiler.load_cache_artifacts``) and compile: Inductor
   and AOT autograd find the graph in their caches instead of compiling it again.

The leader writes the artifacts to the cache file (atomically), so the next job's first
step loads instead of compiling. A cache file that cannot be read is named in a one-line
warning (delete it) and the graph is compiled as usual. ``LAMINA_COMPILE_ONCE=0``
compiles on every rank at once, as before (no exchange, no cache file).

What each rank did is an :class:`Outcome`; :meth:`Outcome.describe` is the line the run
log shows ("cold: compiled on rank 0, 1 rank loaded its artifacts").
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("lamina.compile")

#: ``0``: every rank compiles its graph itself (no exchange, no cache file).
ENV_ONCE = "LAMINA_COMPILE_ONCE"
#: The cache files' directory (empty: no cache file).
ENV_DIR = "LAMINA_COMPILE_CACHE"
DEFAULT_DIR = Path("~/.cache/lamina/compiled")

#: How a rank got its compiled graph.
COMPILED = "compiled"  # Inductor compiled it here
TORCH_CACHE = "torch cache"  # Inductor found it in its own cache (a previous job's)
FILE = "cache file"  # loaded from lamina's cache file
LOADED = "loaded"  # loaded from the artifacts of the rank that compiled it


def enabled() -> bool:
    """Whether one rank compiles each graph (``LAMINA_COMPILE_ONCE`` is not ``0``)."""
    return os.environ.get(ENV_ONCE, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path | None:
    """Where cache files live: ``$LAMINA_COMPILE_CACHE``, default
    ``~/.cache/lamina/compiled``; None where the variable is set empty."""
    value = os.environ.get(ENV_DIR)
    if value is None:
        return DEFAULT_DIR.expanduser()
    return Path(value).expanduser() if value.strip() else None


def graph_key(
    gm: torch.fx.GraphModule, example_inputs: list[Any], backend: str, settings: Mapping[str, Any]
) -> str:
    """A hash of what the compiled graph depends on: ``gm``'s code, its inputs' shapes,
    strides, dtypes and devices, the backend, its settings and torch's version."""
    digest = hashlib.sha256()
    for part in (torch.__version__, backend, repr(sorted(settings.items())), gm.code):
        digest.update(part.encode())
        digest.update(b"\0")
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            text = f"{tuple(value.shape)} {value.stride()} {value.dtype} {value.device.type}"
        else:
            text = f"{type(value).__name__} {value!r}"
        digest.update(text.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:32]


@dataclass(frozen=True)
class Outcome:
    """How one graph was compiled on this rank and across the job: this rank's way
    (:data:`COMPILED`, :data:`TORCH_CACHE`, :data:`FILE` or :data:`LOADED`), each
    leader's way by rank, the ranks that loaded a leader's artifacts, the seconds the
    backend took here and Inductor's compiles here (FX-graph cache misses)."""

    how: str
    leaders: tuple[tuple[int, str], ...]
    loaded: tuple[int, ...]
    seconds: float
    inductor_compiles: int
    shared: bool = True

    @property
    def cold(self) -> bool:
        """Whether some rank compiled the graph (else every rank loaded it)."""
        return any(how == COMPILED for _, how in self.leaders)

    def describe(self) -> str:
        """The run log's words: ``cold: compiled on rank 0, 1 rank loaded its artifacts``."""
        if not self.shared:
            every = "compiled on every rank" if self.cold else "every rank hit torch's cache"
            return f"{'cold' if self.cold else 'warm'}: {every}"
        by_how: dict[str, list[int]] = {}
        for rank, how in self.leaders:
            by_how.setdefault(how, []).append(rank)
        words = {
            COMPILED: "compiled on",
            FILE: "cache file read on",
            TORCH_CACHE: "torch's cache on",
        }
        parts = [f"{words[how]} {_ranks(ranks)}" for how, ranks in by_how.items()]
        if self.loaded:
            n = len(self.loaded)
            parts.append(
                f"{n} rank{'s' if n > 1 else ''} loaded {'its' if n == 1 else 'the'} artifacts"
            )
        return f"{'cold' if self.cold else 'warm'}: " + ", ".join(parts)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class CompileOnce:
    """Compiles each graph on the lowest rank of ``group`` holding it; the other ranks
    holding it load its artifacts (see the module docstring). ``outcomes`` keeps each
    graph's :class:`Outcome`, in compile order."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.outcomes: list[Outcome] = []

    def compile(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: list[Any],
        backend: str,
        settings: Mapping[str, Any],
        compile_fn: Callable[[], Any],
    ) -> Any:
        """``compile_fn()`` (Inductor compiling ``gm``), once per distinct graph."""
        started = time.perf_counter()
        if not enabled():
            alone, compiles = _counting(compile_fn)
            how = COMPILED if compiles else TORCH_CACHE
            rank = _rank(self.group)
            self.outcomes.append(
                Outcome(how, ((rank, how),), (), time.perf_counter() - started, compiles, False)
            )
            return alone
        key = graph_key(gm, example_inputs, backend, settings)
        folder = cache_dir()
        path = folder / f"{key}.bin" if folder is not None else None
        rank = _rank(self.group)
        from_file = _load_file(path) if path is not None else False
        leader_of = _leaders_unless_loaded(self._gather((key, from_file)))
        leader = leader_of[rank]
        followers = [r for r, lead in enumerate(leader_of) if lead == rank and r != rank]
        failure: Exception | None = None
        compiled: Any = None
        how, compiles, payload = COMPILED, 0, None
        if leader == rank:
            try:
                compiled, compiles = _counting(compile_fn)
                how = FILE if from_file and not compiles else COMPILED if compiles else TORCH_CACHE
                if followers or (path is not None and how != FILE):
                    payload = _artifacts()
                if path is not None and how != FILE and payload is not None:
                    _write_file(path, payload)
            except Exception as exc:  # the waiting ranks learn of it, then it raises
                failure = exc
        try:  # a rank that follows waits here for its leader's compile
            sent = self._gather((how, payload if followers else None, failure is not None))
        except RuntimeError as exc:
            if leader == rank:
                raise
            raise RuntimeError(
                f"rank {rank} stopped waiting for rank {leader} to compile the step ({exc}); "
                f"give lamina.init a longer timeout= or set {ENV_ONCE}=0"
            ) from exc
        if failure is not None:
            raise failure
        if leader != rank:
            _, artifacts, failed = sent[leader]
            if failed:
                raise RuntimeError(
                    f"rank {leader} could not compile the same graph; every rank runs eagerly"
                )
            _load_sent(artifacts, leader)
            compiled, compiles = _counting(compile_fn)
            how = COMPILED if compiles else LOADED
            if path is not None and artifacts is not None and not path.exists():
                _write_file(path, artifacts)  # another host's ranks find it next time
        leaders = tuple((r, sent[r][0]) for r in sorted(set(leader_of)))
        loaded = tuple(r for r, lead in enumerate(leader_of) if lead != r)
        self.outcomes.append(Outcome(how, leaders, loaded, time.perf_counter() - started, compiles))
        return compiled

    def _gather(self, value: Any) -> list[Any]:
        """``value`` of every rank of the group, by rank (``[value]`` without one)."""
        if not (dist.is_available() and dist.is_initialized()):
            return [value]
        size = dist.get_world_size(self.group)
        if size == 1:
            return [value]
        out: list[Any] = [None] * size
        dist.all_gather_object(out, value, group=self.group)
        return out


def _rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _leaders(keys: list[str]) -> list[int]:
    """Each rank's leader: the lowest rank holding the same graph key."""
    first: dict[str, int] = {}
    return [first.setdefault(key, r) for r, key in enumerate(keys)]


def _leaders_unless_loaded(held: list[tuple[str, bool]]) -> list[int]:
    """Each rank's leader from (graph key, whether the rank loaded its cache file):
    where every rank holding a key loaded its file, each is its own leader (nothing to
    wait for or send); else the lowest rank holding the key."""
    keys = [key for key, _ in held]
    every_loaded = {key: all(ok for k, ok in held if k == key) for key in keys}
    leaders = _leaders(keys)
    return [r if every_loaded[key] else leaders[r] for r, key in enumerate(keys)]


def _load_sent(artifacts: bytes | None, leader: int) -> None:
    """Load the artifacts ``leader`` sent into torch's caches (a warning where they
    cannot be read: this rank then compiles the graph itself)."""
    if artifacts is None:
        return
    try:
        torch.compiler.load_cache_artifacts(artifacts)
    except Exception as exc:
        logger.warning(
            "could not load the compile artifacts of rank %s (%s: %s); compiling here",
            leader,
            type(exc).__name__,
            exc,
        )


def _counting(compile_fn: Callable[[], Any]) -> tuple[Any, int]:
    """``compile_fn()`` and the graphs Inductor compiled in it (its FX-graph cache's
    misses and bypasses)."""
    from torch._dynamo.utils import counters

    def compiles() -> int:
        inductor = counters["inductor"]
        return int(inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"])

    before = compiles()
    compiled = compile_fn()
    return compiled, compiles() - before


def _artifacts() -> bytes | None:
    """torch's cache artifacts of this process (None: none recorded)."""
    saved = torch.compiler.save_cache_artifacts()
    return saved[0] if saved is not None else None


def _load_file(path: Path) -> bool:
    """Load the cache file at ``path`` into torch's caches; False where there is none
    or it cannot be read (warned, naming it)."""
    if not path.exists():
        return False
    try:
        data = path.read_bytes()
        info = torch.compiler.load_cache_artifacts(data)
    except Exception as exc:
        info, reason = None, f"{type(exc).__name__}: {exc}"
    else:
        reason = "torch could not read its artifacts"
    if info is None:
        logger.warning(
            "compile cache file %s is unreadable (%s); delete it (compiling instead)", path, reason
        )
        return False
    return True


def _write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (a warning where it cannot be written)."""
    tmp = ""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        logger.warning(
            "could not write the compile cache file %s (%s); set %s to a writable folder",
            path,
            exc,
            ENV_DIR,
        )
