"""schedule -> training: saved-tensor hooks at stage boundaries on your own module, copy
streams, pinned host arena, CPU backends, run report.

``Offloaded`` (``offload.executor.api``) applies a schedule in your own training loop;
``offload.executor.train.train`` is ``offload train`` as a function.  Attributes are
imported on first use, so that ``offload``'s command line starts without torch."""
from typing import Any

__all__ = ["Offloaded"]


def __getattr__(name: str) -> Any:
    if name == "Offloaded":
        from .api import Offloaded
        return Offloaded
    raise AttributeError(name)
