"""What the profiler and the executor must agree on, in one place: stage boundaries on the
user's module (``staging``), which unit a saved storage belongs to (``units``), memory
meters and clocks (``meters``), the codecs of encoded storages (``encoders``), devices,
dtypes, optimizers and the tensors that live across steps (``devices``)."""
