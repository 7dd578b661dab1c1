"""The 2-rank collective job of the conformance kit and its per-op checks."""

from __future__ import annotations

import traceback
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from lamina.device.backend import Backend
from lamina.errors import NotSupportedError
from lamina.testing.conformance._common import (
    NOT_SUPPORTED,
)
from lamina.testing.harness import run_ranks

# --------------------------------------------------------------------------- collectives

#: The collectives the kit runs on two ranks, by the names ``unsupported_collectives`` uses.
COLLECTIVES: tuple[str, ...] = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
_WORLD = 2
_BROADCAST_SOURCE = 1  # not 0: a broadcast that ignores its source fails


def _collective_input(op: str, rank: int, device: torch.device) -> torch.Tensor:
    """What ``rank`` contributes to the kit's ``op``: values that differ between ranks."""
    if op in ("broadcast", "all_gather"):
        base = (10.0, 11.0, 12.0, 13.0) if op == "broadcast" else (1.0, 2.0, 3.0)
        return torch.tensor([v + 10 * rank for v in base], device=device)
    return torch.tensor([v * (rank + 1) for v in (1.0, 2.0, 3.0, 4.0)], device=device)


def expected_collective(op: str, rank: int, world: int = _WORLD) -> list[float]:
    """What ``rank`` must hold after the kit's ``op`` on ``world`` ranks."""
    if op == "all_reduce":
        return [v * sum(r + 1 for r in range(world)) for v in (1.0, 2.0, 3.0, 4.0)]
    if op == "broadcast":
        return [v + 10 * _BROADCAST_SOURCE for v in (10.0, 11.0, 12.0, 13.0)]
    if op == "all_gather":
        return [v + 10 * r for r in range(world) for v in (1.0, 2.0, 3.0)]
    if op == "reduce_scatter":
        total = [v * sum(r + 1 for r in range(world)) for v in (1.0, 2.0, 3.0, 4.0)]
        shard = len(total) // world
        return total[rank * shard : (rank + 1) * shard]
    raise ValueError(f"unknown collective {op!r}; the kit runs {COLLECTIVES}")


def _issue(op: str, rank: int, device: torch.device) -> torch.Tensor:
    import torch.distributed as dist

    value = _collective_input(op, rank, device)
    if op == "all_reduce":
        dist.all_reduce(value)
        return value
    if op == "broadcast":
        dist.broadcast(value, src=_BROADCAST_SOURCE)
        return value
    if op == "all_gather":
        gathered = torch.zeros(value.numel() * _WORLD, device=device)
        dist.all_gather_into_tensor(gathered, value)
        return gathered
    shard = torch.zeros(value.numel() // _WORLD, device=device)
    dist.reduce_scatter_tensor(shard, value)
    return shard


def _raised_in(exc: BaseException, function: str) -> bool:
    """True when ``exc`` passed through a frame of a function called ``function``."""
    frames = traceback.walk_tb(exc.__traceback__)
    return any(frame.f_code.co_name == function for frame, _ in frames)


def _collectives_rank(expected_backend: str, skip: tuple[str, ...]) -> dict[str, Any]:
    """Rank body: ``lamina.init()``, then every collective the backend has not declared missing."""
    import torch.distributed as dist

    import lamina

    try:
        runtime = lamina.init()
    except NotSupportedError as exc:
        if _raised_in(exc, "prepare_process"):  # the runtime cannot run this launch
            return {"launch": str(exc)}
        raise
    assert runtime.backend.name == expected_backend, runtime.backend.name
    assert dist.get_backend() == runtime.backend.collective_backend, dist.get_backend()
    outcomes: dict[str, Any] = {}
    for op in COLLECTIVES:
        if op in skip:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch's renamed collectives
                value = _issue(op, runtime.rank, runtime.device)
            runtime.handle.synchronize(runtime.device)
            outcomes[op] = ("ok", [float(v) for v in value.cpu().tolist()])
        except Exception as exc:
            kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
            outcomes[op] = ("error", kind, str(exc).splitlines()[0] if str(exc) else "")
    lamina.shutdown()
    return outcomes


@dataclass(frozen=True)
class CollectiveRun:
    """The outcome of one 2-rank job that ran every collective of :data:`COLLECTIVES`."""

    backend: str
    #: Ops the backend declares unsupported (not run).
    unsupported: frozenset[str]
    #: Per rank: op -> ``("ok", values)`` or ``("error", exception type, message)``.
    outcomes: tuple[dict[str, Any], ...]


def run_collectives(backend: Backend, timeout: float = 150.0) -> CollectiveRun:
    """Run every kit collective in one 2-rank job through ``lamina.init()`` on ``backend``.

    Skips when a device backend has fewer than two devices, or when its
    ``prepare_process`` says (NotSupportedError) that the runtime cannot run the launch.
    """
    if backend.device_type != "cpu":
        count = backend.handle().device_count()
        if count < _WORLD:
            pytest.skip(f"{backend.name}: needs 2 devices for 2 ranks, {count} visible")
    unsupported = frozenset(backend.unsupported_collectives)
    results = run_ranks(
        _collectives_rank,
        _WORLD,
        args=(backend.name, tuple(sorted(unsupported))),
        env={"LAMINA_BACKEND": backend.name},
        timeout=timeout,
    )
    for result in results:
        if "launch" in result:
            pytest.skip(f"{backend.name}: {result['launch']}")
    return CollectiveRun(backend.name, unsupported, tuple(results))


def check_collective(run: CollectiveRun, op: str) -> None:
    if op in run.unsupported:
        pytest.skip(f"declared unsupported by {run.backend}: {op}")
    for rank, outcome in enumerate(run.outcomes):
        status, *rest = outcome[op]
        if status == "error":
            kind, message = rest
            if kind == NOT_SUPPORTED:
                pytest.fail(
                    f"{run.backend}: {op} raised NotSupportedError on rank {rank} ({message}) "
                    f"but the backend does not declare it in Backend.unsupported_collectives",
                    pytrace=False,
                )
            pytest.fail(f"{run.backend}: {op} failed on rank {rank}: {kind}: {message}", False)
        want = expected_collective(op, rank)
        assert rest[0] == want, f"{run.backend}: {op} on rank {rank} gave {rest[0]}, want {want}"
