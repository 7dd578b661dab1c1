"""The multi-process test harness: results by rank, failures, deaths and timeouts."""

from __future__ import annotations

import os
import time

import pytest

from lamina.testing import RankFailure, RankTimeout, free_port, run_ranks


def _report_env() -> tuple[int, int, str]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["EXTRA"]


def _sleep_on_rank_zero() -> None:
    if os.environ["RANK"] == "0":
        time.sleep(60)


def _die_without_report() -> None:
    if os.environ["RANK"] == "1":
        os._exit(7)


def test_results_come_back_in_rank_order() -> None:
    results = run_ranks(
        _report_env, 3, env={"EXTRA": "all"}, rank_env=lambda r: {"EXTRA": f"r{r}"}, timeout=60
    )
    assert results == [(0, 3, "r0"), (1, 3, "r1"), (2, 3, "r2")]


def test_timeout_kills_every_rank_and_names_the_stuck_one() -> None:
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(_sleep_on_rank_zero, 2, timeout=20)  # room for a slow spawn under load
    assert info.value.ranks == [0]
    assert time.monotonic() - start < 45


def test_rank_dying_without_report_fails_the_run() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_die_without_report, 2, timeout=60)
    assert info.value.rank == 1 and "exit code 7" in str(info.value)


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
