"""fp8 for the sharded strategies: a unit's gradient reduction as the engine calls it.

:class:`Fp8UnitCodec` is the :class:`~lamina.memory.compressed.GradientCodec` of one
unit, built from an :class:`~lamina.comm.codecs.Fp8Codec`: ZeRO-3 compresses the
reduce-scatter over the shard group (:class:`~lamina.comm.fp8.Fp8Scatter`), HSDP the
all-reduce of the shard gradient across the replicas, which is what crosses the slow
links (:class:`~lamina.comm.fp8.Fp8Sum`). Either keeps its own error-feedback residual.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lamina.comm.codecs import Codec, Fp8Codec
from lamina.comm.fp8 import Fp8Scatter, Fp8Sum, quantized_bytes
from lamina.device.kernels import KernelLauncher
from lamina.errors import ConfigError
from lamina.strategies.codec_registry import resolve_codec


def sharded_codec(
    spec: str | Codec | None, launcher: KernelLauncher | None = None
) -> Fp8Codec | None:
    """The sharded strategies' codec from ``codec=`` (on ``launcher``'s kernels): None,
    or fp8 (ConfigError else)."""
    codec = resolve_codec(spec)
    if codec is None:
        return None
    if not isinstance(codec, Fp8Codec):
        raise ConfigError(
            f"codec={codec.name!r}: zero3 and hsdp compress gradients with 'fp8' (or an "
            "Fp8Codec) only; the cast codecs (bf16, fp16) are dp's"
        )
    return codec if launcher is None else codec.on_backend(launcher)


class Fp8UnitCodec:
    """One unit's fp8 gradient reduction and its residuals (see the module docstring)."""

    def __init__(self, codec: Fp8Codec) -> None:
        self.fallback = codec.fallback
        self._block = codec.settings.block
        self._scatter = codec.new_scatter()
        self._sum = codec.new_sum()
        self._last: Fp8Scatter | Fp8Sum = self._scatter

    def start_scatter(
        self, scatter_in: torch.Tensor, group: dist.ProcessGroup | None
    ) -> tuple[Any, Callable[[], torch.Tensor]]:
        """The fp8 reduce-scatter: its work and this rank's summed slot."""
        self._last = self._scatter
        return self._scatter.start(scatter_in, group)

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """The two-phase fp8 sum of ``tensor`` over ``group``."""
        self._last = self._sum
        return self._sum.run(tensor, group)

    def commit(self, ok: bool) -> None:
        """Keep (``ok``) or drop the last reduction's residuals."""
        self._last.commit(ok)

    def wire(self, role: str, numel: int, world: int) -> tuple[int, dict[str, int]]:
        """The fp8 ``role`` collective's size (the all_to_all's input; the quantized
        buffer of the two-phase sum, as an all-reduce counts it) and its calls' bytes."""
        if role == "scatter":
            handed = Fp8Scatter.wire(numel, world, self._block)
            return sum(handed.values()), handed
        return quantized_bytes(numel, world, self._block), Fp8Sum.wire(numel, world, self._block)

    def stats(self) -> dict[str, Any]:
        """The last reduction's statistics on this rank."""
        return dict(self._last.stats().as_dict())

    def residual_nbytes(self) -> int:
        """Bytes of the residuals held now."""
        return self._scatter.residual_nbytes() + self._sum.residual_nbytes()
