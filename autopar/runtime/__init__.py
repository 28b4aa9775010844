"""The runtime: running compiled steps, on one host or a Ray cluster.

Takes: the compiled stages (``autopar.backend``) and the step's arguments.
Gives: the step's outputs, the training state updated in place (donated).
``executor.py`` runs the micro-batch loop over a step's stages; ``base.py``
is the runtime interface, the local runtime and the active one, with
checkpoints (``checkpoint.py``); ``cluster.py`` and ``host_worker.py`` run
the same step on every host of a Ray cluster (``shards.py``: which shards
each host holds). For pipelines (their schedules are ``costs/schedule.py``'s):
values moved between submeshes (``transfer.py``), and the
runnable step assembled from the back end's executables, with its run loop
(``pipeline.py``).

Imports the back end, the planner, the plan and method, the costs, the
front end and the shared leaves.
"""
