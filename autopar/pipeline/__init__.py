"""Pipeline stages across submeshes (``PipeshardParallel``).

The forward pass of the loss function is captured as one call
(``capture.py``), inlined into one micro-batch's program ``P``
(``program.py``), cut into layers and stages (``stages.py``); each stage is
planned on its own submesh (``planner.py``), compiled into forward, backward,
sync and update executables (``lower.py``) and run under a 1F1B or GPipe
schedule (``schedule.py``, ``executor.py``).
"""

from autopar.pipeline.capture import mark_pipeline_boundary

__all__ = ["mark_pipeline_boundary"]
