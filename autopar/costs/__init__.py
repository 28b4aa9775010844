"""The costs: what a layout of the step costs on a device mesh.

Takes: a program's equations and values, a mesh's axes and the hardware's
constants. Gives: each equation's sharding strategies with their compute
and collectives (``strategies/``: one rule per primitive), the α-β cost of
collectives and bytes per device (``cost_model.py``), the hardware tables
and device kinds (``devices.py``), measured constants (``calibrate.py``),
the values XLA holds together and the traffic at its fusion boundaries
(``liveness.py``, its rules keyed by platform), and submesh geometry for
pipelines (``submesh.py``).

Imports the front end and the shared leaves.
"""
