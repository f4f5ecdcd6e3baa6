"""torch model -> chain: graph capture, linearization into stages, per-stage timing and
memory measurement, encodable storages, bandwidth calibration, model zoo.

``profiler.profile.profile`` is ``offload profile`` as a function."""
