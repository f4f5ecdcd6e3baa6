"""torch model -> chain: cut sites found by one real forward (``capture``), stages
(``linearize``), per-stage timing and memory of the user's own module (``measure``),
encodable storages (``encodable``), copy bandwidth (``bandwidth``).

``offload.profiler.profile.profile`` is ``offload profile`` as a function."""
