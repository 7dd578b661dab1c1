"""The whole training step as one captured graph, for any strategy: ``lamina.compile_step``.

:mod:`.step` is what every compiled step shares (the shape bound, the declared
fallbacks, the eager path, the run log); :mod:`.graph_collectives` reads the captured
graph's collectives, checks them against the plan and across ranks before the first
replay; :mod:`.graph_break` names the module and the operation a capture stopped at;
:mod:`.functional_optim` is a stock optimizer's update as a traceable function. The
strategies' own steps (``dp``: :mod:`lamina.strategies.dp.compiled_step`; ``zero3`` and
``hsdp``: :mod:`lamina.strategies.zero3.compiled_step`) say what the graph holds.
"""
