"""The planner: a sharding spec for every value of the step.

Takes: the split step (``autopar.frontend``), a method and its mesh, and
the costs (``autopar.costs``). Gives: a :class:`~autopar.plan.Plan`.
ShardParallel's plan is an ILP over every equation's strategies
(``ilp_graph.py`` builds the graph, ``ilp.py`` the problem and its
objective, ``ilp_memory.py`` the memory terms, ``lp.py`` PuLP 3 and 4,
``refine.py`` the classes of repeated layers; ``shard.py`` drives it and
prices layouts); the presets' (DataParallel, ZeRO-2/3) are priced alike
(``preset.py``); plans are kept on disk (``cache.py``) and solved again with
pins for ``explain`` (``replan.py``), from the problems they keep, in this
process or read back from their JSON (``solved.py``: the problems and what
turns their solutions into plans; ``ilp_saved.py``: a problem as data). For
pipelines: where layers start (``layers.py``), one ILP per stage
(``stage.py``), the stage and submesh search (``stage_search.py``), and the
pipeline's plan (``pipeline.py``).

Imports the plan and method, the costs, the front end and the shared
leaves.
"""
