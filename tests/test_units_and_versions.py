"""The one byte format and the one installed-version lookup every output uses."""

from __future__ import annotations

import pluggy
import pytest

from lamina.units import format_bytes
from lamina.versions import package_version


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (4096.0, "4 KiB"),
        (776 * 1024, "776 KiB"),
        (793_600, "775 KiB"),
        (794_112, "775.5 KiB"),
        (int(3.2 * 2**20), "3.2 MiB"),
        (1024 * 1024 - 1, "1.0 MiB"),  # rounds to 1024 KiB: shown in the next unit
        (64 * 2**30, "64 GiB"),
        (3 * 2**40, "3 TiB"),
        (2048 * 2**40, "2048 TiB"),
        (-2048, "-2 KiB"),
    ],
)
def test_format_bytes(n: float, text: str) -> None:
    assert format_bytes(n) == text


def test_package_version_reads_metadata_or_says_none() -> None:
    assert package_version("pluggy") == pluggy.__version__
    assert package_version("lamina-core") is not None
    assert package_version("no-such-distribution-for-lamina") is None
