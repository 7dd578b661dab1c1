"""``lamina plan`` and ``lamina verify``: run a training script only up to its plan.

Both launch SCRIPT with torchrun (through ``lamina run``'s launcher) inside the rank
runner (:mod:`lamina.cli.rank_runner`), which asks the strategy for its plan and stops
before the first collective:

- ``lamina plan``: every rank writes its execution plan and exits; the plans are read
  back, compared across ranks, and printed (``--explain``, the default, or ``--json``).
- ``lamina plan --simulate CLUSTER.json``: the same capture on :data:`SIMULATE_RANKS`
  local ranks (a one-rank data-parallel plan has no gradient collective at all), then
  the plan's per-step communication time and per-rank memory predicted on the declared
  cluster (:mod:`lamina.simulate`): a readable report, or ``--json``. Bucket and unit
  boundaries are the capture's (they do not depend on the world size); only their byte
  totals are costed on the simulated world size. ``--mesh fsdp=512,tp=8`` (or the
  cluster file's ``"mesh"``) sizes the simulated mesh axes the plan's collectives run on
  (tensor parallelism's ``tp`` inside hosts, ``fsdp`` over the rest).
- ``lamina plan --auto``: ``lamina.distribute`` chooses as ``"auto"`` does, whatever
  strategy the script names (:mod:`lamina.auto`), and the ranking is printed (candidate,
  predicted step time and memory per rank, why each rejected one was rejected) before
  the chosen plan; with ``--simulate CLUSTER.json`` the candidates are ranked for the
  declared cluster (its mesh, links and device memory; compute timed here) and nothing
  is distributed. Each candidate is first planned at the cluster's size by planning
  processes (:func:`plan_as_cluster_ranks`; one process each, each standing as one rank
  of the cluster on a fake process group, no training launched) and the ranking prices
  those plans (:mod:`lamina.auto.cluster_plans`).
- ``lamina verify``: the ranks run the pre-flight cross-rank verification and exit; it
  prints OK or the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lamina.cli.exit_status import NO_PLAN_STATUS, VERIFY_FAILED_STATUS
from lamina.cli.run import LaunchPlan, check_backend, launch
from lamina.envvars import BACKEND_ENV, VERIFY_TIMEOUT_ENV
from lamina.errors import ConfigError
from lamina.runtime import ExecutionPlan, explain

if TYPE_CHECKING:
    from lamina.simulate.cluster import Cluster


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc-per-node", type=int, default=1, metavar="N", help="ranks")
    parser.add_argument("--backend", default=None, metavar="NAME", help="lamina backend")
    parser.add_argument("script", help="the training script (it must call lamina.distribute)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def _launch(
    args: argparse.Namespace,
    runner: list[str],
    env: dict[str, str] | None = None,
    quiet_dir: Path | None = None,
) -> int:
    if args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    _require_script(args)
    requested = args.backend or os.environ.get(BACKEND_ENV)
    if requested:
        check_backend(requested.strip())
    argv = ["--standalone", "--nproc-per-node", str(args.nproc_per_node)]
    if quiet_dir is not None:  # the ranks' stdout (script prints, gloo chatter) to files
        argv += ["--redirects", "1", "--log-dir", str(quiet_dir)]
    argv += ["-m", "lamina.cli.rank_runner", *runner, args.script, *args.script_args]
    env = env or {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return launch(LaunchPlan(args.backend, argv, True))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _require_script(args: argparse.Namespace) -> None:
    """A one-line ConfigError when ``args.script`` is not a file."""
    if not Path(args.script).is_file():
        raise ConfigError(f"script {args.script!r} does not exist; pass a training script path")


def read_plans(folder: Path, nproc: int) -> list[ExecutionPlan]:
    """The plans the ranks wrote, rank 0 first; ConfigError when rank 0 wrote none."""
    paths = [folder / "plan.json"] + [folder / f"plan.rank{r}.json" for r in range(1, nproc)]
    if not paths[0].is_file():
        raise ConfigError(
            "the script finished without building an execution plan; it must call "
            "lamina.distribute(model, ...) and run a forward (or pass example_inputs)"
        )
    return [ExecutionPlan.from_dict(json.loads(p.read_text())) for p in paths if p.is_file()]


#: Local ranks ``lamina plan --simulate`` captures the plan on (at least).
SIMULATE_RANKS = 2


def plan_command(args: argparse.Namespace) -> int:
    """``lamina plan``: build the plan without training and print it (or, with
    ``--simulate``, predict it on a declared cluster)."""
    cluster: Cluster | None = None
    if args.mesh is not None and args.simulate is None:
        raise ConfigError("--mesh sizes the simulated mesh; add --simulate CLUSTER.json")
    if args.simulate is not None:  # a bad cluster file fails before the script starts
        from lamina.simulate import load_cluster
        from lamina.simulate.cluster import parse_mesh_option, with_mesh

        cluster = load_cluster(args.simulate)
        if args.mesh is not None:  # overrides the file's "mesh"
            cluster = with_mesh(cluster, parse_mesh_option(args.mesh), "--mesh", "mesh")
        args.nproc_per_node = max(SIMULATE_RANKS, args.nproc_per_node)
    with tempfile.TemporaryDirectory(prefix="lamina-plan-") as tmp:
        runner = ["--stop", "plan", "--out", tmp]
        if args.auto:  # the ranks' runner asks lamina.distribute to choose
            runner.append("--auto")
            if cluster is not None:
                path = str(Path(args.simulate).resolve())
                folder = Path(tmp) / "cluster-plans"
                status = plan_as_cluster_ranks(args, path, cluster.world_size, folder)
                if status != 0:
                    return status
                runner += ["--cluster", path, "--cluster-plans", str(folder)]
        status = _launch(args, runner, quiet_dir=Path(tmp) / "logs")
        ranked = Path(tmp) / "ranking.json"
        if args.auto and status == 0 and ranked.is_file():
            return _print_ranking(args, json.loads(ranked.read_text()), None)
        if status == NO_PLAN_STATUS:
            raise ConfigError(
                "the script finished without building an execution plan; it must call "
                "lamina.distribute(model, ...) and run a forward (or pass example_inputs)"
            )
        if status != 0:
            print(f"lamina plan: the script failed (exit {status})", file=sys.stderr)
            return status
        plans = read_plans(Path(tmp), args.nproc_per_node)
    first = plans[0]
    differing = [r for r, p in enumerate(plans) if p.fingerprint != first.fingerprint]
    if args.auto:
        recorded = dict(first.meta).get("auto_ranking")
        if recorded is None:
            raise ConfigError(
                "lamina plan --auto: the plan carries no ranking; the script's "
                "lamina.distribute call did not run the automatic choice"
            )
        status = _print_ranking(args, json.loads(recorded), first)
        return 1 if differing else status
    if cluster is not None:
        from lamina.simulate import predict

        prediction = predict(first, cluster)
        if args.json:
            print(json.dumps(prediction.to_json(), indent=2, sort_keys=True))
        else:
            print(f"lamina plan --simulate {args.simulate}: {args.script}")
            print(prediction.report())
        if differing:
            print(
                f"lamina plan: plans differ on rank(s) {differing}; run `lamina verify`",
                file=sys.stderr,
            )
        return 1 if differing else 0
    if args.json:
        print(first.to_json())
    else:
        print(explain(first))
        agree = (
            f"plans differ on rank(s) {differing}; run `lamina verify` for the first difference"
            if differing
            else f"the plan is identical on all {len(plans)} rank(s)"
        )
        print(f"\n{agree}")
    return 1 if differing else 0


def plan_as_cluster_ranks(
    args: argparse.Namespace, cluster_path: str, world_size: int, folder: Path
) -> int:
    """Run the script once per planning rank of the declared cluster
    (:func:`lamina.auto.cluster_plans.planning_ranks`), at once, each a single process
    standing as that rank (``rank_runner --as-cluster-rank``): every candidate is planned
    into ``folder``. 0 when all finished; else the first failure's status, its output's
    end printed."""
    from lamina.auto.cluster_plans import planning_ranks

    _require_script(args)
    ranks = planning_ranks(world_size)
    print(
        f"lamina plan: planning every candidate as rank(s) {', '.join(map(str, ranks))} of "
        f"the {world_size}-device cluster",
        file=sys.stderr,
        flush=True,
    )
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    if args.backend:
        env[BACKEND_ENV] = args.backend
    folder.mkdir(parents=True, exist_ok=True)
    running = []
    for rank in ranks:
        log = folder / f"planning.rank{rank}.log"
        command = [
            sys.executable, "-m", "lamina.cli.rank_runner", "--stop", "plan",
            "--out", str(folder), "--auto", "--cluster", cluster_path,
            "--as-cluster-rank", str(rank), args.script, *args.script_args,
        ]  # fmt: skip
        with log.open("w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        running.append((rank, process, log))
    status = 0
    for rank, process, log in running:
        code = process.wait()
        if code != 0 and status == 0:
            status = code
            tail = log.read_text(errors="replace")[-3000:]
            print(
                f"lamina plan: planning as rank {rank} of the cluster failed (exit {code}):\n"
                f"{tail}",
                file=sys.stderr,
            )
    return status


#: What torchrun sets for its ranks: a planning process is not one of them.
TORCHRUN_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _print_ranking(
    args: argparse.Namespace, ranking: dict[str, Any], plan: ExecutionPlan | None
) -> int:
    """``lamina plan --auto``'s output: the ranking, then the chosen plan."""
    from lamina.auto.ranking import render_ranking

    if args.json:
        out: dict[str, Any] = {"ranking": ranking}
        if plan is not None:
            out["plan"] = json.loads(plan.to_json())
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    where = f" --simulate {args.simulate}" if args.simulate else ""
    print(f"lamina plan --auto{where}: {args.script}")
    print(render_ranking(ranking))
    if plan is not None:
        print(f"\nthe chosen plan ({ranking['chosen']}):")
        print(explain(plan))
    return 0


