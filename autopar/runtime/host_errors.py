"""The errors a Ray cluster's calls raise on the driver.

A host that dies, fails or stops answering is a :class:`ClusterError`; an
exception the step's own code raises on a host comes back as its own class
and a ``ClusterError`` at once (:func:`raised_on_host`).
"""

from __future__ import annotations

from autopar.errors import AutoparError

__all__ = ["ClusterError", "raised_on_host"]


class ClusterError(AutoparError):
  """A host worker died, failed or did not answer."""


# The class of an exception raised on a host -> its subclass that is a
# ClusterError too (process-wide: one per class).
_ON_HOST: dict[type, type] = {}


def raised_on_host(message: str, cause: BaseException) -> ClusterError:
  """The error a call re-raises on the driver for ``cause``, an exception
  the step's own code (a loader, say) raised on a host: a ClusterError
  saying ``message`` that is also an instance of ``cause``'s class, so that
  ``except ValueError:`` catches the ValueError a worker raised (the
  worker's exception is its ``__cause__``, with its attributes); a plain
  ClusterError where Python cannot make such a class."""
  cls = type(cause)
  if not isinstance(cause, Exception) or isinstance(cause, ClusterError):
    return ClusterError(message)
  both = _ON_HOST.get(cls)
  if both is None:
    try:
      both = type(cls.__name__, (ClusterError, cls), {
          "__init__": lambda self, m: Exception.__init__(self, m),
          "__str__": Exception.__str__, "__module__": cls.__module__,
          # (pickled, as to another process, it is a plain ClusterError: the
          # class made here is no module's attribute)
          "__reduce__": lambda self: (ClusterError, self.args),
          "__doc__": f"A {cls.__name__} raised on a host worker (a ClusterError too)."})
    except TypeError:     # (a class that cannot be a base with ClusterError)
      return ClusterError(message)
    _ON_HOST[cls] = both
  return both(message)
