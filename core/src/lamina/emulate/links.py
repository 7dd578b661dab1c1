"""The shaped link of an emulated host: ``RATE[,delay=D][,loss=L]`` and its tc commands."""

from __future__ import annotations

import re
from dataclasses import dataclass

from lamina.errors import ConfigError

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_DELAY = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$")
_LOSS = re.compile(r"^(\d+(?:\.\d+)?)%$")
_BITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_EXAMPLE = "e.g. 200mbit or 1gbit,delay=2ms,loss=0.1%"


@dataclass(frozen=True)
class LinkSpec:
    """One host's uplink: ``rate`` (tc syntax, e.g. ``200mbit``), optional one-way
    ``delay`` (``2ms``) and ``loss`` (``0.1%``), applied in each direction."""

    rate: str
    delay: str | None = None
    loss: str | None = None

    @property
    def bits_per_second(self) -> float:
        """The rate in bit/s."""
        match = _RATE.match(self.rate)
        assert match is not None  # checked by parse_link
        return float(match.group(1)) * _BITS[match.group(2)]

    def qdisc_commands(self, device: str) -> list[list[str]]:
        """``tc`` commands that shape egress of ``device``: a token bucket at ``rate``
        (under a netem for delay and loss when asked for)."""
        rate_bytes = self.bits_per_second / 8
        burst = max(32 * 1024, int(rate_bytes / 250))  # ~4 ms of traffic, at least 32 KiB
        tbf = ["tbf", "rate", self.rate, "burst", str(burst), "latency", "100ms"]
        if self.delay is None and self.loss is None:
            return [["tc", "qdisc", "add", "dev", device, "root", "handle", "1:", *tbf]]
        netem = ["netem", "limit", "100000"]
        if self.delay is not None:
            netem += ["delay", self.delay]
        if self.loss is not None:
            netem += ["loss", self.loss]
        return [
            ["tc", "qdisc", "add", "dev", device, "root", "handle", "1:", *netem],
            ["tc", "qdisc", "add", "dev", device, "parent", "1:1", "handle", "10:", *tbf],
        ]

    def describe(self) -> str:
        """``200mbit`` or ``200mbit, delay 2ms, loss 0.1%``."""
        extra = [f"delay {self.delay}"] if self.delay else []
        extra += [f"loss {self.loss}"] if self.loss else []
        return ", ".join([self.rate, *extra])


def parse_link(text: str) -> LinkSpec:
    """``RATE[,delay=D][,loss=L]`` -> :class:`LinkSpec` (ConfigError naming what is wrong)."""
    rate, *options = [part.strip() for part in text.strip().lower().split(",")]
    if not _RATE.match(rate) or float(_RATE.match(rate).group(1)) <= 0:  # type: ignore[union-attr]
        raise ConfigError(f"--link {text!r}: {rate!r} is not a rate; {_EXAMPLE}")
    values: dict[str, str] = {}
    for option in options:
        key, _, value = option.partition("=")
        if key not in ("delay", "loss") or not value:
            raise ConfigError(f"--link {text!r}: {option!r} is not delay=D or loss=L; {_EXAMPLE}")
        if key in values:
            raise ConfigError(f"--link {text!r} gives {key} twice; give it once")
        pattern = _DELAY if key == "delay" else _LOSS
        if not pattern.match(value):
            unit = "a time like 2ms or 500us" if key == "delay" else "a percentage like 0.1%"
            raise ConfigError(f"--link {text!r}: {key}={value!r} is not {unit}")
        if key == "loss" and float(value[:-1]) > 100:
            raise ConfigError(f"--link {text!r}: loss={value} is over 100%")
        values[key] = value
    return LinkSpec(rate, values.get("delay"), values.get("loss"))