def verify_command(args: argparse.Namespace) -> int:
    """``lamina verify``: only the pre-flight check; OK or the difference."""
    env = {VERIFY_TIMEOUT_ENV: str(args.timeout)} if args.timeout is not None else {}
    status = _launch(args, ["--stop", "verify"], env)
    if status == 0:
        return 0
    what = "ranks differ" if status == VERIFY_FAILED_STATUS else f"exit status {status}"
    print(f"lamina verify: FAILED: {what}; see the rank messages above", file=sys.stderr)
    return status


def add_plan_parsers(subparsers: Any) -> None:
    """Register ``plan`` and ``verify`` on the ``lamina`` subcommand parsers."""
    plan = subparsers.add_parser(
        "plan",
        help="build a script's execution plan without training and print it",
        description="Run SCRIPT up to its execution plan (no collective, no step) and print "
        "the plan; with --simulate, predict the step's communication time and per-rank "
        "memory on a declared cluster instead.",
    )
    fmt = plan.add_mutually_exclusive_group()
    fmt.add_argument("--explain", action="store_true", help="readable plan (the default)")
    fmt.add_argument("--json", action="store_true", help="the plan (or prediction) as JSON")
    plan.add_argument(
        "--simulate",
        default=None,
        metavar="CLUSTER.json",
        help="predict the step's communication time and per-rank memory on the declared "
        "cluster (up to 4096 devices; format in docs/simulate.md)",
    )
    plan.add_argument(
        "--auto",
        action="store_true",
        help="choose the strategy as lamina.distribute(model, 'auto') does (whatever the "
        "script names) and print the ranking of the candidates; with --simulate, rank them "
        "for the declared cluster",
    )
    plan.add_argument(
        "--mesh",
        default=None,
        metavar="AXIS=N,...",
        help="with --simulate: the simulated mesh, outermost axis first (e.g. fsdp=512,tp=8); "
        'overrides the cluster file\'s "mesh"',
    )
    _add_common(plan)
    plan.set_defaults(func=plan_command)
    verify = subparsers.add_parser(
        "verify",
        help="run only the pre-flight cross-rank verification of a script",
        description="Run SCRIPT on N ranks up to the pre-flight verification; print OK or "
        "the first difference between ranks.",
    )
    verify.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help=f"arrival timeout ({VERIFY_TIMEOUT_ENV})",
    )
    _add_common(verify)
    verify.set_defaults(func=verify_command)
