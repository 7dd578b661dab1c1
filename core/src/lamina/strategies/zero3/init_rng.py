"""Random initializers on sharded parameters draw what the unsharded model would draw.

An initializer run on a ``zero3`` / ``hsdp`` parameter (``reset_parameters``, torch's
``nn.init`` functions, transformers' ``init_weights``) reaches ``DTensor``'s in-place
``normal_`` / ``uniform_``. On its own, DTensor draws each rank's shard from that rank's
generator (on the CPU; CUDA offsets each shard instead): with the same seed on every
rank, every shard of a parameter would repeat the same values. For parameters whose
local shard lives in a lamina shard buffer, this module draws the whole tensor from the
generator (the one passed, or the default) and keeps this rank's rows. So, when every
rank seeds its generator the same, a sharded initializer gives bit for bit the weights
the same initializer gives the unsharded model from that generator state, on any world
size, and the generators end in the same state. The price is one whole parameter of
transient memory per call. Other DTensors keep DTensor's own behaviour.

The hook is a handler in DTensor's dispatcher table (``_custom_op_handlers``, the table
torch's own loss and context parallelism extend); it is installed once, chains to a
handler that was there before, and recognizes lamina's parameters by the storage of
their local shard (a registry of live shard buffers, held by weak reference).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

if TYPE_CHECKING:
    from lamina.memory.engine import UnitState

_aten = torch.ops.aten
#: The in-place random fills initializers use (``nn.init`` builds every random
#: initializer on them: kaiming, xavier, trunc_normal, ...).
_OPS = (_aten.normal_.default, _aten.uniform_.default)

#: data_ptr of a live shard buffer's storage -> that buffer.
_SHARD_STORAGES: dict[int, weakref.ref[torch.Tensor]] = {}
#: The handler each op had before ours (None: DTensor's default path).
_PREVIOUS: dict[Any, Any] = {}


def register_shards(units: Iterable[UnitState]) -> None:
    """Mark ``units``' shard buffers as lamina's (and install the handler once)."""
    for ptr in [p for p, ref in _SHARD_STORAGES.items() if ref() is None]:
        del _SHARD_STORAGES[ptr]
    for unit in units:
        if not unit.shard.is_meta:
            _SHARD_STORAGES[unit.shard.untyped_storage().data_ptr()] = weakref.ref(unit.shard)
    _install()


def _install() -> None:
    handlers: dict[Any, Any] = DTensor._op_dispatcher._custom_op_handlers
    for op in _OPS:
        if handlers.get(op) is not _full_draw:
            _PREVIOUS[op] = handlers.get(op)
            handlers[op] = _full_draw


def _is_lamina_shard(tensor: object) -> bool:
    if not isinstance(tensor, DTensor):
        return False
    local = tensor._local_tensor
    if local.is_meta:
        return False
    ptr = local.untyped_storage().data_ptr()
    ref = _SHARD_STORAGES.get(ptr)
    buffer = ref() if ref is not None else None
    return buffer is not None and buffer.untyped_storage().data_ptr() == ptr


def _full_draw(op: Any, args: tuple[object, ...], kwargs: dict[str, object]) -> Any:
    """Fill the whole tensor as the unsharded parameter would be filled, keep this
    rank's part; anything else goes where it went before."""
    target = args[0]
    if not _is_lamina_shard(target):
        return _default(op, args, kwargs)
    assert isinstance(target, DTensor)
    local = target._local_tensor
    shape, offset = compute_local_shape_and_global_offset(
        target.shape, target.device_mesh, target.placements
    )
    with torch.no_grad():
        whole = torch.empty(target.shape, dtype=target.dtype, device=local.device)
        op(whole, *args[1:], **kwargs)
        part = whole[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        local.copy_(part)
    return target


def _default(op: Any, args: tuple[object, ...], kwargs: dict[str, object]) -> Any:
    previous = _PREVIOUS.get(op)
    if previous is not None:
        return previous(op, args, kwargs)
    handlers: dict[Any, Any] = DTensor._op_dispatcher._custom_op_handlers
    handlers.pop(op, None)
    try:
        return op(*args, **kwargs)
    finally:
        handlers[op] = _full_draw
