"""A plan node's typed detail as JSON-ready data and back (the plan's JSON, its
fingerprint's canonical form): the data read back equals the detail written; a malformed
field raises one ConfigError naming the node and the field."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from lamina.errors import ConfigError
from lamina.runtime.nodes import (
    COLLECTIVE_PURPOSES,
    DETAIL_OF_KIND,
    GATHER_SPANS,
    TRANSFER_PAYLOADS,
    AlgorithmFact,
    CodecFact,
    Collective,
    Compute,
    Free,
    Gather,
    NodeDetail,
    Slot,
    Transfer,
    UnitFact,
)


def detail_to_dict(detail: NodeDetail) -> dict[str, Any]:
    """``detail``'s fields, absent facts (None, no slots) left out, so that a plan's JSON
    shows what each node has."""
    return {
        k: v
        for k, v in asdict(detail).items()
        if v is not None and v != () and not (k == "layer" and v == "")
    }


def detail_from_dict(kind: str, data: dict[str, Any], node: str) -> NodeDetail:
    """The detail of a ``kind`` node called ``node`` from :func:`detail_to_dict`'s data."""
    detail_type = DETAIL_OF_KIND[kind]
    if detail_type is Compute:
        return Compute(
            unit=str(data.get("unit", "")),
            stage=_optional_int(data.get("stage")),
            microbatch=_optional_int(data.get("microbatch")),
            capture=str(data.get("capture", "")),
            mode=str(data.get("mode", "")),
            rank=_optional_int(data.get("rank")),
            seconds=None if data.get("seconds") is None else float(data["seconds"]),
            params=_optional_int(data.get("params")),
        )
    if detail_type is Collective:
        return Collective(
            purpose=_one_of(data["purpose"], COLLECTIVE_PURPOSES, "purpose", node),
            bucket=_optional_int(data.get("bucket")),
            unit=str(data.get("unit", "")),
            params=int(data.get("params", 0)),
            primitive=str(data.get("primitive", "")),
            algorithm=_algorithm(data.get("algorithm")),
            codec=_codec(data.get("codec")),
            source=_optional_int(data.get("source")),
            slots=tuple(_slot(d) for d in data.get("slots", ())),
            layer=str(data.get("layer", "")),
        )
    if detail_type is Gather:
        return Gather(
            unit=str(data["unit"]),
            span=_one_of(data["span"], GATHER_SPANS, "span", node),
            primitive=str(data.get("primitive", "all_gather")),
            frozen=bool(data.get("frozen", False)),
            algorithm=_algorithm(data.get("algorithm")),
            layout=_unit(data.get("layout")),
        )
    if detail_type is Free:
        return Free(unit=str(data["unit"]))
    return Transfer(
        peer=int(data["peer"]),
        stage=int(data["stage"]),
        microbatch=int(data["microbatch"]),
        what=_one_of(data["what"], TRANSFER_PAYLOADS, "what", node),
        dtype=str(data["dtype"]),
        numel=int(data["numel"]),
        element_size=int(data["element_size"]),
        axis=str(data.get("axis", "pp")),
    )


def _one_of(value: Any, allowed: tuple[str, ...], what: str, node: str) -> Any:
    """``value`` as text when it is one of ``allowed`` (a Literal's values)."""
    text = str(value)
    if text not in allowed:
        raise ConfigError(
            f"execution plan node {node!r}: {what} {text!r} is not one of {', '.join(allowed)}"
        )
    return text


def _algorithm(data: dict[str, Any] | None) -> AlgorithmFact | None:
    if data is None:
        return None
    predictions = tuple((str(name), float(s)) for name, s in data.get("predictions", ()))
    return AlgorithmFact(str(data["name"]), int(data.get("chunks", 1)), predictions)


def _codec(data: dict[str, Any] | None) -> CodecFact | None:
    if data is None:
        return None
    return CodecFact(
        str(data["name"]),
        str(data.get("scope", "all")),
        bool(data.get("error_feedback", False)),
        int(data.get("residual_bytes", 0)),
    )


def _unit(data: dict[str, Any] | None) -> UnitFact | None:
    if data is None:
        return None
    return UnitFact(
        int(data["index"]),
        str(data["dtype"]),
        tuple(_slot(d) for d in data["params"]),
        int(data["alignment_bytes"]),
    )


def _slot(data: dict[str, Any]) -> Slot:
    return Slot(str(data["name"]), tuple(int(d) for d in data["shape"]), int(data["offset"]))


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
