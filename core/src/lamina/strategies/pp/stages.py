"""A rank's pipeline stages on one pruned copy of the model (:func:`build_stages`).

The model keeps its module tree and parameter names: blocks no local stage runs are
replaced, under their own names in whatever container holds them, by
:class:`SkippedBlock` (no parameters), the suffix's parameters are dropped
where no local stage is the last, and the prefix's parameters become plain tensors
(not parameters, not in the state dict) where no local stage is the first, because every
stage runs the prefix to get the blocks' side inputs (masks, position tables) under
``no_grad`` before it replaces the hidden state with the activation it received.

Each stage is a :class:`StageRunner`: an ``nn.Module`` whose parameters are only its
own (what torch's ``PipelineStage`` scales and steps) and whose forward runs the shared
model from the stage's first block to its last, stopping there by :class:`_StageDone`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lamina.graph.blocks import STANDS_IN_FOR
from lamina.strategies.pp.chain import BlockChain

#: Keyword under which positional model inputs travel to every stage (torch's schedules
#: hand keyword arguments to all stages and positional ones to the first only).
INPUT_KEY = "lamina_input_"


@dataclass(frozen=True)
class StageSpan:
    """Stage ``index`` of ``count``: blocks ``[start, stop)`` of the chain."""

    index: int
    count: int
    start: int
    stop: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1


class SkippedBlock(nn.Module):
    """A block another rank's stage runs: hands its first input on unchanged. It names
    the block's class (:data:`~lamina.graph.blocks.STANDS_IN_FOR`), so that a custom
    container holding it is still found as one."""

    def __init__(self, name: str, block: nn.Module | None = None) -> None:
        super().__init__()
        self.runs_on_another_stage = name
        if block is not None:
            setattr(self, STANDS_IN_FOR, type(block))

    def forward(self, x: Any, *_args: Any, **_kwargs: Any) -> Any:
        return x


class _StageDone(Exception):
    def __init__(self, output: torch.Tensor) -> None:
        super().__init__("stage finished")
        self.output = output


class _Running:
    """Which local stage the shared model is running now, and its received input."""

    def __init__(self) -> None:
        self.span: StageSpan | None = None
        self.received: torch.Tensor | None = None
        #: Whether the step records a graph (False: an evaluation, no backward).
        self.grad = True


class StageRunner(nn.Module):
    """One pipeline stage: ``forward(*received, lamina_input_0=..., **model_kwargs)``."""

    def __init__(
        self,
        model: nn.Module,
        chain: BlockChain,
        span: StageSpan,
        running: _Running,
    ) -> None:
        super().__init__()
        self.span = span
        #: Its blocks' forwards (set by :func:`build_stages`), in the chain's order.
        self.gates: tuple[GatedBlock, ...] = ()
        owned = [model.get_submodule(chain.blocks[i]) for i in range(span.start, span.stop)]
        if span.is_first:
            owned += [model.get_submodule(n) for n in chain.prefix]
        if span.is_last:
            owned += [model.get_submodule(n) for n in chain.suffix]
        self.owned = nn.ModuleList(owned)  # its parameters: what the stage trains
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_running", running)

    def running_now(self) -> bool:
        """Whether one of this rank's stages is running the shared model now."""
        running: _Running = self._running  # type: ignore[assignment]
        return running.span is not None

    def forward(self, *received: torch.Tensor, **inputs: Any) -> Any:
        args, kwargs = split_inputs(inputs)
        running: _Running = self._running  # type: ignore[assignment]
        model: nn.Module = self._model  # type: ignore[assignment]
        running.span = self.span
        running.received = received[0] if received else None
        grad_was = torch.is_grad_enabled()
        running.grad = grad_was
        try:
            # the prefix of a later stage only supplies side inputs: no graph for it
            torch.set_grad_enabled(grad_was and self.span.is_first)
            out = model(*args, **kwargs)
        except _StageDone as done:
            return done.output
        finally:
            torch.set_grad_enabled(grad_was)
            running.span = None
            running.received = None
        if hasattr(out, "logits"):  # a transformers ModelOutput
            return out.logits
        return out


