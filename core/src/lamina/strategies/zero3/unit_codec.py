"""Two-phase codecs for the sharded strategies: a unit's gradient reduction as the
engine calls it.

:class:`UnitCodec` is the :class:`~lamina.memory.compressed.GradientCodec` of one unit,
built from any :class:`~lamina.comm.codecs.TwoPhaseCodec` (fp8, or a plugin's): ZeRO-3
compresses the reduce-scatter over the shard group (the codec's ``new_scatter``), HSDP
the all-reduce of the shard gradient across the replicas, which is what crosses the slow
links (the codec's ``new_sum``). Either keeps its own error-feedback residual; nothing
here knows a codec's format.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lamina.comm.codecs import Codec, TwoPhaseCodec
from lamina.comm.two_phase import TwoPhaseScatter, TwoPhaseSum
from lamina.device.kernels import KernelLauncher
from lamina.errors import ConfigError
from lamina.strategies.codec_registry import resolve_codec


def sharded_codec(
    spec: str | Codec | None, launcher: KernelLauncher | None = None
) -> TwoPhaseCodec | None:
    """The sharded strategies' codec from ``codec=`` (on ``launcher``'s kernels): None,
    or a two-phase codec (ConfigError else)."""
    codec = resolve_codec(spec)
    if codec is None:
        return None
    if not isinstance(codec, TwoPhaseCodec):
        raise ConfigError(
            f"codec={codec.name!r}: zero3 and hsdp compress gradients with a two-phase codec "
            "only ('fp8', or a plugin's such as 'int8'); the cast codecs (bf16, fp16) are dp's"
        )
    if launcher is None:
        return codec
    on_backend = codec.on_backend(launcher)
    assert isinstance(on_backend, TwoPhaseCodec)
    return on_backend


class UnitCodec:
    """One unit's two-phase gradient reduction and its residuals (see the module
    docstring)."""

    def __init__(self, codec: TwoPhaseCodec, exact: tuple[int, int] | None = None) -> None:
        self.name = codec.name
        self.fallback = codec.fallback
        self._codec = codec
        #: the unit's used-flags in each slot and shard gradient: counts, sent exactly
        self._exact = exact
        self._exact_numel = exact[1] - exact[0] if exact is not None else 0
        self._scatter = codec.new_scatter(exact)
        self._sum = codec.new_sum(exact)
        self._last: TwoPhaseScatter | TwoPhaseSum = self._scatter

    def start_scatter(
        self, scatter_in: torch.Tensor, group: dist.ProcessGroup | None
    ) -> tuple[Any, Callable[[], torch.Tensor]]:
        """The codec's reduce-scatter: its work and this rank's summed slot."""
        self._last = self._scatter
        return self._scatter.start(scatter_in, group)

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """The codec's two-phase sum of ``tensor`` over ``group``."""
        self._last = self._sum
        return self._sum.run(tensor, group)

    def commit(self, ok: bool) -> None:
        """Keep (``ok``) or drop the last reduction's residuals."""
        self._last.commit(ok)

    def wire(self, role: str, numel: int, world: int) -> tuple[int, dict[str, int]]:
        """The ``role`` collective's size (the all_to_all's input; the quantized buffer of
        the two-phase sum, as an all-reduce counts it) and its calls' bytes."""
        if role == "scatter":
            handed = self._codec.scatter_wire(numel, world, self._exact_numel)
            return sum(handed.values()), handed
        wire = self._codec.wire(numel, world, self._exact_numel)
        return self._codec.nbytes(numel, world), wire

    def stats(self) -> dict[str, Any]:
        """The last reduction's statistics on this rank."""
        return dict(self._last.stats().as_dict())

    def residual_nbytes(self) -> int:
        """Bytes of the residuals held now."""
        return self._scatter.residual_nbytes() + self._sum.residual_nbytes()
