"""The exceptions leafpy raises.

Every error a user can cause is a :class:`LeafpyError`. Messages name the place (layer, config path, file),
what was expected, what was given, and how to fix it.
"""

from __future__ import annotations


class LeafpyError(Exception):
    """Base class of every error leafpy raises on bad input or an unusable environment."""


class ConfigError(LeafpyError, ValueError):
    """A configuration value or structure is invalid."""


class ShapeError(LeafpyError, ValueError):
    """A tensor's shape (or the type of its values) does not fit what a layer or network expects."""


class BackendError(LeafpyError, RuntimeError):
    """A backend failed to run an operation."""


class BackendUnavailable(BackendError):
    """A backend's package or device is missing; ``__cause__`` holds the import or device error."""


class SerializationError(LeafpyError):
    """A model, checkpoint or run file could not be written or read."""