def split_inputs(inputs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(positional, keyword) model inputs from a stage's keyword arguments."""
    positional = sorted(
        (int(k[len(INPUT_KEY) :]), v) for k, v in inputs.items() if k.startswith(INPUT_KEY)
    )
    kwargs = {k: v for k, v in inputs.items() if not k.startswith(INPUT_KEY)}
    return tuple(v for _, v in positional), kwargs


def join_inputs(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments every stage gets for the model's ``args`` and ``kwargs``."""
    return {**{f"{INPUT_KEY}{i}": a for i, a in enumerate(args)}, **kwargs}


def build_stages(
    model: nn.Module, chain: BlockChain, spans: Sequence[StageSpan]
) -> list[StageRunner]:
    """Prune ``model`` in place to what ``spans`` (this rank's stages) run; their runners."""
    running = _Running()
    local = {i for s in spans for i in range(s.start, s.stop)}
    for i, name in enumerate(chain.blocks):
        if i not in local:
            _replace(model, name, SkippedBlock(name, model.get_submodule(name)))
    if not any(s.is_last for s in spans):
        for name in chain.suffix:
            _drop_parameters(model.get_submodule(name))
    if not any(s.is_first for s in spans):
        kept = {id(p) for p in model.parameters() if not _under(p, model, chain.prefix)}
        for name in chain.prefix:
            _unregister_parameters(model.get_submodule(name), kept)
    for s in spans:
        first = model.get_submodule(chain.blocks[s.start])
        last = model.get_submodule(chain.blocks[s.stop - 1])
        _gate(first, last, s, running)
    gates = {
        index: _only_when_running(model.get_submodule(name), index, running)
        for index, name in enumerate(chain.blocks)
        if index in local
    }
    runners = [StageRunner(model, chain, s, running) for s in spans]
    for runner in runners:
        span = runner.span
        runner.gates = tuple(gates[i] for i in range(span.start, span.stop))
    return runners


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` in place of submodule ``name``, under the same name (any container:
    a list's ``"3"``, a dict's ``"blk_a"``, a custom module's attribute)."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def _under(param: nn.Parameter, model: nn.Module, prefixes: Sequence[str]) -> bool:
    return any(param is p for n in prefixes for p in model.get_submodule(n).parameters())


def _drop_parameters(module: nn.Module) -> None:
    """Remove every parameter of ``module`` (a suffix no local stage runs)."""
    for sub in module.modules():
        for name in list(sub._parameters):
            del sub._parameters[name]


def _unregister_parameters(module: nn.Module, kept: set[int]) -> None:
    """Turn ``module``'s parameters into plain tensors (a prefix run for side inputs
    only); a parameter also used by a local block or suffix (a tied weight) stays there."""
    for sub in module.modules():
        for name in list(sub._parameters):
            param = sub._parameters.pop(name)
            if param is not None:
                sub.__dict__[name] = param if id(param) in kept else param.detach()


def _gate(first: nn.Module, last: nn.Module, span: StageSpan, running: _Running) -> None:
    """Hooks: the stage's first block takes the received activation, its last block
    ends the forward there (unless the stage is the pipeline's last)."""

    def enter(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if running.span is not span:
            return None
        torch.set_grad_enabled(running.grad)
        if running.received is None:
            return None
        return (running.received, *args[1:]), kwargs

    def leave(_m: nn.Module, _args: Any, out: Any) -> None:
        if running.span is span and not span.is_last:
            raise _StageDone(out[0] if isinstance(out, (tuple, list)) else out)

    first.register_forward_pre_hook(enter, with_kwargs=True)
    last.register_forward_hook(leave)


def _only_when_running(block: nn.Module, index: int, running: _Running) -> GatedBlock:
    """A local block that another local stage's forward reaches hands its input on."""
    gate = GatedBlock(index, block.forward, running)
    block.forward = gate  # type: ignore[method-assign]
    return gate


class GatedBlock:
    """A local block's forward: it runs (:attr:`run`, the block's own forward, or what a
    compiled step puts there) only when a stage holding the block runs the model, and
    hands its first input on otherwise."""

    def __init__(self, index: int, run: Callable[..., Any], running: _Running) -> None:
        self.index = index
        self.run = run
        self._running = running

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        span = self._running.span
        if span is not None and not span.start <= self.index < span.stop:
            return x
        return self.run(x, *args, **kwargs)
