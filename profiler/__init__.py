"""torch model -> chain: graph capture, linearization into stages, per-stage timing and
memory measurement, bandwidth calibration, model zoo.  Built by issue #3; empty until then."""
