"""The multi-process test harness: results by rank, failures, deaths and timeouts."""

from __future__ import annotations

import os
import time

import pytest

from lamina.testing import RankFailure, RankTimeout, free_port, run_ranks

pytestmark = pytest.mark.multiprocess


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


def _return_none() -> None:
    return None


def _read_env(name: str) -> str | None:
    return os.environ.get(name)


def test_timeout_kills_every_rank_and_names_the_stuck_one() -> None:
    run_ranks(_return_none, 2, timeout=120)  # the forkserver is up: rank 1 reports at once
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(_sleep_on_rank_zero, 2, timeout=4)
    elapsed = time.monotonic() - start
    assert info.value.ranks == [0]
    assert "rank(s) [0] still running after 4 s; killed" in str(info.value)
    # not before the timeout; after it, only the 0.1 s poll and the kill (5 s join at most)
    assert 4 <= elapsed < 4 + 30


def test_ranks_see_the_callers_environment_at_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    run_ranks(_return_none, 1, timeout=120)  # the forkserver started before the variable
    monkeypatch.setenv("LAMINA_HARNESS_PROBE", "set-after-start")
    assert run_ranks(_read_env, 2, args=("LAMINA_HARNESS_PROBE",), timeout=120) == [
        "set-after-start",
        "set-after-start",
    ]
    monkeypatch.delenv("LAMINA_HARNESS_PROBE")
    assert run_ranks(_read_env, 1, args=("LAMINA_HARNESS_PROBE",), timeout=120) == [None]


def test_spawn_start_method_and_an_unknown_one() -> None:
    results = run_ranks(_report_env, 2, env={"EXTRA": "x"}, timeout=120, start_method="spawn")
    assert results == [(0, 2, "x"), (1, 2, "x")]
    with pytest.raises(ValueError, match="start_method 'fork' is not usable here; choose one of"):
        run_ranks(_return_none, 1, start_method="fork")


def test_rank_dying_without_report_fails_the_run() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_die_without_report, 2, timeout=60)
    assert info.value.rank == 1 and "exit code 7" in str(info.value)


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_free_port_is_outside_the_ephemeral_range() -> None:
    """Outgoing connections and gloo's listeners take ephemeral ports: a rendezvous port
    picked from that range was taken before rank 0 could listen on it (EADDRINUSE)."""
    from lamina.testing.harness import ephemeral_port_range

    low, high = ephemeral_port_range()
    ports = {free_port() for _ in range(20)}
    assert all(not low <= port <= high for port in ports), (sorted(ports), low, high)
    assert len(ports) > 1  # random picks: concurrent jobs rarely meet
