"""The model of one training step, torch-free (docs/model.md): what the profiler measures and
every other part reads.

``chain`` (stages, units, platform, recipe, and the chain's own document), ``actions``
(what a schedule may do to a unit) and ``schedule`` (actions bound to a chain), ``budget``
(what counts against a memory budget), ``memory`` (bytes held per op), ``recompute``
(where a recomputed run is rebuilt), ``encoding`` (encoded units as a derived chain),
``events`` (what happens at each point of a step, in order: the one reading of a schedule)
and ``simulate`` (the events replayed with times: the truth every figure comes from);
``chainfile`` and ``schedulefile`` read and write the formats, ``graph`` exports a chain
to networkx.  Depends only on ``offload.io`` and ``offload.errors``."""
