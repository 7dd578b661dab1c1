"""What each rank of ``lamina plan`` / ``lamina verify`` runs: the user's script, up to
its first collective.

torchrun starts ``python -m lamina.cli.rank_runner --stop plan|verify [--out DIR]
[--auto [--cluster CLUSTER.json --cluster-plans PLANS]] -- SCRIPT ARGS``. The runner asks
lamina to stop there (:func:`lamina.strategies.preflight.request_stop`), with ``--auto``
to choose the strategy as ``"auto"`` does whatever the script names
(:func:`lamina.api.request_auto`), and runs SCRIPT as ``__main__``; the strategy the
script wraps its model with plans, then raises
:class:`~lamina.strategies.preflight.StopBeforeFirstCollective` (after the pre-flight
check, for ``verify``), which this runner turns into the plan file or the verdict:

- ``plan``: rank 0 writes ``DIR/plan.json``, rank r ``DIR/plan.rank<r>.json``; exit 0;
- ``plan`` under ``lamina plan --simulate CLUSTER --auto``: ``"auto"`` ranks its
  candidates for the declared cluster, each priced from its plans in ``PLANS``, and
  distributes nothing; rank 0 writes ``DIR/ranking.json``; exit 0;
- ``plan --as-cluster-rank R`` (one process, not under torchrun: ``lamina plan`` starts
  one for each of :func:`lamina.auto.cluster_plans.planning_ranks`): this process stands
  as rank R of the cluster on a fake process group, and every candidate is planned and
  written to ``DIR/candidates.rank<R>.json``; exit 0;
- ``verify``: rank 0 prints ``lamina verify: OK: ...``; exit 0; a difference prints one
  line per rank and exits :data:`VERIFY_FAILED_STATUS`;
- a script that ends without planning exits :data:`NO_PLAN_STATUS`.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from lamina.cli.exit_status import NO_PLAN_STATUS, VERIFY_FAILED_STATUS
from lamina.errors import ConfigError, VerificationError
from lamina.runtime import ExecutionPlan
from lamina.strategies.preflight import StopBeforeFirstCollective, request_stop


def write_plan(plan: ExecutionPlan, folder: str, rank: int) -> Path:
    """Write ``plan.json`` (rank 0) or ``plan.rank<N>.json`` into ``folder``."""
    out = Path(folder)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"plan output folder {folder!r} cannot be created ({exc}); pick a writable folder"
        ) from None
    path = out / ("plan.json" if rank == 0 else f"plan.rank{rank}.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(plan.to_json() + "\n")
    tmp.replace(path)
    return path


def write_ranking(data: dict[str, object], folder: str) -> Path:
    """Write ``ranking.json`` (the candidates ``"auto"`` ranked) into ``folder``."""
    path = Path(folder) / "ranking.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lamina.cli.rank_runner")
    parser.add_argument("--stop", choices=("plan", "verify"), required=True)
    parser.add_argument("--out", default=None, help="folder for the plan files (plan)")
    parser.add_argument(
        "--auto", action="store_true", help="choose the strategy as 'auto' does (plan --auto)"
    )
    parser.add_argument(
        "--cluster",
        default=None,
        metavar="CLUSTER.json",
        help="with --auto: rank the candidates for this declared cluster, distribute nothing",
    )
    parser.add_argument(
        "--cluster-plans",
        default=None,
        metavar="PLANS",
        help="with --cluster: the folder of the candidates' plans on the cluster",
    )
    parser.add_argument(
        "--as-cluster-rank",
        type=int,
        default=None,
        metavar="R",
        help="with --cluster: plan every candidate as rank R of it into --out, rank nothing",
    )
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run the script (see the module docstring) and exit with the outcome's status."""
    args = _parser().parse_args(argv)
    if args.stop == "plan" and not args.out:
        _finish(2, "lamina plan: the rank runner needs --out DIR")
    if args.cluster is not None and not args.auto:
        _finish(2, "lamina plan: the rank runner takes --cluster with --auto only")
    if (args.cluster_plans is not None or args.as_cluster_rank is not None) and not args.cluster:
        _finish(2, "lamina plan: --cluster-plans and --as-cluster-rank go with --cluster")
    planning = args.as_cluster_rank is not None
    if planning:
        from lamina.auto.cluster_planning import join_as_cluster_rank
        from lamina.simulate import load_cluster

        join_as_cluster_rank(load_cluster(args.cluster), args.as_cluster_rank)
    rank = int(os.environ.get("RANK", "0"))
    request_stop(args.stop)
    if args.auto:
        from lamina.api import AutoRequest, request_auto

        plans = args.out if planning else args.cluster_plans
        request_auto(AutoRequest(cluster=args.cluster, cluster_plans=plans, planning=planning))
    sys.argv = [args.script, *args.script_args]
    sys.path.insert(0, str(Path(args.script).resolve().parent))
    from lamina.auto.choose import CandidatesPlanned, RankedOnly

    try:
        runpy.run_path(args.script, run_name="__main__")
    except CandidatesPlanned:
        _finish(0)
    except RankedOnly as ranked:
        if rank == 0 and args.out:
            write_ranking(ranked.ranking.to_json(), args.out)
        _finish(0)
    except StopBeforeFirstCollective as stop:
        if args.stop == "plan":
            write_plan(stop.plan, args.out, rank)
        elif rank == 0 and stop.report is not None:
            print(f"lamina verify: OK: {stop.report.summary()}", flush=True)
        _finish(0)
    except VerificationError as exc:
        _finish(VERIFY_FAILED_STATUS, f"lamina verify: rank {rank}: FAILED: {exc}")
    _finish(
        NO_PLAN_STATUS,
        f"lamina {args.stop}: rank {rank}: the script ended without building an execution "
        "plan; it must call lamina.distribute(model, ...) and run a forward (or pass "
        "example_inputs)",
    )


def _finish(status: int, message: str = "") -> NoReturn:
    """Exit with ``status`` without interpreter teardown: destroying a gloo group while a
    peer process is already gone can abort (SIGABRT) instead of exiting with the status
    ``lamina plan`` / ``lamina verify`` report. No collective of the job has run yet, so
    there is nothing to finish."""
    if message:
        print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
