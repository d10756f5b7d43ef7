"""Errors kvquant raises for bad settings and bad inputs (never a silent wrong result)."""


class KVQuantError(ValueError):
    """A setting or an input kvquant cannot honour; the message says what to change."""


class NonFiniteKVError(KVQuantError):
    """A key or value state holds NaN or Inf.

    kvquant refuses to store it: a min-max or amax scale computed over a group holding NaN/Inf would
    silently corrupt every other element of that group, so the update raises instead.
    """
