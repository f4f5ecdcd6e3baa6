"""The torch side that the profiler and the executor share, so that a chain describes the step
that runs: stage boundaries on the user's module (``staging``), which unit ``Ui`` of the
chain a saved storage belongs to (``units``: a *unit* is always that, the bytes stage ``i``
saves for its backward), memory meters and clocks (``meters``), the byte formats of encoded
storages (``encoders``), re-running a recomputed stage (``rerun``), and devices, dtypes,
optimizers and the tensors that live across steps (``devices``).  Builds its tables from
the names of ``offload.step.names``."""
