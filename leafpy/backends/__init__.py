"""Backend selection: ``backend(name)`` imports a backend's module only when it is first asked for."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import numpy as np

from ..errors import BackendError, BackendUnavailable, ConfigError, LeafpyError
from .base import PRECISIONS, PRIMITIVES, Backend

_MODULES = {
    "native": ("leafpy.backends.native", "NativeBackend"),
    "cuda": ("leafpy.backends.cuda", "CudaBackend"),
    "webgpu": ("leafpy.backends.webgpu", "WebGPUBackend"),
}
BACKEND_NAMES = tuple(_MODULES)
_default: dict[str, Backend] = {}
_REFUSED_PRECISIONS: dict[tuple[str, str], str] = {}
"""Why a backend whose class takes no ``precision`` option refuses a setting (it runs fp32 only)."""


def backend(name: str = "native", **options: Any) -> Backend:
    """The backend called ``name`` ("native", "cuda" or "webgpu").

    Without options the same instance is returned on every call. Raises BackendUnavailable when the backend's
    package or device is missing, saying what to install. ``precision`` ("fp32", "tf32", "bf16" or "fp16", default
    fp32) chooses mixed precision: fp32 master weights with bfloat16 or float16 activations (see Backend.precision);
    a backend that cannot run a precision refuses it with a BackendError.
    """
    if not isinstance(name, str) or name not in _MODULES:
        raise ConfigError(f"backend: unknown backend {name!r}; valid backends: {', '.join(BACKEND_NAMES)}")
    precision = options.get("precision", "fp32")
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ConfigError(f"backend {name!r}: unknown precision {precision!r}; valid precisions: "
                          f"{', '.join(PRECISIONS)}")
    if not options and name in _default:
        return _default[name]
    module_name, class_name = _MODULES[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BackendUnavailable(f"backend {name!r} is not part of this leafpy installation ({e})") from e
    cls = getattr(module, class_name)
    valid = [p.name for p in inspect.signature(cls).parameters.values() if p.kind is p.KEYWORD_ONLY
             or p.kind is p.POSITIONAL_OR_KEYWORD]
    if "precision" in options and "precision" not in valid:  # a backend that runs fp32 only
        if precision != "fp32":
            raise BackendError(f"backend {name!r}: precision {precision!r} is not available: "
                               f"{_REFUSED_PRECISIONS.get((name, precision), 'this backend runs fp32 only')}")
        options = {k: v for k, v in options.items() if k != "precision"}
        if not options and name in _default:
            return _default[name]
    layout = inspect.signature(cls).parameters.get("channels_last")
    stated = options.get("channels_last", True)  # (True where not given: nothing to drop)
    none_or_false = stated is None or (isinstance(stated, (bool, np.bool_)) and not stated)  # (not 0, not "")
    if none_or_false and (layout is None or stated == layout.default):
        # row-major is every backend's layout, and a backend's default is its default: neither is an option
        options = {k: v for k, v in options.items() if k != "channels_last"}
        if not options and name in _default:
            return _default[name]
    unknown = [k for k in options if k not in valid]
    if unknown:
        hint = (" (this backend stores tensors row-major only: leave out channels_last, train.channels_last in a "
                "run file)" if unknown[0] == "channels_last" else "")
        raise ConfigError(f"backend {name!r}: unknown option {unknown[0]!r}{hint}; valid options: {', '.join(valid)}")
    try:
        instance = cls(**options)
    except (TypeError, ValueError) as e:
        if isinstance(e, LeafpyError):
            raise
        given = ", ".join(f"{k}={v!r}" for k, v in options.items())
        raise ConfigError(f"backend {name!r}: invalid options ({given}): {e}; valid options: "
                          f"{', '.join(valid)}") from e
    if not options:
        _default[name] = instance
    return instance


def precision_option(precision: str, channels_last: bool | None = None) -> dict[str, Any]:
    """``backend()``'s options for ``precision`` and the ``channels_last`` layout (None: the backend's default for
    the precision): none for fp32 in the default layout, so the shared default instance serves it."""
    options: dict[str, Any] = {} if precision == "fp32" else {"precision": precision}
    if channels_last is not None:
        options["channels_last"] = channels_last
    return options


def run_backend(train: dict, name: str | None = None, precision: str | None = None, **options: Any) -> Backend:
    """The backend a run file's ``train`` section asks for (``backend``, ``precision``, ``channels_last``), with
    ``name`` and ``precision`` given on the command line taking their place."""
    layout = train.get("channels_last")
    chosen = name or str(train.get("backend", "native"))
    try:
        return backend(chosen, **options, **precision_option(precision or str(train.get("precision", "fp32")),
                                                              None if layout is None else bool(layout)))
    except BackendUnavailable as e:
        if name or chosen == "native":
            raise
        raise BackendUnavailable(f"{e} (the run's train.backend is {chosen!r}; --backend native runs it on the "
                                 "CPU)") from e.__cause__


def available_backends() -> list[str]:
    """Names of the backends that can run here (their package imports and a device exists)."""
    names = []
    for name in BACKEND_NAMES:
        try:
            backend(name)
        except BackendUnavailable:
            continue
        names.append(name)
    return names


__all__ = ["Backend", "BACKEND_NAMES", "PRECISIONS", "PRIMITIVES", "available_backends", "backend",
           "precision_option", "run_backend"]
