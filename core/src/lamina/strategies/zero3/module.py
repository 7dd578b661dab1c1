"""The surface of a model sharded by ``zero3`` / ``hsdp``: :class:`ShardedModule`, the
methods its class gains, and :class:`Sharding`, what it carries besides its parameters.

The model's class is extended by :class:`ShardedModule`, not wrapped, so ``isinstance``
and every attribute of the model still hold; :func:`~.sharding.build_sharded` builds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from lamina.comm.algorithms import AlgorithmGroups
from lamina.errors import ConfigError
from lamina.memory import ShardLayout
from lamina.memory.engine import UnitState, Zero3Engine
from lamina.runtime import ExecutionPlan, RunLog
from lamina.strategies.context import StrategyContext
from lamina.strategies.contract import Placement as MeshPlacement
from lamina.strategies.surface import DistributedModule
from lamina.strategies.zero3.accounting import MemoryAccount, memory_accounting
from lamina.strategies.zero3.full_params import full_parameters_forward, summon_full_parameters
from lamina.strategies.zero3.load_full import sharded_state
from lamina.strategies.zero3.materialize import move_shards
from lamina.verify import PreflightReport


class Sharding:
    """What a sharded model carries besides its parameters (``model.lamina_sharding``)."""

    def __init__(
        self,
        ctx: StrategyContext,
        placement: MeshPlacement,
        layout: ShardLayout,
        execution_plan: ExecutionPlan,
        run_log: RunLog,
        preflight: PreflightReport | None,
        group: dist.ProcessGroup | None,
        param_dtype: torch.dtype | None,
    ) -> None:
        self.ctx = ctx
        self.placement = placement
        self.layout = layout
        self.execution_plan = execution_plan
        self.run_log = run_log
        self.preflight = preflight
        #: This rank's shard group (None: the whole job).
        self.group = group
        self.param_dtype = param_dtype
        self.engine: Zero3Engine | None = None
        #: The process groups of the hierarchical gathers and reduce-scatters (None:
        #: every unit is flat).
        self.algorithm_groups: AlgorithmGroups | None = None
        #: Units gathered for the whole forward: the root unit, and merged units that do
        #: not correspond to one submodule.
        self.whole_forward: list[UnitState] = []
        #: Whether parameters or buffers are still on the meta device (``to_empty`` first).
        self.on_meta = False


class ShardedModule(DistributedModule):
    """The methods a model sharded by ``zero3`` / ``hsdp`` gains (its class is extended,
    not wrapped, so ``isinstance`` and every attribute of the model still hold)."""

    lamina_sharding: Sharding

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Gather the root unit for the whole forward; block units gather around themselves."""
        sharding = self.lamina_sharding
        engine = sharding.engine
        assert engine is not None
        if sharding.on_meta:
            raise ConfigError(
                f"this {type(self).__name__} is on the meta device; call "
                "model.to_empty(device=...) and initialize or load it before the forward"
            )
        if engine.whole_step:  # a step holds the whole parameters: the plain forward
            if sharding.param_dtype is not None:
                args, kwargs = _cast_floats((args, kwargs), sharding.param_dtype)
            return super().forward(*args, **kwargs)
        if engine.summoned:
            return full_parameters_forward(self, super().forward, args, kwargs)
        if self.training and torch.is_grad_enabled():
            sharding.run_log.begin_step()
        engine.drop_stale_prefetches()
        if sharding.param_dtype is not None:  # mixed precision: floating inputs in its dtype
            args, kwargs = _cast_floats((args, kwargs), sharding.param_dtype)
        with engine.saved_views_as_tokens(), sharding.run_log.compute("forward"):
            for state in sharding.whole_forward:
                engine.enter_unit(state)
            try:
                out = super().forward(*args, **kwargs)
            finally:
                for state in sharding.whole_forward:
                    engine.leave_unit(state)
        if torch.is_grad_enabled():  # backward may recompute a forward that reads them
            engine.enter_on_backward(out, tuple(sharding.whole_forward))
        engine.finish_forward()
        return out

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``to()``, ``to_empty()``, ``cuda()`` and the like: the shard buffers are
        converted (``to_empty`` materializes only this rank's shards) and the parameters
        become views of the new buffers, the same parameter objects; buffers and
        anything else convert as torch converts them."""
        move_shards(self, fn, lambda: super(ShardedModule, self)._apply(fn, recurse))  # type: ignore[no-untyped-call]
        return self

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """torch's ``load_state_dict``, also from a full (unsharded) state dict held by
        every rank: each rank loads its rows of each parameter (no collective)."""
        strategy = self.execution_plan.strategy
        state = sharded_state(self, state_dict, assign, strategy)
        return super().load_state_dict(state, strict=strict, assign=assign)

    @contextmanager
    def full_parameters(self, writeback: bool = False) -> Iterator[None]:
        """Every parameter whole, as a plain tensor, on every rank for the block (like
        FSDP's ``summon_full_params``): for ``save_pretrained``, ``state_dict()`` of the
        whole model, or a fast ``generate``. Collective: every rank enters it. Holds the
        whole model on each rank. ``writeback=True`` copies the whole parameters back
        into the shards on exit (changes made inside then persist); otherwise they are
        dropped. Forwards inside run on the whole parameters, without autograd."""
        with summon_full_parameters(self, writeback):
            yield

    @property
    def execution_plan(self) -> ExecutionPlan:
        """The plan of one step (gathers, reduce-scatters, frees, the optimizer)."""
        return self.lamina_sharding.execution_plan

    @property
    def run_log(self) -> RunLog:
        """What each step issued and which run-time fallbacks it took."""
        return self.lamina_sharding.run_log

    @property
    def preflight(self) -> PreflightReport | None:
        """The pre-flight verification report (None when it was turned off)."""
        return self.lamina_sharding.preflight

    @property
    def lamina_engine(self) -> Zero3Engine:
        """The units and their gathers (for tests and inspection)."""
        engine = self.lamina_sharding.engine
        assert engine is not None
        return engine

    @property
    def lamina_layout(self) -> ShardLayout:
        """The shard layout (units, row splits, buffer sizes)."""
        return self.lamina_sharding.layout

    def step_summary(self) -> str:
        """One line: collectives of the last step and every fallback taken."""
        return self.lamina_sharding.run_log.summary()

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds for parameter shards, gradient shards and optimizer state."""
        account = memory_accounting(self, optimizer)
        return {
            "parameters": account.parameter_bytes,
            "gradients": account.gradient_bytes,
            "optimizer_state": account.optimizer_bytes,
        }

    def memory_accounting(self, optimizer: torch.optim.Optimizer | None = None) -> MemoryAccount:
        """This rank's model-state bytes against the ZeRO-3 formula (see ``.table()``)."""
        return memory_accounting(self, optimizer)


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_cast_floats(v, dtype) for v in value)
    if isinstance(value, list):
        return [_cast_floats(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value
