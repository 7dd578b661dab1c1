"""Leave a model exactly as capture found it: buffers, parameters, modes and RNG state.

The fx and hook paths run the forward on real tensors (BatchNorm updates its running
statistics, dropout draws random numbers); :func:`preserved` undoes all of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def _device_rng_states(model: nn.Module) -> dict[str, Any]:
    """RNG states of the accelerators the model lives on, and of CUDA when initialized.

    A device type counts when ``torch.<type>`` offers ``get_rng_state_all`` (cuda, xpu,
    npu once torch_npu is loaded); others (XLA keeps its RNG in torch_xla) are left alone.
    """
    states: dict[str, Any] = {}
    types = {t.device.type for t in [*model.parameters(), *model.buffers()]}
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        types.add("cuda")
    for kind in sorted(types - {"cpu", "meta"}):
        module = getattr(torch, kind, None)
        get_all = getattr(module, "get_rng_state_all", None)
        if get_all is not None and hasattr(module, "set_rng_state_all"):
            try:
                states[kind] = get_all()
            except Exception:  # the device module cannot report its RNG: leave it alone
                continue
    return states


def _restore_device_rng_states(states: dict[str, Any]) -> None:
    for kind, state in states.items():
        getattr(torch, kind).set_rng_state_all(state)


@contextmanager
def preserved(model: nn.Module) -> Iterator[None]:
    """Run the block, then restore ``model``'s buffers, tensors slots, modes and RNGs.

    Buffer values are copied back into the original buffer objects; parameter and buffer
    slots that the block re-assigned get their original tensor objects back; every
    module's ``training`` flag is restored; so are the CPU and accelerator RNG states.
    """
    modules = list(model.modules())
    training = [m.training for m in modules]
    params = [(m, dict(m._parameters)) for m in modules]
    buffers = [(m, dict(m._buffers)) for m in modules]
    with torch.no_grad():
        values = {id(b): b.detach().clone() for b in model.buffers() if b is not None}
    cpu_rng = torch.get_rng_state()
    device_rng = _device_rng_states(model)
    try:
        yield
    finally:
        with torch.no_grad():
            for module, slots in params:
                for name, param in slots.items():
                    if module._parameters.get(name) is not param:
                        module._parameters[name] = param
            for module, buffer_slots in buffers:
                for name, tensor in buffer_slots.items():
                    if module._buffers.get(name) is not tensor:
                        module._buffers[name] = tensor
                    if tensor is not None and id(tensor) in values:
                        tensor.copy_(values[id(tensor)])
        for module, flag in zip(modules, training, strict=True):
            module.training = flag
        torch.set_rng_state(cpu_rng)
        _restore_device_rng_states(device_rng)
