"""Host topology from the PJRT runtime's device attributes.

On TPU, PJRT describes each chip with ``coords`` (its place in the slice's ICI mesh or
torus), ``core_on_chip`` and, in a multislice job, ``slice_index``. Chips of one slice
talk over ICI, so ranks of this host are joined by an ``"ici"`` link; its figure comes
from the Cloud TPU spec sheets (bidirectional ICI bandwidth per chip, split over the
chip's ICI ports and the two directions) and is labelled ``"estimated"``. Chips that
sit next to each other in the mesh get explicit local links.

On PJRT CPU there is one host and no interconnect: the host is described as the CPU
backend describes it (name, NUMA), with the XLA device indices.

The functions here are pure (attributes in, HostTopology out) so that recorded
attributes can test them without a TPU.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lamina.device.topology import DEFAULT_SHM_LINK, HostTopology, LinkProfile, LocalLink


@dataclass(frozen=True)
class IciSpec:
    """Published ICI figures of one TPU generation."""

    generation: str
    bidirectional_gbytes_per_chip: float
    ports: int
    source: str

    def link(self) -> LinkProfile:
        """One ICI port, one direction: per-chip bandwidth / ports / 2 (GB/s)."""
        per_link = self.bidirectional_gbytes_per_chip / self.ports / 2
        return LinkProfile(per_link, DEFAULT_SHM_LINK.latency_us, "ici", "estimated")


#: PJRT device kind -> ICI figures from https://cloud.google.com/tpu/docs/<generation>.
ICI_SPECS: dict[str, IciSpec] = {
    "TPU v5 lite": IciSpec("v5e", 400.0, 4, "cloud.google.com/tpu/docs/v5e"),
    "TPU v5": IciSpec("v5p", 1200.0, 6, "cloud.google.com/tpu/docs/v5p"),
    "TPU v6 lite": IciSpec("v6e", 800.0, 4, "cloud.google.com/tpu/docs/v6e"),
}

_DEVICE_NAME = re.compile(r"([A-Za-z]+):(\d+)")


@dataclass(frozen=True)
class ChipAttributes:
    """One PJRT device as its attributes describe it."""

    name: str
    ordinal: int
    coords: tuple[int, ...] | None
    core_on_chip: int | None
    slice_index: int | None


def parse_device_attributes(attrs: Mapping[str, Any]) -> ChipAttributes:
    """Read one entry of ``torch_xla.runtime.global_runtime_device_attributes()``.

    ValueError naming the entry when ``name`` is not ``TYPE:N``.
    """
    name = str(attrs.get("name", ""))
    match = _DEVICE_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"PJRT device attributes {dict(attrs)!r} have no 'TYPE:N' name")
    raw = attrs.get("coords")
    coords = tuple(int(c) for c in raw) if isinstance(raw, (list, tuple)) else None
    core = attrs.get("core_on_chip")
    slice_index = attrs.get("slice_index")
    return ChipAttributes(
        name,
        int(match.group(2)),
        coords,
        int(core) if core is not None else None,
        int(slice_index) if slice_index is not None else None,
    )


def ici_neighbours(a: ChipAttributes, b: ChipAttributes) -> bool:
    """True when ``a`` and ``b`` are different chips one ICI hop apart in one slice."""
    if a.coords is None or b.coords is None or len(a.coords) != len(b.coords):
        return False
    if a.slice_index != b.slice_index:
        return False
    return sum(abs(x - y) for x, y in zip(a.coords, b.coords, strict=True)) == 1


def _describe(chip: ChipAttributes) -> str:
    parts = [chip.name]
    if chip.coords is not None:
        parts.append(f"coords {chip.coords}")
    if chip.core_on_chip is not None:
        parts.append(f"core {chip.core_on_chip}")
    if chip.slice_index is not None:
        parts.append(f"slice {chip.slice_index}")
    return ", ".join(parts)


def xla_host_topology(
    base: HostTopology,
    *,
    pjrt_device_type: str,
    device_kind: str,
    local: Sequence[str],
    own_index: int,
    first_index: int,
    attributes: Sequence[Mapping[str, Any]],
) -> HostTopology:
    """This process's HostTopology on an XLA device.

    ``base`` is the CPU view of the host (name, NUMA); ``local`` the PJRT devices this
    process addresses (``"TPU:3"``), in ``xla:N`` order, of which it uses
    ``local[own_index]``; ``first_index`` is the host-wide index of ``local[0]`` (the
    local ordinal of ``xla:0``); ``attributes`` the runtime's attributes of every device.
    """
    if not 0 <= own_index < len(local):
        raise ValueError(f"own_index {own_index} is outside the {len(local)} local device(s)")
    own = local[own_index]
    chips = {c.name: c for c in (parse_device_attributes(a) for a in attributes)}
    notes = [n for n in base.notes if "NUMA" in n]
    notes.append(
        f"{pjrt_device_type} device {own} ({device_kind}) from PJRT, "
        f"{len(attributes)} device(s) in the job, {len(local)} addressed by this process"
    )
    fields: dict[str, Any] = {
        "device_type": "xla",
        "device_index": first_index + own_index,
        "local_links": (),
        "fast_groups": (),
    }
    if pjrt_device_type != "TPU":
        notes.append(f"PJRT {pjrt_device_type}: one host, no inter-chip interconnect")
        return dataclasses.replace(base, notes=tuple(notes), **fields)
    mine = chips.get(own)
    if mine is not None:
        notes.append(f"this chip: {_describe(mine)}")
    spec = ICI_SPECS.get(device_kind)
    if spec is not None:
        profile = spec.link()
        notes.append(
            f"ICI {spec.generation}: {spec.bidirectional_gbytes_per_chip:g} GB/s per chip "
            f"over {spec.ports} ports ({spec.source}) -> {profile.bandwidth_gbps:g} GB/s per "
            "link and direction, estimated; chips further apart share links on the way"
        )
    else:
        smallest = min(ICI_SPECS.values(), key=lambda s: s.link().bandwidth_gbps)
        profile = smallest.link()
        notes.append(
            f"no published ICI figure known for {device_kind!r}; using the smallest known "
            f"({smallest.generation}, {profile.bandwidth_gbps:g} GB/s per link), estimated"
        )
    addressed = [(i, chips[n]) for i, n in enumerate(local) if n in chips]
    links = tuple(
        LocalLink(first_index + i, first_index + j, profile)
        for i, a in addressed
        for j, b in addressed
        if i < j and ici_neighbours(a, b)
    )
    notes.append("chips on other hosts of the slice are reached over ICI too (not modelled)")
    fields.update(local_links=links, intra_host_default=profile)
    return dataclasses.replace(base, notes=tuple(notes), **fields)
