"""The back end: from a plan to XLA executables, and reading them back.

Takes: the split step (``autopar.frontend``) and its
:class:`~autopar.plan.Plan`. Gives: the compiled stages
(``accumulate_grad`` and the stages around it, ``apply_grad``) in a partially
manual ``shard_map`` with donated buffers (``lower.py``), the gradient path
they share with the pipeline's stages (``gradients.py``: seeding the loss,
accumulating over micro-batches, reducing over devices, combining
outputs), each pipeline stage's forward, backward and sync on its submesh
(``stage_executables.py``) and a pipeline's executables
(``pipeline_build.py``), and what a compiled stage's HLO holds: its
collectives, flops, bytes and memory (``hlo.py``).

Imports the plan and method, the costs, the front end and the shared
leaves; not the planner (``.importlinter``: the back end compiles a plan,
it does not make one).
"""
