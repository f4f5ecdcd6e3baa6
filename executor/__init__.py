"""schedule -> training: saved-tensor hooks, stage markers, copy streams, pinned arena,
CPU backends, run report.  Built by issue #4; empty until then."""
