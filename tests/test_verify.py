"""Pre-flight verification: manifests, diffs, and the bounded cross-rank check on real ranks."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lamina.errors import ConfigError, VerificationError
from lamina.graph import capture
from lamina.memory.layout import build_layout
from lamina.strategies.dp.plan import graph_lines
from lamina.strategies.zero3.plan import shard_lines
from lamina.testing.harness import run_ranks
from lamina.verify import (
    Difference,
    Manifest,
    build_manifest,
    find_differences,
    format_mismatch,
    mesh_lines,
    parameter_lines,
    preflight,
    verify_timeout,
)
from lamina.verify.preflight import GRACE

pytestmark = pytest.mark.portable


class Net(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(16, hidden)
        self.out = nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.out(torch.relu(self.fc(x)))
        return y


def manifest_of(rank: int, world: int = 2, hidden: int = 32, plan: bool = True) -> Manifest:
    """Every category of a Net's manifest (module level: ranks call it)."""
    torch.manual_seed(0)
    model = Net(hidden)
    graph = capture(model, (torch.randn(2, 16),), methods=("fx",))
    return build_manifest(
        rank,
        world_size=world,
        backend="cpu",
        collective_backend="gloo",
        mesh=mesh_lines((world,), ("dp",)),
        module=model,
        extra=[("graph", graph_lines(graph)), ("shards", shard_lines(build_layout(model, world)))],
        plan_lines=["all_reduce grads[0]", "all_reduce grads[1]"] if plan else None,
    )


def simple(rank: int, **lines: tuple[str, ...]) -> Manifest:
    return Manifest(rank, tuple(lines.items()))


# --- manifests and diffs (one process) ---------------------------------------------------


def test_manifest_lines_digests_and_round_trip() -> None:
    m = manifest_of(0)
    # the core categories, the strategy's own (graph, shards) before the plan
    assert m.categories == ("world", "backend", "mesh", "parameters", "graph", "shards", "plan")
    assert m.lines("parameters")[0] == "fc.weight: [32, 16] float32 requires_grad=True"
    assert m.lines("graph")[0] == "captured by fx"
    assert all("fc.weight@0" in line or "out." in line for line in m.lines("shards"))
    assert len(m.digest_bytes()) == 32
    assert Manifest.from_dict(m.to_dict()) == m
    partial = simple(0, world=("world_size=2",))
    assert set(partial.digests()) == {"world"}
    # a category's name counts: the same lines under another name give another digest
    assert simple(0, weather=("world_size=2",)).digest_bytes() != partial.digest_bytes()
    with pytest.raises(ConfigError, match="manifest categories must be distinct"):
        Manifest(0, (("world", ("a",)), ("world", ("b",))))


def test_lines_are_deterministic() -> None:
    torch.manual_seed(1)
    a, b = Net(), Net()  # different values, same structure
    assert parameter_lines(a) == parameter_lines(b)
    x = torch.randn(3, 16)
    assert graph_lines(capture(a, (x,))) == graph_lines(capture(b, (x,)))
    assert shard_lines(build_layout(a, 4)) == shard_lines(build_layout(b, 4))
    assert manifest_of(0).digest_bytes() == manifest_of(0).digest_bytes()
    assert parameter_lines(a) != parameter_lines(Net(48))


def test_identical_manifests_have_no_difference() -> None:
    assert find_differences([manifest_of(r, world=3) for r in range(3)]) == []


def test_one_rank_with_a_different_parameter_is_named_with_both_values() -> None:
    manifests = [manifest_of(0, 3), manifest_of(1, 3, hidden=48), manifest_of(2, 3)]
    diffs = find_differences(manifests)
    first = diffs[0]
    assert (first.category, first.ranks, first.reference_rank, first.index) == (
        "parameters",
        (1,),
        0,
        0,
    )
    assert first.reference == "fc.weight: [32, 16] float32 requires_grad=True"
    assert first.other == "fc.weight: [48, 16] float32 requires_grad=True"
    assert [d.category for d in diffs] == ["parameters", "graph", "shards"]
    message = format_mismatch(diffs)
    assert "\n" not in message
    assert message.startswith(
        "pre-flight verification failed: rank(s) [1] differ from rank 0 in parameters at item 0: "
        "rank 0 has 'fc.weight: [32, 16] float32 requires_grad=True', "
        "rank 1 has 'fc.weight: [48, 16] float32 requires_grad=True' (also differ: graph, shards)"
    )
    assert message.endswith("run the same script, configuration and world size on every rank")


