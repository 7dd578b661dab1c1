"""What a capture produces: node records, fall-back records and the captured graph itself.

Also the small helpers every capture path shares: turning a node value or a module output
into shapes/dtypes/device, and naming an op target with a string that does not depend on
the process (no memory addresses).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils import _pytree as pytree

from lamina.errors import LaminaError

CaptureMethod = Literal["export", "fx", "hooks"]
CAPTURE_METHODS: tuple[CaptureMethod, ...] = ("export", "fx", "hooks")

Shape = tuple[int, ...]
UNKNOWN_DIM = -1
"""Stands for a dimension whose size is symbolic (not known when the graph was captured)."""


class CaptureError(LaminaError, RuntimeError):
    """Every requested capture path failed; ``fallbacks`` holds each path's reason."""

    def __init__(self, message: str, fallbacks: tuple[CaptureFallback, ...] = ()) -> None:
        super().__init__(message)
        self.fallbacks = fallbacks


@dataclass(frozen=True)
class CaptureFallback:
    """One capture path that failed, and why (exception type and first line)."""

    method: CaptureMethod
    reason: str


@dataclass(frozen=True)
class NodeInfo:
    """One node of the captured graph with the metadata of its output(s)."""

    name: str
    op: str
    target: str
    shapes: tuple[Shape, ...]
    dtypes: tuple[str, ...]
    device: str | None


@dataclass(frozen=True)
class CapturedGraph:
    """A model's forward as lamina plans with it: nodes, parameters and their use order.

    Parameter names are canonical: a tensor reachable under several names (tied weights)
    appears once, under the first name ``model.named_parameters()`` gives it. Only
    trainable parameters (``requires_grad=True``) are listed.
    """

    method: CaptureMethod
    fallbacks: tuple[CaptureFallback, ...]
    nodes: tuple[NodeInfo, ...]
    param_names: tuple[str, ...]
    param_shapes: dict[str, Shape]
    param_dtypes: dict[str, str]
    first_use_order: tuple[str, ...]
    tied: tuple[tuple[str, ...], ...]
    unused: tuple[str, ...]
    fingerprint: str = field(default="")

    def grad_ready_order(self) -> tuple[str, ...]:
        """The order gradients become ready in backward: first use, reversed."""
        return tuple(reversed(self.first_use_order))

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict of every field (``from_json`` reads it back)."""
        return {
            "method": self.method,
            "fallbacks": [{"method": f.method, "reason": f.reason} for f in self.fallbacks],
            "nodes": [
                {
                    "name": n.name,
                    "op": n.op,
                    "target": n.target,
                    "shapes": [list(s) for s in n.shapes],
                    "dtypes": list(n.dtypes),
                    "device": n.device,
                }
                for n in self.nodes
            ],
            "param_names": list(self.param_names),
            "param_shapes": {k: list(v) for k, v in self.param_shapes.items()},
            "param_dtypes": dict(self.param_dtypes),
            "first_use_order": list(self.first_use_order),
            "tied": [list(g) for g in self.tied],
            "unused": list(self.unused),
            "fingerprint": self.fingerprint,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CapturedGraph:
        """The graph ``to_json`` described."""
        return cls(
            method=data["method"],
            fallbacks=tuple(CaptureFallback(f["method"], f["reason"]) for f in data["fallbacks"]),
            nodes=tuple(
                NodeInfo(
                    name=n["name"],
                    op=n["op"],
                    target=n["target"],
                    shapes=tuple(tuple(s) for s in n["shapes"]),
                    dtypes=tuple(n["dtypes"]),
                    device=n["device"],
                )
                for n in data["nodes"]
            ),
            param_names=tuple(data["param_names"]),
            param_shapes={k: tuple(v) for k, v in data["param_shapes"].items()},
            param_dtypes=dict(data["param_dtypes"]),
            first_use_order=tuple(data["first_use_order"]),
            tied=tuple(tuple(g) for g in data["tied"]),
            unused=tuple(data["unused"]),
            fingerprint=data["fingerprint"],
        )

    def summary(self) -> str:
        """One line: path taken, node/parameter counts, unused, tied and fall-backs."""
        fell = ", ".join(f"{f.method}: {f.reason}" for f in self.fallbacks) or "none"
        numel = sum(math.prod(s) for s in self.param_shapes.values())
        return (
            f"captured by {self.method}: {len(self.nodes)} nodes, "
            f"{len(self.param_names)} params ({numel:,} elements), "
            f"{len(self.unused)} unused, {len(self.tied)} tied groups, "
            f"fingerprint {self.fingerprint[:12]}; fallbacks: {fell}"
        )


def _dim(size: Any) -> int:
    if isinstance(size, int):
        return size
    try:
        return int(size)
    except Exception:  # a symbolic size that cannot be made concrete
        return UNKNOWN_DIM


def tensor_meta(value: Any) -> tuple[tuple[Shape, ...], tuple[str, ...], str | None]:
    """Shapes, dtypes and the device type of every tensor in a (nested) output value.

    Works for real tensors and for the fake tensors ``torch.export`` stores in
    ``node.meta["val"]``; anything that is not a tensor is skipped.
    """
    shapes: list[Shape] = []
    dtypes: list[str] = []
    device: str | None = None
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            shapes.append(tuple(_dim(s) for s in leaf.shape))
            dtypes.append(str(leaf.dtype))
            if device is None:
                device = leaf.device.type
    return tuple(shapes), tuple(dtypes), device


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a class or function; never a repr with an address in it."""
    module = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if name is None:
        name = type(obj).__qualname__
    if module in ("_operator", "builtins"):
        module = "operator" if module == "_operator" else ""
    return f"{module}.{name}" if module else str(name)


def op_target(target: Any) -> str:
    """The canonical string of an fx/export node target."""
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"  # type: ignore[no-untyped-call]
    return qualified_name(target)
