"""autopar's version: recorded in every plan and part of the plan cache's key."""

__version__ = "0.1.0"