def test_ranks_that_differ_the_same_way_are_grouped() -> None:
    base = ("a: 1", "b: 2", "c: 3", "d: 4")
    changed = ("a: 1", "b: 2", "c: 3", "d: 5")
    manifests = [simple(r, parameters=changed if r in (1, 3) else base) for r in (3, 2, 1, 0)]
    manifests.append(simple(4, parameters=("a: 9",)))
    diffs = find_differences(manifests)
    assert diffs == [
        Difference("parameters", (1, 3), 0, 3, "d: 4", "d: 5"),
        Difference("parameters", (4,), 0, 0, "a: 1", "a: 9"),
    ]
    assert "rank(s) [1, 3] differ from rank 0 in parameters at item 3" in format_mismatch(diffs)
    assert "(also differ: parameters (rank(s) [4]))" in format_mismatch(diffs)


def test_shorter_lists_and_missing_categories_show_absent() -> None:
    diffs = find_differences(
        [simple(0, plan=("x", "y")), simple(1, plan=("x",)), simple(2, plan=("x", "y"), graph=())]
    )
    # the reference rank's categories first, then those only other ranks hold
    assert diffs == [
        Difference("plan", (1,), 0, 1, "y", "<absent>"),
        Difference("graph", (2,), 0, 0, "<absent>", "<empty>"),
    ]
    no_plan = find_differences([simple(0, plan=("p",)), simple(1, world=("w",))])
    assert Difference("plan", (1,), 0, 0, "p", "<absent>") in no_plan
    assert "rank 1 has <absent>" in format_mismatch(no_plan[:1])


def test_long_values_are_cut_around_the_change() -> None:
    a = "unit 0 big: params=[" + ", ".join(f"p{i}@{i * 128}" for i in range(100)) + "]"
    b = a.replace("p90@", "q90@")
    message = format_mismatch(find_differences([simple(0, shards=(a,)), simple(1, shards=(b,))]))
    assert "q90@" in message and "p90@" in message
    assert len(message) < 2 * 170 + 250


def test_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LAMINA_VERIFY_TIMEOUT", raising=False)
    assert verify_timeout() == 120.0
    monkeypatch.setenv("LAMINA_VERIFY_TIMEOUT", "7.5")
    assert verify_timeout() == 7.5 and verify_timeout(2) == 2.0
    for bad in ("soon", "0", "-3", "inf"):
        monkeypatch.setenv("LAMINA_VERIFY_TIMEOUT", bad)
        with pytest.raises(ConfigError, match="LAMINA_VERIFY_TIMEOUT"):
            verify_timeout()


def test_single_process_has_nothing_to_compare() -> None:
    report = preflight(manifest_of(0, world=1))
    assert report.world_size == 1 and "nothing to compare" in report.summary()


# --- real ranks ----------------------------------------------------------------------------


def _preflight_or_message(manifest: Manifest) -> tuple[str, float]:
    started = time.monotonic()
    try:
        return preflight(manifest).summary(), time.monotonic() - started
    except VerificationError as exc:
        return str(exc), time.monotonic() - started


def agreeing_rank() -> tuple[str, float, str, float]:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    control = dist.new_group(backend="gloo")
    first = preflight(manifest_of(rank, world), group=control)
    again, seconds = _preflight_or_message(manifest_of(rank, world, plan=False))
    return first.summary(), first.seconds, again, seconds


def mismatching_rank() -> tuple[str, float]:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    return _preflight_or_message(manifest_of(rank, world, hidden=48 if rank == 1 else 32))


def rank_two_never_arrives() -> tuple[str, float]:
    dist.init_process_group("gloo")
    manifest = manifest_of(dist.get_rank(), 3)
    dist.barrier()  # start together: the timings below then mean what they say
    if dist.get_rank() == 2:
        time.sleep(verify_timeout() + 1)  # alive, but never arrives
        return "skipped", 0.0
    if dist.get_rank() == 1:  # rank 0, which hosts the store, gives up first and exits first
        time.sleep(0.25)
    return _preflight_or_message(manifest)


