"""``LaminaTrainerStrategy``: lamina's strategies under the Lightning Trainer.

``Trainer(strategy=LaminaTrainerStrategy("zero3"))`` (or ``strategy="lamina_zero3"``
once :mod:`lamina.integrations.lightning` is imported) joins the job with ``lamina.init``
and distributes the LightningModule's network (its one child module holding parameters,
or the one ``module=`` names) with ``lamina.distribute``; ``training_step`` calls it as
before. Gradient clipping by norm goes through the model's ``clip_grad_norm_``,
accumulation through its ``no_sync()``, and checkpoints are sharded directories
(torch.distributed.checkpoint) that ``ckpt_path=`` resumes exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lamina.errors import ConfigError
from lamina.integrations.lightning import common
from lamina.session import MeshSpec

T = TypeVar("T")


class LaminaTrainerStrategy(ParallelStrategy):
    """Lightning Trainer strategy running ``lamina.distribute(network, strategy,
    **options)`` on the LightningModule's network.

    ``strategy`` is a lamina strategy or a composition (``"zero3"``, ``["tp", "zero3"]``);
    ``mesh`` what ``lamina.init(mesh=...)`` takes (default: tp inside each node and the
    rest across nodes, ``hsdp`` the topology, else flat); ``module`` the dotted name of
    the submodule to distribute (default: the LightningModule's one child holding
    parameters); ``init_weights(network)`` initializes a network built under
    ``trainer.init_module(empty_init=True)`` once distributed (default: each submodule's
    ``reset_parameters()``); ``options`` go to ``lamina.distribute`` (tp takes
    ``example_inputs=(batch,)``, else the LightningModule's ``example_input_array``).
    """

    def __init__(
        self,
        strategy: str | Sequence[str] = "dp",
        *,
        mesh: MeshSpec | None = None,
        module: str | None = None,
        init_weights: Callable[[nn.Module], None] | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        self.config = common.LaminaConfig.build(strategy, mesh, init_weights, module, options)
        self._launch = common.launch_env()
        self.parallel_devices = common.lamina_devices(self._launch)
        self._network: nn.Module | None = None
        self._network_name = ""

    @property
    @override
    def root_device(self) -> torch.device:
        if self.config.runtime is not None:
            return self.config.runtime.device
        devices = self.parallel_devices or [torch.device("cpu")]
        return devices[min(self.local_rank, len(devices) - 1)]

    @property
    @override
    def global_rank(self) -> int:
        return self._launch.rank

    @property
    @override
    def local_rank(self) -> int:
        return self._launch.local_rank

    @property
    @override
    def node_rank(self) -> int:
        return common.node_rank(self._launch)

    @property
    @override
    def world_size(self) -> int:
        return self._launch.world_size

    @property
    def num_nodes(self) -> int:
        """Nodes in the job (the launcher decides, not the Trainer's ``num_nodes``)."""
        return max(1, self.world_size // max(self._launch.local_world_size, 1))

    @num_nodes.setter
    def num_nodes(self, value: int) -> None:
        """The Trainer's ``num_nodes``: ignored (the launcher started the processes)."""

    @property
    def network(self) -> nn.Module:
        """The network lamina distributed (available after the Trainer's setup)."""
        if self._network is None:
            raise ConfigError(
                "LaminaStrategy: the network is distributed when the Trainer sets up; call it "
                "from a hook that runs after setup (on_fit_start, training_step, ...)"
            )
        return self._network

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """This rank's data replica, as the distributed network's ``data_replica`` says
        (a tp group shares one)."""
        index, count = self.network.data_replica  # type: ignore[misc]
        return {"num_replicas": count, "rank": index}

    @property
    def is_distributed(self) -> bool:
        """Always: the Trainer then gives each data replica its share through a
        ``DistributedSampler`` (:attr:`distributed_sampler_kwargs`)."""
        return True

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def _configure_launcher(self) -> None:
        common.check_launched(self.parallel_devices)

    @override
    def setup_environment(self) -> None:
        """Join the job (``lamina.init`` with this strategy's mesh) and this rank's device."""
        runtime = self.config.join()
        if self.cluster_environment is not None:
            self.cluster_environment.set_world_size(runtime.world_size)
            self.cluster_environment.set_global_rank(runtime.rank)
        rank_zero_only.rank = utils_rank_zero_only.rank = runtime.rank  # type: ignore[attr-defined]
        if self.accelerator is not None:
            try:
                self.accelerator.setup_device(self.root_device)
            except Exception as exc:
                raise ConfigError(
                    f"{self.config.describe()}: Lightning's {type(self.accelerator).__name__} "
                    f"cannot take lamina's device {self.root_device} (backend "
                    f"{runtime.backend.name}); pass Trainer(accelerator=...) matching it"
                ) from exc

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module()``: on this rank's device, or on the meta device with
        ``empty_init=True`` (setup then materializes only this rank's pieces)."""
        device = common.meta_init(True) if empty_init else self.root_device
        with device, self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Distribute the network (materialized if built on meta), then the optimizers."""
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.lightning_module)
        self.model_to_device()
        module = self.lightning_module
        name, network = common.owned_child(module, self.config.module)
        example = module.example_input_array
        inputs = None if example is None else example if isinstance(example, tuple) else (example,)
        distributed = common.distribute(network, self.config, self.root_device, inputs)
        if distributed is not network:
            parent, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, leaf, distributed)
        self._network, self._network_name = distributed, name
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def setup_precision_plugin(self) -> None:
        """Lightning's precision plugin, its clipping by norm through the network's
        ``clip_grad_norm_`` (the whole model's norm over every shard and slice)."""
        super().setup_precision_plugin()
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: float | int) -> None:
            common.clip_grad_norm(self.network, clip_val)

        setattr(plugin, "clip_grad_by_norm", clip_grad_by_norm)  # noqa: B010

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not common.on_meta(self.model):
            self.model.to(self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation steps inside the network's ``no_sync()``."""
        if self._network is None:
            yield
            return
        with common.no_sync(self._network, True):
            yield

    @override
    def reduce(
        self, tensor: torch.Tensor | Any, group: Any | None = None, reduce_op: Any = "mean"
    ) -> torch.Tensor | Any:
        return common.all_reduce(tensor, group, reduce_op)

    @override
    def all_gather(
        self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> torch.Tensor:
        return common.all_gather(tensor, group, sync_grads)

    @override
    def barrier(self, name: str | None = None) -> None:
        common.barrier()

    @override
    def broadcast(self, obj: T, src: int = 0) -> T:
        result: T = common.broadcast(obj, src)
        return result

    @override
    def teardown(self) -> None:
        """Lightning's teardown without moving the model to the CPU (its parameters are
        this rank's shards on the job's mesh) and without the cluster environment's (which
        deletes ``WORLD_SIZE``, set by the launcher): the job stays joined for the next
        run."""
        assert self.accelerator is not None
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    def _prefix(self) -> str:
        return f"{self._network_name}." if self._network_name else ""

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The LightningModule's state: the network's sharded (as DCP saves it) under its
        name, the rest as ``state_dict()`` gives it."""
        assert self.lightning_module is not None
        prefix = self._prefix()
        state = {
            k: v for k, v in self.lightning_module.state_dict().items() if not k.startswith(prefix)
        }
        state.update({prefix + k: v for k, v in common.model_state(self.network).items()})
        return state

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state keyed by the network's parameter names (sharded)."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return common.optimizer_state(self.network, optimizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        """A directory: the model's and optimizers' state through torch.distributed.
        checkpoint (each rank writes its pieces), the rest of Lightning's state (loops,
        schedulers, callbacks) in ``meta.pt``."""
        if storage_options is not None:
            raise ConfigError(
                f"{self.config.describe()}: checkpoints go through torch.distributed."
                "checkpoint, which takes no storage_options; drop storage_options="
            )
        directory = Path(self.broadcast(str(filepath)))
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        for index, state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{index}"] = state
        common.save_sharded(directory, tensors, checkpoint)

    @override
    def load_checkpoint(
        self, checkpoint_path: str | Path, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restore the network and the optimizers from a directory :meth:`save_checkpoint`
        wrote (on any layout: DCP reshards), and return the rest for Lightning to
        restore."""
        assert self.lightning_module is not None
        directory = Path(self.broadcast(str(checkpoint_path)))
        tensors: dict[str, Any] = {"state_dict": self.lightning_module_state_dict()}
        for index, optimizer in enumerate(self.optimizers):
            tensors[f"optimizer_{index}"] = self.optimizer_state(optimizer)
        metadata = common.load_sharded(directory, tensors, weights_only)
        strict = self.lightning_module.strict_loading
        prefix = self._prefix()
        loaded: Mapping[str, Any] = tensors["state_dict"]
        own = {k[len(prefix) :]: v for k, v in loaded.items() if k.startswith(prefix)}
        common.load_model_state(self.network, own, strict)
        rest = {k: v for k, v in loaded.items() if not k.startswith(prefix)}
        if rest:
            self.lightning_module.load_state_dict(rest, strict=False)
        for index, optimizer in enumerate(self.optimizers):
            opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            common.load_optimizer_state(self.network, opt, tensors[f"optimizer_{index}"])
        return metadata

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: :meth:`load_checkpoint` restored the model."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: :meth:`load_checkpoint` restored the optimizers."""

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """``lamina_dp``, ``lamina_zero3``, ``lamina_hsdp``, ``lamina_tp``,
        ``lamina_tp_zero3`` and ``lamina_tp_hsdp`` (each strategy on its default mesh)."""
        for name, names in common.REGISTERED.items():
            if name not in strategy_registry:
                # the registry's own `strategy` parameter is the factory: the names go in it
                strategy_registry.register(
                    name,
                    functools.partial(cls, list(names)),
                    description=f"lamina {' x '.join(names)} (lamina.distribute)",
                )


#: The Trainer strategy under the name the Fabric module gives its own.
LaminaStrategy = LaminaTrainerStrategy

__all__ = ["LaminaStrategy", "LaminaTrainerStrategy"]
