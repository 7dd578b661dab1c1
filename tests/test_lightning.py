"""lamina under Lightning (``lamina.integrations.lightning``): the Fabric example
(``examples/lightning_gpt.py``) and the Trainer example (``examples/lightning_trainer_gpt.py``)
train the GPT example as lamina's own loop does (``lamina.init`` + ``lamina.distribute`` +
a torch optimizer, from the same seed, clipped every step), under dp, zero3 and hsdp on 2
gloo ranks and tp x zero3 on 4; a checkpoint saved through Lightning (``fabric.save`` /
``fabric.load``, the Trainer's ``ModelCheckpoint`` and ``ckpt_path=``) resumes bit for
bit; a model built on the meta device trains as one built whole; the ``lamina_*`` names
are registered in both registries; bad input is one line naming the fix.

One 2-rank job and one 4-rank job compute every case (each rank imports lightning once,
in the forkserver); the tests assert on their results.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from lamina.testing import run_ranks

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        find_spec("lightning") is None,
        reason="the Lightning strategy needs lightning (lightning or examples extra)",
    ),
]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
#: Below every step's gradient norm of this model: clipping scales every step.
MAX_NORM = "0.05"
#: 24 windows: 3 steps per epoch of 2 data replicas x 4, so 6 steps cross an epoch.
TINY = [
    "--batch-size", "4", "--seq-len", "16", "--d-model", "32", "--n-layers", "2",
    "--n-heads", "2", "--corpus-mb", "0.1", "--windows", "24", "--max-steps", "6",
    "--grad-clip", MAX_NORM,
]  # fmt: skip
#: The strategies of the 2-rank job. All run on the topology's inter x intra mesh (1 x 2
#: here), which hsdp needs: a job joins one mesh (one ``lamina.init`` per job).
TWO_RANK = ("dp", "zero3", "hsdp")
TWO_RANK_ARGS = [*TINY, "--mesh", "topology"]


def _examples() -> tuple[Any, Any]:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import lightning_gpt
    import lightning_trainer_gpt

    return lightning_gpt, lightning_trainer_gpt


def _evidence(module: Any) -> dict[str, Any]:
    """What shows lamina distributed ``module``: its placement, which parameters are
    DTensors and how they are placed, its data replica and class."""
    from torch.distributed.tensor import DTensor

    params = dict(module.named_parameters())
    return {
        "lines": list(module.placement.lines()),
        "placements": {n: str(p.placements) for n, p in params.items() if isinstance(p, DTensor)},
        "params": len(params),
        "replica": tuple(module.data_replica),
        "classes": [c.__name__ for c in type(module).__mro__],
    }


def _reference(argv: list[str]) -> dict[str, Any]:
    """lamina's own loop on the example's model, data, optimizer and schedule."""
    F, _ = _examples()
    import torch

    import lamina
    from _gpt_model import GPT, lm_loss
    from _stdlib_corpus import load_char_corpus

    args = F.parse_args(argv)
    names = F.STRATEGIES[args.strategy]
    lamina.init(mesh=F.parse_mesh(args.mesh))
    torch.manual_seed(args.seed)
    corpus = load_char_corpus(args.corpus_mb)
    net = GPT(F.model_config(args, corpus))
    model = lamina.distribute(
        net, names if len(names) > 1 else names[0], **F.strategy_options(args)
    )
    optimizer = F.make_optimizer(model, args)
    schedule = F.make_schedule(optimizer, args)
    index, count = model.data_replica  # type: ignore[misc]
    dataset = F.WindowDataset(corpus.train, args.seq_len, args.windows)
    loader = F.make_loader(dataset, args.batch_size, index, count, args.seed)
    losses, norms = [], []
    steps, epoch = 0, 0
    while steps < args.max_steps:
        loader.sampler.set_epoch(epoch)
        for group in F.accumulation_groups(loader, args.accumulate):
            optimizer.zero_grad(set_to_none=True)
            for i, (x, y) in enumerate(group):
                with model.no_sync() if i < len(group) - 1 else contextlib.nullcontext():  # type: ignore[operator]
                    loss = lm_loss(model(x), y)
                    (loss / args.accumulate).backward()
                losses.append(float(loss.detach()))
            norms.append(float(model.clip_grad_norm_(args.grad_clip)))  # type: ignore[operator]
            optimizer.step()
            schedule.step()
            steps += 1
            if steps == args.max_steps:
                break
        epoch += 1
    return {"losses": losses, "norms": norms, "mesh": repr(lamina.current().mesh)}  # type: ignore[union-attr]


def _fabric(argv: list[str]) -> dict[str, Any]:
    F, _ = _examples()
    run = F.train(F.parse_args(argv))
    kwargs = run.fabric.strategy.distributed_sampler_kwargs
    return {
        "losses": run.losses,
        "sampler": (kwargs["rank"], kwargs["num_replicas"]),
        **_evidence(run.model.module),
    }


def _trainer(argv: list[str]) -> dict[str, Any]:
    _, T = _examples()
    module, trainer, _ = T.train(T.parse_args(argv))
    sampler = trainer.train_dataloader.sampler
    return {
        "losses": module.losses,
        "sampler": (sampler.rank, sampler.num_replicas),
        "strategy": type(trainer.strategy).__name__,
        **_evidence(trainer.strategy.network),
    }


def _error(fn: Any) -> str:
    """The message of the ConfigError ``fn()`` raises."""
    from lamina.errors import ConfigError

    try:
        fn()
    except ConfigError as exc:
        return str(exc)
    raise AssertionError(f"{fn} raised nothing")


def _quietly(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` with the examples' and Lightning's printing kept off the terminal."""
    with (
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        return fn(*args)


def _counted(fn: Any, argv: list[str]) -> dict[str, Any]:
    """``fn(argv)``'s result with the float32 bytes it all-reduced (gradients)."""
    from lamina.testing import WireCounter

    with WireCounter() as wire:
        result: dict[str, Any] = _quietly(fn, argv)
    return {**result, "all_reduced": wire.bytes(op="all_reduce", dtype="float32")}


def _bad_input() -> dict[str, str]:
    """The one-line errors, on 2 ranks running the topology's mesh."""
    import lightning.pytorch as pl
    import torch
    from lightning.fabric import Fabric

    from _gpt_model import GPT, GPTConfig
    from lamina.integrations.lightning import LaminaFabricStrategy, LaminaTrainerStrategy
    from lamina.integrations.lightning.common import owned_child

    class TwoNetworks(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.decoder = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    errors = {
        "unknown": _error(lambda: LaminaTrainerStrategy("zero4")),
        "pp": _error(lambda: LaminaFabricStrategy("pp")),
        "option": _error(lambda: LaminaFabricStrategy("zero3", bucket_cap_mb=25)),
        "mesh": _error(
            lambda: Fabric(
                strategy=LaminaFabricStrategy(["tp", "zero3"], mesh={"fsdp": 2, "tp": 2})
            ).launch()
        ),
        "joined": _error(
            lambda: Fabric(strategy=LaminaFabricStrategy("zero3", mesh={"fsdp": 2})).launch()
        ),
        "module": _error(lambda: owned_child(TwoNetworks(), None)),
        "unknown_module": _error(lambda: owned_child(TwoNetworks(), "head")),
        "named_module": owned_child(TwoNetworks(), "decoder")[0],  # type: ignore[dict-item]
    }
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    saved = {name: os.environ.pop(name) for name in launcher}
    try:  # a process no launcher started, asking Lightning for 2 devices
        errors["launcher"] = _error(
            lambda: Fabric(strategy=LaminaFabricStrategy("dp"), accelerator="cpu", devices=2)
        )
    finally:
        os.environ.update(saved)
    fabric = Fabric(strategy=LaminaFabricStrategy("tp", mesh="topology"))
    fabric.launch()
    errors["example_inputs"] = _error(lambda: fabric.setup(GPT(GPTConfig(50, 16, 32, 1, 2))))
    return errors


def _collectives() -> dict[str, Any]:
    """The strategies' collectives through torch.distributed: Fabric's and the Trainer's."""
    import lightning.pytorch as pl
    import torch
    from lightning.fabric import Fabric

    from lamina.integrations.lightning import LaminaFabricStrategy, LaminaTrainerStrategy

    fabric = Fabric(strategy=LaminaFabricStrategy("zero3", mesh="topology"))
    fabric.launch()
    trainer = pl.Trainer(
        strategy=LaminaTrainerStrategy("zero3", mesh="topology"),
        logger=False,
        enable_progress_bar=False,
    )
    strategy = trainer.strategy
    strategy.setup_environment()
    value = torch.tensor([fabric.global_rank + 1.0])
    out: dict[str, Any] = {}
    for name, reduce in (("fabric", fabric.all_reduce), ("trainer", strategy.reduce)):
        out[name] = {
            op: reduce(value, reduce_op=op).tolist() for op in ("mean", "sum", "max", "min")
        }
    out["fabric"]["gather"] = fabric.all_gather(value).tolist()
    out["trainer"]["gather"] = strategy.all_gather(value).tolist()
    out["fabric"]["broadcast"] = fabric.broadcast({"from": fabric.global_rank}, src=1)
    out["trainer"]["broadcast"] = strategy.broadcast(f"rank {strategy.global_rank}")
    out["trainer"]["all"] = strategy.reduce_boolean_decision(fabric.global_rank == 0, all=True)
    out["trainer"]["any"] = strategy.reduce_boolean_decision(fabric.global_rank == 0, all=False)
    fabric.barrier()
    strategy.barrier()
    out["value"] = value.tolist()  # the input itself is left as it was
    return out


def _registered() -> dict[str, Any]:
    """What ``strategy="lamina_..."`` resolves to in Fabric and in the Trainer."""
    import lightning.pytorch as pl
    from lightning.fabric import Fabric

    fabric = Fabric(strategy="lamina_tp_zero3")
    trainer = pl.Trainer(strategy="lamina_hsdp", logger=False, enable_progress_bar=False)
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    return {
        "fabric": (type(fabric.strategy).__name__, fabric.strategy.config.names),
        "trainer": (type(trainer.strategy).__name__, trainer.strategy.config.names),
        "fabric_names": sorted(n for n in STRATEGY_REGISTRY if n.startswith("lamina_")),
        "trainer_names": sorted(n for n in StrategyRegistry if n.startswith("lamina_")),
    }


def _quiet_logs() -> None:
    """Lightning's info lines (``GPU available: False``, tips) off the terminal."""
    import logging

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _two_rank_job(tmp: str) -> dict[str, Any]:
    import lamina

    _examples()
    _quiet_logs()
    out: dict[str, Any] = {"registered": _quietly(_registered)}
    for strategy in TWO_RANK:
        argv = [*TWO_RANK_ARGS, "--strategy", strategy]
        case: dict[str, Any] = {"reference": _counted(_reference, argv)}
        if strategy == "zero3":  # saves at step 3 (an epoch's end) and 6; resumes from 3
            fabric_dir, trainer_dir = f"{tmp}/fabric", f"{tmp}/trainer"
            saving = ["--save-every", "3", "--checkpoint-dir"]
            case["fabric"] = _quietly(_fabric, [*argv, *saving, fabric_dir])
            case["fabric_resumed"] = _quietly(
                _fabric, [*argv, "--resume-from", f"{fabric_dir}/step-3"]
            )
            case["fabric_meta"] = _quietly(_fabric, [*argv, "--empty-init"])
            case["trainer"] = _quietly(_trainer, [*argv, *saving, trainer_dir])
            resume = f"{trainer_dir}/epoch=0-step=3.ckpt"
            case["trainer_resumed"] = _quietly(_trainer, [*argv, "--resume-from", resume])
        else:
            case["fabric"] = _quietly(_fabric, argv)
            case["trainer"] = _quietly(_trainer, argv)
        out[strategy] = case
    # dp accumulating 2 micro-batches a step (no_sync defers its all-reduce): 40 windows
    # are 5 batches an epoch, stepped as 2 + 2 + 1 (the Trainer steps at an epoch's end)
    argv = [*TWO_RANK_ARGS, "--strategy", "dp", "--accumulate", "2", "--windows", "40"]
    argv += ["--max-steps", "4"]
    out["accumulate"] = {
        "reference": _counted(_reference, argv),
        "fabric": _counted(_fabric, argv),
        "trainer": _counted(_trainer, argv),
    }
    out["errors"] = _quietly(_bad_input)
    out["collectives"] = _quietly(_collectives)
    lamina.shutdown()
    return out


def _four_rank_job(tmp: str) -> dict[str, Any]:
    import lamina

    _examples()
    _quiet_logs()
    argv = [*TINY, "--strategy", "tp_zero3", "--mesh", "fsdp=2,tp=2"]
    out = {
        "reference": _quietly(_reference, argv),
        "fabric": _quietly(_fabric, [*argv, "--save-every", "3", "--checkpoint-dir", tmp]),
        "fabric_resumed": _quietly(_fabric, [*argv, "--resume-from", f"{tmp}/step-3"]),
        "trainer": _quietly(_trainer, argv),
        "coordinates": lamina.current().mesh.coordinates(),  # type: ignore[union-attr]
    }
    lamina.shutdown()
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every 2-rank case, per rank (one job)."""
    tmp = tmp_path_factory.mktemp("lightning2")
    return run_ranks(_two_rank_job, 2, args=(str(tmp),), timeout=300)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every 4-rank case (tp x zero3), per rank (one job)."""
    tmp = tmp_path_factory.mktemp("lightning4")
    return run_ranks(_four_rank_job, 4, args=(str(tmp),), timeout=300)


def _close(got: list[float], want: list[float], count: int = 6) -> float:
    assert len(got) == len(want) == count, (got, want)
    return max(abs(a - b) for a, b in zip(got, want, strict=True))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", TWO_RANK)
@pytest.mark.parametrize("loop", ["fabric", "trainer"])
def test_lightning_trains_the_gpt_as_laminas_own_loop(
    two_ranks: list[dict[str, Any]], strategy: str, loop: str
) -> None:
    for rank, result in enumerate(two_ranks):
        case = result[strategy]
        reference, got = case["reference"], case[loop]
        assert min(reference["norms"]) > float(MAX_NORM), "the bound must clip every step"
        assert _close(got["losses"], reference["losses"]) <= 1e-6, (rank, got, reference)
        # lamina ran: the model is lamina's, placed as the strategy places it, and this
        # rank's data replica is its own
        assert "DistributedModule" in got["classes"], got["classes"]
        assert got["replica"] == got["sampler"] == (rank, 2)
        if strategy == "dp":
            line = "role dp: replicate over ['inter', 'intra']"
            assert got["lines"][0] == line, got["lines"][:2]
            assert not got["placements"]  # whole parameters, gradients all-reduced
        else:
            axes = "['inter', 'intra']" if strategy == "zero3" else "['intra']"
            assert got["lines"][0] == f"role {strategy}: shard over {axes}", got["lines"][:2]
            assert len(got["placements"]) == got["params"]  # every parameter a shard
            # zero3 shards over both axes flattened; hsdp replicates over inter
            want = "(Shard(dim=0),)" if strategy == "zero3" else "(Replicate(), Shard(dim=0))"
            assert set(got["placements"].values()) == {want}, got["placements"]
    assert two_ranks[0]["hsdp"]["reference"]["mesh"] == "DeviceMesh(cpu: inter=1, intra=2)"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("loop", ["fabric", "trainer"])
def test_accumulation_defers_dp_sync_and_trains_as_laminas_own_loop(
    two_ranks: list[dict[str, Any]], loop: str
) -> None:
    """``fabric.no_backward_sync`` / ``accumulate_grad_batches=2`` run the model's
    ``no_sync()``: 4 steps of 2 + 2 + 1 + 2 micro-batches give lamina's own losses, with
    one float32 gradient all-reduce per step (counted on the wire)."""
    for rank, result in enumerate(two_ranks):
        reference, got = result["accumulate"]["reference"], result["accumulate"][loop]
        assert len(reference["norms"]) == 4 and min(reference["norms"]) > float(MAX_NORM)
        assert _close(got["losses"], reference["losses"], 7) <= 1e-6, (rank, got, reference)
        # one gradient all-reduce per step (as many bytes as a step of the 6 of the dp
        # run without accumulation), none per micro-batch inside no_sync()
        step = result["dp"]["reference"]["all_reduced"] // 6
        assert reference["all_reduced"] == 4 * step > 0, (reference, step)
        assert got["all_reduced"] == reference["all_reduced"], (got, reference)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("loop", ["fabric", "trainer"])
def test_tp_by_zero3_under_lightning_trains_as_laminas_own_loop(
    four_ranks: list[dict[str, Any]], loop: str
) -> None:
    for rank, result in enumerate(four_ranks):
        reference, got = result["reference"], result[loop]
        assert min(reference["norms"]) > float(MAX_NORM), "the bound must clip every step"
        assert _close(got["losses"], reference["losses"]) <= 1e-6, (rank, got, reference)
        # a tp pair shares one data replica: the fsdp coordinate of 2
        fsdp = result["coordinates"]["fsdp"]
        assert got["replica"] == got["sampler"] == (fsdp, 2), (rank, got["sampler"])
        assert got["lines"][:2] == ["role tp: split over ['tp']", "role zero3: shard over ['fsdp']"]
        qkv = next(line for line in got["lines"] if line.startswith("blocks.0.attn.qkv.weight:"))
        # the fused q, k, v projection split part by part (heads of each)
        assert qkv == "blocks.0.attn.qkv.weight: fsdp: Shard(0), tp: Split(0, 32+32+32)", qkv
    # both ranks of a tp pair trained on the same batches
    assert four_ranks[0][loop]["losses"] == four_ranks[1][loop]["losses"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("loop", ["fabric", "trainer"])
def test_a_checkpoint_saved_through_lightning_resumes_bit_for_bit(
    two_ranks: list[dict[str, Any]], four_ranks: list[dict[str, Any]], loop: str
) -> None:
    """zero3 on 2 ranks (Fabric and Trainer), tp x zero3 on 4 (Fabric): the 3 losses
    after the step-3 checkpoint equal the uninterrupted run's."""
    for result in two_ranks:
        whole, resumed = result["zero3"][loop], result["zero3"][f"{loop}_resumed"]
        assert resumed["losses"] == whole["losses"][3:], (resumed["losses"], whole["losses"])
    if loop == "fabric":
        for result in four_ranks:
            whole, resumed = result["fabric"], result["fabric_resumed"]
            assert resumed["losses"] == whole["losses"][3:], (resumed, whole)


@pytest.mark.timeout(400)
def test_a_model_built_on_the_meta_device_trains_as_one_built_whole(
    two_ranks: list[dict[str, Any]],
) -> None:
    """``fabric.init_module(empty_init=True)``: distributed on meta, each rank allocates
    its shards, the GPT's initializers run on them: the same losses bit for bit."""
    for result in two_ranks:
        meta, whole = result["zero3"]["fabric_meta"], result["zero3"]["fabric"]
        assert meta["losses"] == whole["losses"]
        assert len(meta["placements"]) == meta["params"]


@pytest.mark.timeout(400)
def test_the_lamina_names_are_registered_in_fabric_and_the_trainer(
    two_ranks: list[dict[str, Any]],
) -> None:
    found = two_ranks[0]["registered"]
    names = ["lamina_dp", "lamina_hsdp", "lamina_tp", "lamina_tp_hsdp", "lamina_tp_zero3"]
    names.insert(4, "lamina_zero3")
    assert found["fabric_names"] == found["trainer_names"] == sorted(names)
    assert found["fabric"] == ("LaminaFabricStrategy", ("tp", "zero3"))
    assert found["trainer"] == ("LaminaTrainerStrategy", ("hsdp",))


@pytest.mark.timeout(400)
def test_collectives_go_through_torch_distributed(two_ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(two_ranks):
        found = result["collectives"]
        assert found["value"] == [rank + 1.0]
        for loop in ("fabric", "trainer"):
            got = found[loop]
            assert (got["mean"], got["sum"], got["max"], got["min"]) == (
                [1.5],
                [3.0],
                [2.0],
                [1.0],
            ), got
            assert got["gather"] == [[1.0], [2.0]], got
        assert found["fabric"]["broadcast"] == {"from": 1}
        assert found["trainer"]["broadcast"] == "rank 0"
        assert (found["trainer"]["all"], found["trainer"]["any"]) == (False, True)


@pytest.mark.timeout(400)
def test_bad_input_is_one_line_naming_the_fix(two_ranks: list[dict[str, Any]]) -> None:
    errors = two_ranks[0]["errors"]
    assert errors.pop("named_module") == "decoder"  # module= picks the network
    assert all("\n" not in message for message in errors.values()), errors
    assert "unknown strategy 'zero4'; choose one of dp, zero3, hsdp, tp" in errors["unknown"]
    assert "'pp' runs its own schedule" in errors["pp"]
    assert "lamina's own loop" in errors["pp"]
    assert "LaminaStrategy('zero3'): no option 'bucket_cap_mb'" in errors["option"]
    assert "min_unit_numel" in errors["option"]
    assert "the mesh holds 4 ranks but the job has 2" in errors["mesh"]
    assert "multiply to 2" in errors["mesh"]
    assert "lamina already runs on DeviceMesh(cpu: inter=1, intra=2)" in errors["joined"]
    assert "lamina.shutdown()" in errors["joined"]
    assert "pass LaminaStrategy(..., example_inputs=(batch,))" in errors["example_inputs"]
    assert "'encoder', 'decoder'" in errors["module"]
    assert "module='name'" in errors["module"]
    assert "no submodule 'head'; its children are encoder, decoder" in errors["unknown_module"]
    assert "`lamina run --nproc-per-node 2 SCRIPT`" in errors["launcher"]