def rank_two_arrives_late() -> tuple[str, float]:
    dist.init_process_group("gloo")
    manifest = manifest_of(dist.get_rank(), 3)
    dist.barrier()  # ranks 0 and 1 arrive together, well within the timeout
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 2:  # arrives only once both others have given up: no race
        store.wait(["test/gave_up/0", "test/gave_up/1"], timedelta(seconds=60))
    result = _preflight_or_message(manifest)
    if dist.get_rank() != 2:
        store.set(f"test/gave_up/{dist.get_rank()}", "1")
    dist.barrier()  # rank 0 keeps hosting the store until rank 2 has its verdict
    return result


#: Arrival timeout of the jobs whose ranks all arrive: a check that waited it out (instead
#: of passing or failing on the digests) would take at least this long.
ARRIVAL_TIMEOUT_S = 120.0


@pytest.mark.multiprocess
@pytest.mark.timeout(360)
def test_agreeing_ranks_pass_quickly() -> None:
    env = {"LAMINA_VERIFY_TIMEOUT": f"{ARRIVAL_TIMEOUT_S:g}"}
    results = run_ranks(agreeing_rank, 2, env=env, timeout=300)
    for summary, seconds, again, again_seconds in results:
        assert summary.startswith(
            "pre-flight verification: 2 ranks agree on world, backend, mesh, parameters, graph, "
            "shards, plan ("
        )
        # never waited for the timeout (measured 0.002-0.6 s at load average 4.5 on 2 cores)
        assert seconds < ARRIVAL_TIMEOUT_S and again_seconds < ARRIVAL_TIMEOUT_S
        assert again.startswith("pre-flight verification: 2 ranks agree on") and "plan" not in again


@pytest.mark.multiprocess
@pytest.mark.timeout(360)
def test_a_differing_rank_fails_every_rank_with_the_same_message() -> None:
    env = {"LAMINA_VERIFY_TIMEOUT": f"{ARRIVAL_TIMEOUT_S:g}"}
    results = run_ranks(mismatching_rank, 3, env=env, timeout=300)
    messages = {message for message, _ in results}
    assert len(messages) == 1, messages
    (message,) = messages
    assert "rank(s) [1] differ from rank 0 in parameters at item 0" in message
    assert "rank 0 has 'fc.weight: [32, 16] float32 requires_grad=True'" in message
    assert "rank 1 has 'fc.weight: [48, 16] float32 requires_grad=True'" in message
    # failed on the digests once all arrived, not by waiting out the timeout (measured
    # 0.05-0.85 s at load average 4.5 on 2 cores)
    assert all(seconds < ARRIVAL_TIMEOUT_S for _, seconds in results)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_rank_that_never_arrives_is_named_after_the_timeout() -> None:
    # 2 s: rank 1 arrives 0.25 s after rank 0 and must do so before rank 0 gives up
    timeout = 2.0
    env = {"LAMINA_VERIFY_TIMEOUT": f"{timeout:g}"}
    results = run_ranks(rank_two_never_arrives, 3, env=env, timeout=50)
    assert results[2] == ("skipped", 0.0)
    for message, seconds in results[:2]:
        assert message.startswith(
            "pre-flight verification: rank(s) [2] did not arrive within 2 s (ranks [0, 1] did)"
        )
        assert "check that rank 2 is running and reached distribute()" in message
        # no rank waited for a verdict that never came (measured 1.82-2.08 s at load 4.5)
        assert seconds < timeout + GRACE
    # named after the timeout, not before: the first rank to give up waited all of it
    assert max(seconds for _, seconds in results[:2]) >= timeout


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_rank_arriving_after_the_others_gave_up_fails_too() -> None:
    timeout = 1.0
    env = {"LAMINA_VERIFY_TIMEOUT": f"{timeout:g}"}
    results = run_ranks(rank_two_arrives_late, 3, env=env, timeout=50)
    for message, _ in results:
        assert "rank(s) [2] did not arrive within 1 s" in message, message
    # the first of them to give up waited all of the timeout
    assert max(seconds for _, seconds in results[:2]) >= timeout
    # rank 2 learns the verdict at once instead of waiting (measured 0.001 s at load 4.5)
    assert results[2][1] < timeout
