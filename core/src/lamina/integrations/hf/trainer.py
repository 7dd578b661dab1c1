"""``LaminaTrainer``: a ``transformers.Trainer`` whose model lamina distributes.

Trainer runs on Accelerate, which under torchrun wraps the model in DDP (or FSDP) in
``accelerator.prepare``. :class:`LaminaTrainerMixin` replaces that one step and leaves
the loop as it is:

- after ``Trainer.__init__`` it joins lamina's job (``lamina.init`` on the mesh asked for,
  reusing the process group Accelerate started) and calls ``lamina.distribute`` on the
  model (tensor parallelism derives its split from one collated batch of
  ``train_dataset``); it then hands the model to ``accelerator.prepare_model`` in
  evaluation mode, which applies mixed precision only and marks it prepared, so the
  training loop's ``accelerator.prepare(model, optimizer)`` leaves it unwrapped (no DDP);
- the optimizer is Trainer's own, built on the distributed parameters (DTensors under
  ZeRO-3 and tensor parallelism);
- gradient accumulation is Trainer's ``accelerator.no_sync(model)``, which calls the
  model's ``no_sync()``; clipping is the model's ``clip_grad_norm_`` (the whole model's
  norm over every shard and slice);
- each data loader is sharded by ``model.data_replica`` (the ranks of a tensor-parallel
  group read the same batch), and Trainer's token counts and loss scaling divide by the
  ranks sharing a batch (:meth:`LaminaTrainerMixin.get_tp_size`);
- ``save_model`` writes a full, unsharded ``save_pretrained`` folder (the state dict
  gathered by ``torch.distributed.checkpoint.state_dict``, written by the main process);
  each ``checkpoint-N`` also holds ``lamina/``, the sharded model and optimizer state,
  scheduler and RNG through :class:`lamina.CheckpointManager` (DCP), from which
  ``train(resume_from_checkpoint=...)`` continues exactly.

The parallelism comes from ``strategy=`` / ``mesh=`` (lamina's spelling), ``parallelism=``
(a :class:`~lamina.integrations.hf.parallelism.LaminaParallelism` or Accelerate's
``ParallelismConfig``) or ``TrainingArguments.parallelism_config``; none of them means
``dp`` over the job (what Trainer does under torchrun). :func:`lamina_trainer` gives any
Trainer subclass (TRL's ``SFTTrainer``) the same behaviour.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME

import lamina
from lamina.errors import ConfigError
from lamina.integrations.hf.parallelism import LaminaParallelism, LaminaPlan
from lamina.session import LaunchEnv, Runtime, current
from lamina.strategies.contract import Placement
from lamina.strategies.surface import DistributedModule

if TYPE_CHECKING:
    _TrainerBase = Trainer
else:
    _TrainerBase = object

#: The folder of each ``checkpoint-N`` holding lamina's sharded state (a
#: :class:`lamina.CheckpointManager` root: ``lamina/step-N/``).
STATE_DIR = "lamina"
#: The file names Trainer gives whole-model weights and optimizer state.
SAFE_WEIGHTS, SAFE_INDEX, OPTIMIZER_FILE = (
    "model.safetensors",
    "model.safetensors.index.json",
    "optimizer.pt",
)
#: Trainer's private methods this integration overrides or calls (a release without one is
#: refused in one line).
SEAMS = (
    "_build_accelerator_args",
    "_clip_grad_norm",
    "_get_collator_with_removed_columns",
    "_get_grad_norm",
    "_load_best_model",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_prepare_inputs",
    "_remove_unused_columns",
    "_save_optimizer_and_scheduler",
    "_set_signature_columns_if_needed",
    "get_tp_size",
)

T = TypeVar("T", bound=type)


class LaminaTrainerMixin(_TrainerBase):
    """Runs a Trainer (or subclass) on lamina's strategies instead of Accelerate's DDP.

    Keyword arguments beside the Trainer's own: ``strategy`` (a name or list, as
    ``lamina.distribute`` takes it) and ``mesh`` (as ``lamina.init`` takes it); or
    ``parallelism`` (a ``LaminaParallelism`` or Accelerate ``ParallelismConfig``), or
    ``TrainingArguments.parallelism_config``; ``strategy_options`` (the strategy's
    options, e.g. ``{"min_unit_numel": 0}``); ``example_inputs`` / ``example_kwargs``
    (the batch ``tp`` derives its split from; default: the first collated batch of
    ``train_dataset``). The model after ``__init__`` is the distributed one
    (``trainer.model.placement``, ``trainer.lamina_plan``)."""

    lamina_plan: LaminaPlan
    lamina_runtime: Runtime

    def __init__(
        self,
        *args: Any,
        strategy: str | Sequence[str] | None = None,
        mesh: Any = None,
        parallelism: Any = None,
        strategy_options: Mapping[str, Any] | None = None,
        example_inputs: tuple[Any, ...] | None = None,
        example_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        missing = [name for name in SEAMS if not hasattr(Trainer, name)]
        if missing:
            import transformers

            raise ConfigError(
                f"transformers {transformers.__version__} has no Trainer.{missing[0]}, which "
                "LaminaTrainer overrides; install the tested one: pip install 'lamina-core[hf]'"
            )
        super().__init__(*args, **kwargs)
        self._lamina_refuse_unsupported()
        asked, placement, spec = self._lamina_resolve(strategy, mesh, parallelism)
        if "pp" in asked.strategies:
            raise ConfigError(
                f"{type(self).__name__}: {asked.describe()} pipelines the model, whose "
                "microbatches run inside model.step(inputs, targets, loss_fn), which Trainer's "
                "forward/backward loop cannot call; drop pp here and run the pipeline in "
                "lamina's own loop (lamina.distribute(model, ['pp', ...], example_inputs=...), "
                "then loss = model.step(...)), as examples/train_gpt.py --strategy pp does"
            )
        runtime, plan = _join(asked, spec)
        # the columns the collator keeps come from the model's forward signature, which the
        # distributed model's class hides behind (*args, **kwargs): read it before
        self._set_signature_columns_if_needed()
        options = dict(strategy_options or {})
        if example_inputs is None and example_kwargs is None and "tp" in plan.strategies:
            example_kwargs = self._lamina_example_batch(plan)
        if example_inputs is not None:
            options["example_inputs"] = tuple(example_inputs)
        if example_kwargs is not None:
            options["example_kwargs"] = dict(example_kwargs)
        _forward_into_class(self._lamina_model)
        model = lamina.distribute(
            self._lamina_model,
            plan.strategy,
            placement=placement,
            runtime=runtime,
            **options,
        )
        # evaluation mode: mixed precision only, and marked prepared, so that the loop's
        # accelerator.prepare(model, optimizer) does not wrap it in DDP
        model = self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        self.model = self.model_wrapped = model
        self.callback_handler.model = model
        self.lamina_plan = plan
        self.lamina_runtime = runtime

    @property
    def _lamina_model(self) -> nn.Module:
        """The Trainer's model (there always is one: ``model_init`` is refused)."""
        model = self.model
        if model is None:
            raise ConfigError(f"{type(self).__name__}: no model; pass model=")
        return model

    # -- setup -------------------------------------------------------------------------------
    def _lamina_refuse_unsupported(self) -> None:
        """One line for each Trainer setting that would distribute the model another way."""
        name = type(self).__name__
        args = self.args
        refusals = (
            (
                self.model_init is not None,
                "model_init= (hyperparameter search) re-creates the "
                "model on every train(); pass model= instead",
            ),
            (
                bool(args.fsdp),
                "TrainingArguments.fsdp asks Accelerate to shard the model; drop "
                "it and give strategy='zero3' (or parallelism=)",
            ),
            (
                args.deepspeed is not None,
                "TrainingArguments.deepspeed hands the model to "
                "DeepSpeed; drop it and give strategy='zero3' (or parallelism=)",
            ),
            (
                bool(args.torch_compile),
                "torch_compile=True is not supported with lamina's strategies yet; drop it",
            ),
            (
                self.is_model_parallel,
                "the model was loaded across devices (device_map); load it on one device per rank",
            ),
            (
                self.is_distributed_loading_by_transformers,
                "the model was sharded at load time "
                "(from_pretrained(distributed_config=...)); load it whole",
            ),
            (
                isinstance(self.model, DistributedModule),
                "the model is distributed already; "
                "pass the model lamina.distribute has not wrapped",
            ),
        )
        for refused, why in refusals:
            if refused:
                raise ConfigError(f"{name}: {why}")
        launched = LaunchEnv.from_environ().world_size
        if args.world_size != launched:
            raise ConfigError(
                f"{name}: TrainingArguments runs {args.world_size} process(es) but the job has "
                f"WORLD_SIZE={launched}; on CPU pass TrainingArguments(use_cpu=True) (Accelerate "
                "treats CPU ranks as separate jobs without it)"
            )

    def _lamina_resolve(
        self, strategy: str | Sequence[str] | None, mesh: Any, parallelism: Any
    ) -> tuple[LaminaPlan, Placement | None, Any]:
        """The plan asked for (strategy and mesh given, or mapped from a parallelism
        config; default ``dp`` over the job), the placement of ``hsdp`` alone, and the
        mesh to ask ``lamina.init`` for (None: the one lamina has, else a flat one)."""
        from_args = self.args.parallelism_config
        configs = [c for c in (parallelism, from_args) if c is not None]
        if strategy is not None and configs:
            raise ConfigError(
                f"{type(self).__name__}: give strategy= (and mesh=) or a parallelism config "
                "(parallelism= or TrainingArguments.parallelism_config), not both"
            )
        if len(configs) == 2:
            raise ConfigError(
                f"{type(self).__name__}: parallelism= and TrainingArguments.parallelism_config "
                "are both set; give one"
            )
        world = self.args.world_size
        if configs:
            sizes = LaminaParallelism.from_accelerate(configs[0])
            if sizes.world_size == 1 and world > 1:  # as Accelerate: all ranks replicas
                sizes = LaminaParallelism(dp_replicate=world)
            sizes.check_world(world)
            plan = sizes.plan()
            placement = (
                Placement(shard=plan.shard, replicate=plan.replicate)
                if plan.shard or plan.replicate
                else None
            )
            return plan, placement, plan.mesh
        if mesh is not None and strategy is None:
            raise ConfigError(
                f"{type(self).__name__}: mesh={mesh!r} without strategy=; name the strategy "
                "(e.g. strategy=['tp', 'zero3'])"
            )
        named = "dp" if strategy is None else strategy
        chosen: str | tuple[str, ...] = named if isinstance(named, str) else tuple(named)
        spec = dict(mesh) if isinstance(mesh, Mapping) else mesh
        return LaminaPlan(_sizes_of(spec, world) or {}, chosen), None, spec

    def _lamina_example_batch(self, plan: LaminaPlan) -> dict[str, Any]:
        """The first ``per_device_train_batch_size`` rows of ``train_dataset``, collated as
        training collates them, on the device and without the labels: the forward ``tp``
        derives its split from."""
        dataset: Any = self.train_dataset
        if (
            dataset is None
            or not hasattr(dataset, "__getitem__")
            or not hasattr(dataset, "__len__")
        ):
            raise ConfigError(
                f"{type(self).__name__}: {plan.describe()} derives its split from one forward, "
                "and train_dataset gives no batch here (none, or not indexable); pass "
                "example_kwargs={'input_ids': ...} (one rank's batch)"
            )
        from transformers.utils.import_utils import is_datasets_available

        collate = self.data_collator
        if is_datasets_available():
            import datasets

            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="lamina example")
            else:
                collate = self._get_collator_with_removed_columns(collate, "lamina example")
        else:
            collate = self._get_collator_with_removed_columns(collate, "lamina example")
        rows = min(self.args.per_device_train_batch_size, len(dataset))
        batch = collate([dataset[i] for i in range(rows)])
        # the model's inputs only: a loss on the labels is not part of the split, it runs
        # on the gathered logits
        labels = {*self.label_names, "label", "label_ids"}
        prepared = self._prepare_inputs(batch)
        return {name: value for name, value in prepared.items() if name not in labels}

    # -- Accelerate: no parallelism of its own ------------------------------------------
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        """Trainer's Accelerator arguments without ``parallelism_config``: lamina builds
        the mesh and distributes the model, Accelerate only runs the loop."""
        built: dict[str, Any] = super()._build_accelerator_args(**kwargs)
        built.pop("parallelism_config", None)
        return built

    # -- data ----------------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        """Trainer's loader, sharded by the model's data replica."""
        return self._lamina_shard(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:  # type: ignore[type-arg]
        """Trainer's loader, sharded by the model's data replica."""
        return self._lamina_shard(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:  # type: ignore[type-arg]
        """Trainer's loader, sharded by the model's data replica."""
        return self._lamina_shard(super().get_test_dataloader(test_dataset))

    def _lamina_shard(self, loader: DataLoader) -> DataLoader:  # type: ignore[type-arg]
        """``loader`` (sharded by Accelerate over every rank) sharded over the data
        replicas instead: the ranks of a tensor-parallel group read the same batches."""
        replica = getattr(self.model, "data_replica", None)
        if replica is None:
            return loader
        index, count = replica
        if (index, count) == (self.args.process_index, self.args.world_size):
            return loader
        sampler = getattr(loader, "batch_sampler", None)
        if isinstance(sampler, BatchSamplerShard):
            sampler.num_processes, sampler.process_index = count, index
            return loader
        dataset = getattr(loader, "dataset", None)
        if isinstance(dataset, IterableDatasetShard):
            dataset.num_processes, dataset.process_index = count, index
            return loader
        raise ConfigError(
            f"{type(self).__name__}: {self.lamina_plan.describe()} gives {count} data "
            f"replica(s) over {self.args.world_size} ranks, and Accelerate's "
            f"{type(loader).__name__} here cannot be resharded; use a map-style dataset (or an "
            "IterableDataset without dispatch_batches)"
        )

    def get_tp_size(self) -> int:
        """Ranks reading the same batch (world size / data replicas): Trainer divides its
        token counts and loss scale by it."""
        replica = getattr(self.model, "data_replica", None)
        if replica is None:
            size: int = super().get_tp_size()
            return size
        world: int = self.args.world_size
        count: int = replica.count
        return max(1, world // count)

    # -- the step ------------------------------------------------------------------------------
    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The model's own ``clip_grad_norm_``: the whole model's norm over every shard and
        tensor-parallel slice, the same on every rank."""
        norm: torch.Tensor = model.clip_grad_norm_(self.args.max_grad_norm)  # type: ignore[operator]
        return norm

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        """The gradient norm Trainer logs (computed by the model when not clipped)."""
        if grad_norm is None:
            grad_norm = model.clip_grad_norm_(float("inf"))  # type: ignore[operator]
        return grad_norm

    # -- saving ----------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A full, unsharded ``save_pretrained`` folder (loadable by ``from_pretrained``):
        every rank gathers the state dict (``get_model_state_dict``, full), the main
        process writes it as Trainer does. Every rank calls it."""
        folder = str(self.args.output_dir if output_dir is None else output_dir)
        options = StateDictOptions(
            full_state_dict=True, cpu_offload=not self.args.save_on_each_node
        )
        state = get_model_state_dict(self._lamina_model, options=options)
        if self.args.should_save:
            self._lamina_write(folder, {name: _on_cpu(value) for name, value in state.items()})
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _lamina_write(self, output_dir: str, state: dict[str, Any]) -> None:
        """Trainer's ``_save`` of the gathered ``state``: the model class's own
        ``save_pretrained`` (transformers, peft) with it, the processing class and the
        training arguments beside."""
        folder = Path(output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        save_pretrained = _own_save_pretrained(self._lamina_model)
        if save_pretrained is None:  # not a transformers or peft model: the tensors alone
            from safetensors.torch import save_file

            save_file(state, str(folder / SAFE_WEIGHTS), metadata={"format": "pt"})
        else:
            save_pretrained(output_dir, state_dict=state, is_main_process=True)
        tokenizer = getattr(self.data_collator, "tokenizer", None)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, folder / TRAINING_ARGS_NAME)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The sharded model and optimizer state, scheduler and RNG states in
        ``output_dir/lamina`` (:class:`lamina.CheckpointManager`: DCP, one writer per
        rank). Every rank calls it."""
        manager = lamina.CheckpointManager(Path(output_dir) / STATE_DIR, keep=1)
        manager.save(
            self.state.global_step, self._lamina_model, _raw(self.optimizer), self.lr_scheduler
        )

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: nn.Module | None = None
    ) -> None:
        """A lamina checkpoint's model loads with its optimizer
        (:meth:`_load_optimizer_and_scheduler`); a checkpoint of whole weights
        (``model.safetensors``, sharded or not) loads into the distributed model."""
        target = self._lamina_model if model is None else model
        folder = Path(resume_from_checkpoint)
        if (folder / STATE_DIR).is_dir():
            return
        if not _weight_files(folder):  # adapters (peft) and the other forms Trainer knows
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        _load_whole_weights(target, folder)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Model, optimizer, scheduler and RNG states from the checkpoint's ``lamina``
        folder (resharded to this job's layout by DCP)."""
        if checkpoint is None:
            return
        root = Path(checkpoint) / STATE_DIR
        if root.is_dir():
            manager = lamina.CheckpointManager(root, keep=1)
            manager.load_latest(self._lamina_model, _raw(self.optimizer), self.lr_scheduler)
            return
        if (Path(checkpoint) / OPTIMIZER_FILE).is_file() and self.lamina_plan.strategy != "dp":
            raise ConfigError(
                f"{type(self).__name__}: {checkpoint} holds a whole-model optimizer state "
                f"({OPTIMIZER_FILE}, saved without lamina), which {self.lamina_plan.describe()} "
                "cannot load into its shards; resume it under strategy='dp' or start fresh"
            )
        super()._load_optimizer_and_scheduler(checkpoint)

    def _load_best_model(self) -> None:
        """The best checkpoint's whole weights, loaded into the distributed model."""
        best = self.state.best_model_checkpoint
        if best is not None and _weight_files(Path(best)):
            _load_whole_weights(self._lamina_model, Path(best))
            return
        super()._load_best_model()


class LaminaTrainer(LaminaTrainerMixin, Trainer):
    """``transformers.Trainer`` on lamina's strategies (see :class:`LaminaTrainerMixin`):
    ``LaminaTrainer(model=..., args=..., train_dataset=..., strategy=["tp", "zero3"],
    mesh={"fsdp": 2, "tp": 2})``, or with ``TrainingArguments(parallelism_config=...)``."""


_MADE: dict[type, type] = {}


def lamina_trainer(trainer_class: T) -> T:
    """``trainer_class`` (a ``transformers.Trainer`` subclass, e.g. TRL's ``SFTTrainer``)
    with :class:`LaminaTrainerMixin` in front: ``lamina_trainer(SFTTrainer)(model=...,
    args=..., strategy="zero3")``. The same class comes back for the same argument."""
    if not isinstance(trainer_class, type) or not issubclass(trainer_class, Trainer):
        raise ConfigError(
            f"lamina_trainer({trainer_class!r}): give a transformers.Trainer subclass "
            "(e.g. trl.SFTTrainer)"
        )
    if issubclass(trainer_class, LaminaTrainerMixin):
        return trainer_class
    made = _MADE.get(trainer_class)
    if made is None:
        made = type(
            f"Lamina{trainer_class.__name__}",
            (LaminaTrainerMixin, trainer_class),
            {"__doc__": f"{trainer_class.__name__} on lamina's strategies (LaminaTrainerMixin)."},
        )
        _MADE[trainer_class] = made
    return made  # type: ignore[return-value]


def _join(plan: LaminaPlan, spec: Any) -> tuple[Runtime, LaminaPlan]:
    """lamina's runtime on the mesh ``spec`` asks for (as ``lamina.init`` takes it; None:
    any): the one already joined (its mesh must be that one), else ``lamina.init``
    (reusing the process group Accelerate started); and ``plan`` with the runtime's mesh."""
    runtime = current()
    if runtime is None:
        runtime = lamina.init(mesh="flat" if spec is None else spec)
    have = dict(zip(runtime.mesh.axis_names, runtime.mesh.shape, strict=True))
    wanted = _sizes_of(spec, runtime.world_size)
    topology = spec == "topology" and set(have) == {"inter", "intra"}
    if spec is not None and have != wanted and not topology:
        raise ConfigError(
            f"lamina is already initialized with mesh {have}, but {plan.describe()} is asked "
            f"for; call lamina.init(mesh={spec!r}) instead (or lamina.shutdown() first)"
        )
    return runtime, replace(plan, mesh=have)


def _sizes_of(spec: Any, world: int) -> dict[str, int] | None:
    """The axis sizes a mesh spec of ``lamina.init`` names (None: it names none, or
    ``"topology"``, whose sizes the topology decides)."""
    if isinstance(spec, Mapping):
        return dict(spec)
    if spec == "flat":
        return {"dp": world}
    if isinstance(spec, tuple) and len(spec) == 2:
        shape, names = spec
        return dict(zip(names, shape, strict=True))
    return None


def _raw(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's wrapper."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"the Trainer's optimizer is a {type(optimizer).__name__}, not a torch optimizer; "
            "give a torch.optim.Optimizer (optimizers=(opt, scheduler) or args.optim)"
        )
    return optimizer


def _load_whole_weights(model: nn.Module, folder: Path) -> None:
    """The whole weights of a ``save_pretrained`` folder loaded into ``model``, each rank
    keeping its shards (every rank reads the files)."""
    from safetensors.torch import load_file

    full: dict[str, Any] = {}
    for path in _weight_files(folder):
        full.update(load_file(str(path), device="cpu"))
    # not strict: a tied weight is saved once (the other name is missing from the file)
    options = StateDictOptions(full_state_dict=True, strict=False)
    loaded = set_model_state_dict(model, full, options=options)
    if loaded.unexpected_keys:
        raise ConfigError(
            f"{folder} holds {len(loaded.unexpected_keys)} tensor(s) this model lacks (first: "
            f"{sorted(loaded.unexpected_keys)[0]!r}); load a checkpoint of this model"
        )


def _forward_into_class(model: nn.Module) -> None:
    """A ``forward`` set on the model object (TRL's ``SFTTrainer`` patches in a fused LM
    head) made the method of a subclass of the model's class, under the same name: the
    class ``lamina.distribute`` extends calls its base class's forward inside its own
    (which gathers what the forward reads), and an attribute on the object would bypass
    that forward altogether."""
    patched = model.__dict__.get("forward")
    if patched is None:
        return
    function = getattr(patched, "__func__", None)
    if function is None or getattr(patched, "__self__", None) is not model:
        raise ConfigError(
            f"the model's forward is replaced by {patched!r}, which is not a method bound to "
            "the model; patch it as types.MethodType(function, model) (or on a subclass)"
        )
    base = type(model)
    namespace = {
        "forward": function,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
    }
    model.__class__ = type(base.__name__, (base,), namespace)
    del model.__dict__["forward"]


def _own_save_pretrained(model: nn.Module) -> Any:
    """The model class's own ``save_pretrained`` (transformers', peft's) bound to
    ``model``, under the one lamina's sharded classes add: that one asks for
    ``full_parameters()``, which gathers only the ZeRO-3 shards, while the caller here
    passes the whole state dict already gathered (every split and shard). None: the
    class has none."""
    for klass in type(model).__mro__:
        if klass.__module__.startswith("lamina."):
            continue
        method = vars(klass).get("save_pretrained")
        if method is not None:
            return method.__get__(model, type(model))
    return None


def _on_cpu(value: Any) -> Any:
    """A state dict's tensor on the host (other values as they are)."""
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a ``save_pretrained`` folder (one, or an index's shards)."""
    single = folder / SAFE_WEIGHTS
    if single.is_file():
        return [single]
    index = folder / SAFE_INDEX
    if not index.is_file():
        return []
    import json

    names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [folder / name for name in names]


__all__ = ["LaminaTrainer", "LaminaTrainerMixin", "lamina_trainer"]
