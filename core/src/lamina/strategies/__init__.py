"""Parallel strategies: wrap a model so that one training script runs distributed."""

from __future__ import annotations

from typing import Any, Literal

from torch import nn

from lamina.errors import ConfigError

Strategy = Literal["dp", "zero3"]
STRATEGIES: tuple[str, ...] = ("dp", "zero3")


def distribute(
    model: nn.Module,
    strategy: str = "dp",
    *,
    example_inputs: tuple[Any, ...] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    bucket_cap_mb: float | None = None,
    first_bucket_mb: float = 1.0,
    **options: Any,
) -> nn.Module:
    """Wrap ``model`` for the chosen ``strategy`` over the job ``lamina.init()`` joined.

    ``"dp"``: data parallel with graph-planned gradient buckets (see
    :class:`lamina.strategies.dp.DataParallel` for ``options``). Without
    ``example_inputs`` the graph is captured on the first forward.
    ``"zero3"``: parameters, gradients and optimizer state sharded across ranks (see
    :class:`lamina.strategies.zero3.ShardedDataParallel`).
    """
    from lamina.session import current, init

    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    runtime = current() or init()
    if strategy == "zero3":
        from lamina.strategies.zero3 import ShardedDataParallel

        return ShardedDataParallel(model, **options)
    from lamina.strategies.dp import DataParallel

    if runtime.world_size != runtime.mesh.size():
        raise ConfigError(
            f"mesh {runtime.mesh} holds {runtime.mesh.size()} rank(s) but the job has "
            f"{runtime.world_size}; call lamina.init() with mesh='flat' or a mesh shape whose "
            "product is the world size"
        )
    return DataParallel(
        model,
        handle=runtime.handle,
        example_inputs=example_inputs,
        example_kwargs=example_kwargs,
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_mb=first_bucket_mb,
        **options,
    )


__all__ = ["STRATEGIES", "Strategy", "distribute"]
