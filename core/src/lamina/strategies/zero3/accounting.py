"""Per-rank memory of a ZeRO-3 model, measured and set against the ZeRO-3 formula.

ZeRO-3 (Rajbhandari et al.) keeps ``(P + G + K) * Psi / N`` bytes of model state per
rank: ``Psi`` parameters, ``P`` and ``G`` bytes per parameter and per gradient element,
``K`` bytes of optimizer state per parameter, ``N`` ranks. With fp32 parameters and
AdamW (two fp32 moments) that is ``(4 + 4 + 8) * Psi / N``. The measured figures count
the shards this rank really holds (alignment padding included), so the measured total
exceeds the formula by about the padding fraction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lamina.units import format_bytes

if TYPE_CHECKING:
    from lamina.strategies.zero3.module import ShardedModule


@dataclass(frozen=True)
class MemoryAccount:
    """One rank's model-state bytes, and the ZeRO-3 formula for the same model."""

    rank: int
    world_size: int
    #: Psi: parameters in the shard layout, without padding.
    param_count: int
    #: Elements this rank's shards hold (padding included).
    local_numel: int
    parameter_bytes: int
    gradient_bytes: int
    #: Every optimizer state tensor of this rank's shards (per-element and scalar).
    optimizer_bytes: int
    #: P: bytes per parameter element (averaged over units if their dtypes differ).
    param_element_size: float
    #: G: bytes per gradient element (the parameter dtype's).
    grad_element_size: float
    #: K: bytes of per-element optimizer state per local element (AdamW fp32: 8).
    optimizer_bytes_per_param: float

    @property
    def measured_total(self) -> int:
        """Parameter, gradient and optimizer state bytes this rank holds."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes

    @property
    def formula(self) -> float:
        """``(P + G + K) * Psi / N`` in bytes."""
        per_param = self.param_element_size + self.grad_element_size
        per_param += self.optimizer_bytes_per_param
        return per_param * self.param_count / self.world_size

    @property
    def ratio(self) -> float:
        """Measured total over the formula (1.0 plus padding, for a model that has run)."""
        return self.measured_total / self.formula if self.formula else float("nan")

    @property
    def padding_fraction(self) -> float:
        """Padding elements over ``Psi``, across all ranks' shards."""
        padded = self.local_numel * self.world_size
        return (padded - self.param_count) / self.param_count if self.param_count else 0.0

    def table(self) -> str:
        """A readable table of the measured bytes against the formula."""
        p, g, k = self.param_element_size, self.grad_element_size, self.optimizer_bytes_per_param
        rows = [
            ("parameters", format_bytes(self.parameter_bytes), f"{self.parameter_bytes:,} B"),
            ("gradients", format_bytes(self.gradient_bytes), f"{self.gradient_bytes:,} B"),
            ("optimizer state", format_bytes(self.optimizer_bytes), f"{self.optimizer_bytes:,} B"),
            ("measured total", format_bytes(self.measured_total), f"{self.measured_total:,} B"),
            (
                "ZeRO-3 (P+G+K)Psi/N",
                format_bytes(self.formula),
                f"({p:g}+{g:g}+{k:g}) x {self.param_count:,} / {self.world_size}",
            ),
            ("measured / formula", f"{self.ratio:.4f}", f"padding {self.padding_fraction:.2%}"),
        ]
        width = max(len(r[0]) for r in rows)
        size = max(len(r[1]) for r in rows)
        head = f"rank {self.rank} of {self.world_size}: model state per rank"
        return "\n".join([head, *(f"{a:<{width}}  {b:>{size}}  {c}" for a, b, c in rows)])


def memory_accounting(
    model: ShardedModule, optimizer: torch.optim.Optimizer | None = None
) -> MemoryAccount:
    """Measure this rank's parameter, gradient and optimizer-state bytes of ``model``.

    Parameters are the units' shard buffers (row padding, flags and alignment
    included). Gradients are counted where they exist: call it after ``backward`` (or
    ``step``) and before ``zero_grad(set_to_none=True)`` to see them. Optimizer state is
    counted for the sharded parameters only; ``K`` counts state tensors with one value
    per element of the local shard (AdamW's moments), not scalars such as ``step``.
    """
    engine = model.lamina_engine
    params = [p for unit in engine.units for p in unit.params.values()]
    ids = {id(p) for p in params}
    local = sum(_local(p).numel() for p in params)
    param_bytes = sum(unit.shard.numel() * unit.shard.element_size() for unit in engine.units)
    grad_bytes = sum(
        _local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None
    )
    state_bytes = per_element = 0
    if optimizer is not None:
        for param, per_param in optimizer.state.items():
            if not isinstance(param, torch.Tensor) or id(param) not in ids:
                continue
            for value in per_param.values():
                if isinstance(value, torch.Tensor):
                    size = _local(value).numel() * value.element_size()
                    state_bytes += size
                    if _local(value).numel() == _local(param).numel():
                        per_element += size
    units = model.lamina_layout.units
    psi = sum(u.param_numel for u in units)
    weighted = sum(u.param_numel * u.element_size for u in units)
    elem = weighted / psi if psi else 0.0
    return MemoryAccount(
        rank=dist.get_rank(model.lamina_sharding.group),
        world_size=model.lamina_layout.world_size,
        param_count=psi,
        local_numel=sum(u.shard_numel for u in units),
        parameter_bytes=param_bytes,
        gradient_bytes=grad_bytes,
        optimizer_bytes=state_bytes,
        param_element_size=elem,
        grad_element_size=elem,
        optimizer_bytes_per_param=per_element / local if local else 0.0,
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    local: torch.Tensor = getattr(tensor, "_local_tensor", tensor)
    return local
