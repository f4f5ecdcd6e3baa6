"""schedule -> training: saved-tensor hooks, stage markers, copy streams, pinned arena, CPU
backends, run report.

``Offloaded`` (``executor.api``) applies a schedule in your own training loop;
``executor.train.train`` is ``offload train`` as a function."""
from .api import Offloaded

__all__ = ["Offloaded"]
