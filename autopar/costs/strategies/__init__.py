"""Per-primitive sharding strategies, filled by registration.

``base.py`` holds the types (:class:`Strategy`, :class:`RuleContext`), the
registry (``register``, ``RULES``, ``strategies_for``) and the spec
helpers; the rule modules (``dot.py``, ``elementwise.py``, ``reductions.py``,
``shape_ops.py``, ``indexing.py``, ``constraints.py``) register their
rules when this package is imported, and import only ``base.py``.
"""

from autopar.costs.strategies.base import *  # noqa: F401,F403
from autopar.costs.strategies.base import __all__  # noqa: F401

# Register the rule modules (they only call `register`).
from autopar.costs.strategies import (constraints, dot, elementwise,  # noqa: E402,F401
                                      indexing, reductions, shape_ops)
