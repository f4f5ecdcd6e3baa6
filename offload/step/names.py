"""The names that files, the command line and the torch side share, each listed once.

A chain's recipe names a dtype, an autocast dtype and an optimizer, and its encodings name
encoders; ``offload train`` names a copy backend.  The torch-free side validates and
offers these names; the torch side (``offload.core.devices``, ``offload.core.encoders``,
``offload.executor.backends``) builds its tables from them, so neither can know a name the
other does not.
"""
DTYPES = ("float32", "bfloat16", "float16")  # parameter and activation dtypes (torch's names)
AUTOCAST = ("bfloat16", "float16")  # torch.autocast dtypes
OPTIMIZERS = ("adam", "adamw", "sgd", "none")  # their state is constant memory: base_bytes
ENCODERS = ("sign-mask", "sparse", "bf16")  # byte formats of encoded storages (docs/encodings.md)
BACKENDS = ("cuda", "cpu-eager", "cpu-lazy")  # where the executor's copies run
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # torch.compile backends a chain may be profiled under
WHOLE_GRAPH_BACKENDS = ("inductor", "aot_eager")  # those that compile one graph with our partitioner (--whole-graph)
EAGER_KERNEL_BACKENDS = ("aot_eager", "eager")  # those that run the eager model's kernels, as a re-run recorded eagerly does


def other_kernels(backend: str | None) -> bool:
    """Whether a model compiled by ``backend`` (``None``: not compiled) runs other kernels than
    its eager code, which a stage recorded for a re-run runs (``rerun._EagerWhileRecording``)."""
    return backend is not None and backend not in EAGER_KERNEL_BACKENDS


def table(names: tuple[str, ...], entries: dict, what: str) -> dict:
    """``entries`` in the order of ``names``; a ``ValueError`` at import if either has a name the
    other lacks (a name added on one side only)."""
    if set(entries) != set(names):
        raise ValueError(f"{what}: {sorted(set(entries) ^ set(names))} on one side only (offload.step.names)")
    return {name: entries[name] for name in names}
