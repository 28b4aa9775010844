"""Pipeline stages across submeshes (``PipeshardParallel``).

The forward pass of the loss function is captured as one call
(``capture.py``), inlined into one micro-batch's program ``P``
(``program.py``), cut into layers and stages (``stages.py``); the stages
and their submeshes are chosen (``search.py``, ``submesh.py``), each stage
is planned on its submesh (``planner.py``), its update cut out
(``apply.py``), compiled into forward, backward, sync and update
executables (``executables.py``, ``compile.py``) and run under a 1F1B or
GPipe schedule (``schedule.py``, ``runtime.py``), values moving between
submeshes by ``transfer.py``.
"""

from autopar.frontend.capture import mark_pipeline_boundary

__all__ = ["mark_pipeline_boundary"]
