"""The pipelined model (:class:`PipelinedModule`): the user's model object, pruned to
this rank's stages, with ``step(inputs, targets, loss_fn)`` running the schedule. Its
``named_parameters``, ``state_dict`` and DCP see this rank's stages under the model's
own names, so an optimizer built on ``model.parameters()`` steps them unchanged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

from lamina.errors import ConfigError
from lamina.runtime import ExecutionPlan, RunLog
from lamina.strategies.pp.cut import StageCut
from lamina.strategies.pp.engine import LossFn, PipelineEngine
from lamina.strategies.surface import DistributedModule
from lamina.verify import PreflightReport


@dataclass
class Pipelining:
    """A pipelined model's state (``model.lamina_pp``)."""

    engine: PipelineEngine
    cut: StageCut
    execution_plan: ExecutionPlan
    run_log: RunLog
    preflight: PreflightReport | None
    lines: tuple[str, ...]


class PipelinedModule(DistributedModule):
    """A model cut into pipeline stages; this rank holds the stages ``stages`` names."""

    lamina_pp: Pipelining

    #: Checkpoints key the optimizer's groups by parameter name: each stage's groups hold
    #: other parameters, so groups by position would collide across stages in DCP.
    checkpoint_state_options = StateDictOptions(flatten_optimizer_state_dict=True)

    @property
    def execution_plan(self) -> ExecutionPlan:
        """The step's plan: every stage's computes and transfers, the gradient sums."""
        return self.lamina_pp.execution_plan

    @property
    def run_log(self) -> RunLog:
        """What the setup issued."""
        return self.lamina_pp.run_log

    @property
    def stages(self) -> tuple[int, ...]:
        """The pipeline stages this rank runs."""
        return tuple(r.span.index for r in self.lamina_pp.engine.runners)

    @property
    def preflight(self) -> PreflightReport | None:
        """The pre-flight check's report (None when verification was off)."""
        return self.lamina_pp.preflight

    def evaluate(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: LossFn,
        input_kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """The mean microbatch loss of one batch, forward only, on every rank."""
        return self.lamina_pp.engine.evaluate(inputs, targets, loss_fn, input_kwargs)

    def step_summary(self) -> str:
        """The cut, one stage per line (after what ``"auto"`` chose, when it did)."""
        chosen = dict(self.execution_plan.meta).get("auto")
        lines = [f"auto chose {chosen}"] if chosen else []
        return "\n".join([*lines, *self.lamina_pp.lines])

    def step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: LossFn,
        input_kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one batch over the microbatches, by the schedule; the
        mean microbatch loss on every rank. Gradients stay for the optimizer."""
        return self.lamina_pp.engine.step(inputs, targets, loss_fn, input_kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The stage's part of the model's forward, called by the schedule; a one-line
        error when called directly."""
        engine = self.lamina_pp.engine
        if engine.runners and engine.runners[0].running_now():
            return super().forward(*args, **kwargs)
        raise ConfigError(
            "a pipelined model runs whole steps: call loss = model.step(inputs, targets, "
            "loss_fn), not model(inputs) (each rank holds only its stages)"
        )
