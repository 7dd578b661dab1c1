"""``LaminaFabricStrategy``: lamina's strategies under Lightning Fabric.

``Fabric(strategy=LaminaFabricStrategy("zero3"))`` (or ``strategy="lamina_zero3"`` once
:mod:`lamina.integrations.lightning` is imported) joins the job with ``lamina.init``,
distributes the model ``fabric.setup`` is given with ``lamina.distribute`` and saves
sharded checkpoints through torch.distributed.checkpoint. The processes are started by
torchrun or ``lamina run``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.types import _Stateful
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lamina.errors import ConfigError
from lamina.integrations.lightning import common
from lamina.session import MeshSpec

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import _LRScheduler

T = TypeVar("T")


class _NoSync(_BackwardSyncControl):
    """Fabric's ``no_backward_sync`` as the model's own ``no_sync()``."""

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager[Any]:
        return common.no_sync(module, enabled)


class LaminaFabricStrategy(ParallelStrategy):
    """Lightning Fabric strategy running ``lamina.distribute(model, strategy, **options)``.

    ``strategy`` is a lamina strategy or a composition (``"zero3"``, ``["tp", "zero3"]``);
    ``mesh`` what ``lamina.init(mesh=...)`` takes (default: tp inside each node and the
    rest across nodes, ``hsdp`` the topology, else flat); ``init_weights(model)``
    initializes a model built under ``fabric.init_module(empty_init=True)`` once
    distributed (default: each submodule's ``reset_parameters()``); ``options`` go to
    ``lamina.distribute`` (``example_inputs=(batch,)`` for tp).
    """

    def __init__(
        self,
        strategy: str | Sequence[str] = "dp",
        *,
        mesh: MeshSpec | None = None,
        init_weights: Callable[[nn.Module], None] | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        self.config = common.LaminaConfig.build(strategy, mesh, init_weights, None, options)
        self._backward_sync_control = _NoSync()
        self._launch = common.launch_env()
        self.parallel_devices = common.lamina_devices(self._launch)
        self._num_nodes = 1
        self._model: nn.Module | None = None

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
        """Nodes in the job (Fabric's ``num_nodes`` is not used: the launcher decides)."""
        return max(1, self.world_size // max(self._launch.local_world_size, 1))

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """This rank's data replica: the distributed model's ``data_replica`` (a tp group
        shares one), else every rank its own."""
        if self._model is not None:
            index, count = self._model.data_replica  # type: ignore[misc]
            return {"num_replicas": count, "rank": index}
        if "tp" in self.config.names:
            raise ConfigError(
                f"{self.config.describe()}: under tp a tensor-parallel group shares one data "
                "replica, which the distributed model says; call fabric.setup(model, ...) "
                "before fabric.setup_dataloaders(...)"
            )
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def model(self) -> nn.Module:
        """The model this strategy distributed (set up through ``fabric.setup``)."""
        if self._model is None:
            raise ConfigError("LaminaStrategy: no model set up yet; call fabric.setup(model)")
        return self._model

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
                    f"{runtime.backend.name}); pass Fabric(accelerator=...) matching it"
                ) from exc

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager[Any]:
        """``fabric.init_module()``: on this rank's device, or on the meta device with
        ``empty_init=True`` (setup then materializes only this rank's pieces)."""
        stack = ExitStack()
        stack.enter_context(common.meta_init(True) if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if not common.on_meta(module):
            module.to(self.root_device)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """``lamina.distribute`` the module (materialized on this rank's device if it was
        built on the meta device)."""
        model = common.distribute(module, self.config, self.root_device)
        self._model = model
        return model

    @override
    def setup_module_and_optimizers(
        self,
        module: nn.Module,
        optimizers: list[Optimizer],
        scheduler: _LRScheduler | None = None,
    ) -> tuple[nn.Module, list[Optimizer], _LRScheduler | None]:
        """Distribute the module, then point each optimizer at the parameters it holds now
        (ZeRO-3 shards and tensor-parallel slices replace the parameters, by name)."""
        before = {id(p): n for n, p in module.named_parameters()}
        model = self.setup_module(module)
        for optimizer in optimizers:
            common.remap_optimizer(optimizer, before, model)
        return model, optimizers, scheduler

    @override
    def teardown(self) -> None:
        """Lightning's teardown without the cluster environment's (which deletes
        ``WORLD_SIZE``, set by the launcher): the job stays joined."""
        self.precision.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @override
    def all_reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
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
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """The whole model's norm, clipped by ``model.clip_grad_norm_``."""
        self.precision.unscale_gradients(optimizer)
        return common.clip_grad_norm(module, max_norm, norm_type, error_if_nonfinite)

    @override
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """A directory: the modules' and optimizers' state through torch.distributed.
        checkpoint (sharded: each rank writes its pieces), the rest in ``meta.pt``."""
        if storage_options is not None or filter is not None:
            given = "storage_options" if storage_options is not None else "filter"
            raise ConfigError(
                f"{self.config.describe()}: save writes every rank's pieces through "
                f"torch.distributed.checkpoint, which takes no {given}; drop {given}="
            )
        directory = Path(self.broadcast(str(path)))
        modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
        tensors: dict[str, Any] = {}
        metadata: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, nn.Module):
                tensors[key] = common.model_state(obj)
            elif isinstance(obj, Optimizer):
                tensors[key] = common.optimizer_state(common.owner_of(obj, modules), obj)
            elif isinstance(obj, _Stateful):
                metadata[key] = obj.state_dict()
            else:
                metadata[key] = obj
        common.save_sharded(directory, tensors, metadata)

    @override
    def load_checkpoint(
        self,
        path: str | Path,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state``'s objects in place from a directory :meth:`save_checkpoint`
        wrote (on any layout: DCP reshards); returns what was not restored."""
        if not isinstance(state, dict) or not state:
            raise ConfigError(
                f"{self.config.describe()}: a sharded checkpoint loads into the objects it "
                "restores, by the names they were saved under; pass them: "
                "fabric.load(path, {'model': model, 'optimizer': optimizer})"
            )
        directory = Path(self.broadcast(str(path)))
        modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
        tensors: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, nn.Module):
                tensors[key] = common.model_state(obj)
            elif isinstance(obj, Optimizer):
                tensors[key] = common.optimizer_state(common.owner_of(obj, modules), obj)
        metadata = common.load_sharded(directory, tensors, weights_only)
        missing = [k for k in state if k not in tensors and k not in metadata]
        if strict and missing:
            raise KeyError(
                f"the checkpoint at {directory} holds no {missing[0]!r}; load with "
                "strict=False to skip it"
            )
        for key, obj in list(state.items()):
            if isinstance(obj, nn.Module):
                common.load_model_state(obj, tensors[key], strict)
            elif isinstance(obj, Optimizer):
                owner = common.owner_of(obj, modules)
                common.load_optimizer_state(owner, obj, tensors[key])
            elif key in metadata:
                if isinstance(obj, _Stateful):
                    obj.load_state_dict(metadata.pop(key))
                else:
                    state[key] = metadata.pop(key)
        return metadata

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


#: The Fabric strategy under the name the Trainer's module gives its own.
LaminaStrategy = LaminaFabricStrategy

__all__ = ["LaminaFabricStrategy", "LaminaStrategy"]
