"""Augmentation of image batches [N, C, H, W] on the host, as the Trainer assembles each training batch: a random
crop from the image padded with zeros, a small shift (edges repeated), horizontal and vertical flips. Each is one
gather over the whole batch (NumPy fancy indexing into a strided view), not a loop over its images. What a batch
gets is drawn from (data seed, epoch, batch index) alone, so a run resumed mid-epoch draws what the uninterrupted
run drew."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .. import _checks
from ..errors import ConfigError

KEYS = ("random_crop", "horizontal_flip", "vertical_flip", "shift")
"""The augmentations ``data.augment`` may ask for (applied in this order)."""

STREAM = 0xA06
"""Tells the augmentation's random numbers from the epoch's shuffle, which draws from (seed, epoch) alone."""


@dataclasses.dataclass(frozen=True)
class Augment:
    """``random_crop``: pad each side by this many zero pixels, then crop the image's size at a random place;
    ``shift``: move the image by up to this many pixels each way, repeating its edge pixels; flips with
    probability 1/2 each."""

    random_crop: int = 0
    horizontal_flip: bool = False
    vertical_flip: bool = False
    shift: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def active(self) -> bool:
        return bool(self.random_crop or self.shift or self.horizontal_flip or self.vertical_flip)


def from_dict(value: Any, where: str = "data.augment") -> Augment | None:
    """An :class:`Augment` from a run file's ``data.augment`` (None for none, or none asked for)."""
    if value is None or value is False:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping such as {{random_crop: 4, horizontal_flip: true}} (keys: "
                          f"{', '.join(KEYS)}), got {value!r}"[:300])
    unknown = [k for k in value if k not in KEYS]
    if unknown:
        raise ConfigError(f"{where}: unknown key{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}; the "
                          f"valid ones are {', '.join(KEYS)}"[:300])
    fields: dict[str, Any] = {}
    for key in ("random_crop", "shift"):
        if key in value:
            fields[key] = _checks.non_negative_int(f"{where}.{key} (pixels)", value[key])
    for key in ("horizontal_flip", "vertical_flip"):
        if key in value:
            if not isinstance(value[key], bool):
                raise ConfigError(f"{where}.{key}: expected true or false, got {value[key]!r}")
            fields[key] = value[key]
    aug = Augment(**fields)
    return aug if aug.active else None


def check_shape(aug: Augment, shape: Sequence[int], what: str) -> None:
    """Augmentation applies to images [C, H, W] per sample, moved by less than their size."""
    if len(shape) != 3:
        raise ConfigError(f"data.augment: augments images [channels, height, width], and {what} have shape "
                          f"{list(shape)} per sample; remove data.augment")
    for key in ("random_crop", "shift"):
        if getattr(aug, key) >= min(shape[1:]):
            raise ConfigError(f"data.augment.{key}: {getattr(aug, key)} pixels, and the images are {shape[1]}x"
                              f"{shape[2]}; give fewer pixels than the image's smaller side")


def draw(aug: Augment, n: int, seed: int, epoch: int, batch: int) -> dict[str, np.ndarray]:
    """What each of the ``n`` samples of batch ``batch`` of ``epoch`` gets: offsets (pixels, [n] each) and flips
    ([n] bool), from (seed, epoch, batch) alone."""
    rng = np.random.default_rng([seed, epoch, batch, STREAM])
    out: dict[str, np.ndarray] = {}
    for key in ("random_crop", "shift"):
        reach = getattr(aug, key)
        if reach:
            out[key] = rng.integers(-reach, reach + 1, size=(2, n))
    for key in ("horizontal_flip", "vertical_flip"):
        if getattr(aug, key):
            out[key] = rng.random(n) < 0.5
    return out


def take(draws: dict[str, np.ndarray], positions: np.ndarray) -> dict[str, np.ndarray]:
    """The draws of some of a batch's samples (a rank's share of a global batch)."""
    return {k: v[..., positions] for k, v in draws.items()}


def apply(x: np.ndarray, draws: dict[str, np.ndarray]) -> np.ndarray:
    """The batch ``x`` [N, C, H, W] augmented as ``draws`` (from :func:`draw`) say, as a new array."""
    if "random_crop" in draws:
        x = translate(x, draws["random_crop"], "constant")
    if "shift" in draws:
        x = translate(x, draws["shift"], "edge")
    if "horizontal_flip" in draws:
        x = flip(x, draws["horizontal_flip"], axis=3)
    if "vertical_flip" in draws:
        x = flip(x, draws["vertical_flip"], axis=2)
    return x


def translate(x: np.ndarray, offsets: np.ndarray, mode: str) -> np.ndarray:
    """out[i, :, h, w] = x[i, :, h + dy[i], w + dx[i]] for ``offsets`` [dy, dx] ([2, N]); outside the image: 0
    (``mode`` "constant") or the nearest edge pixel ("edge"). One gather over the batch: of every sample's
    [H, W] window at its offset, from a strided view of the padded batch's windows (no per-pixel index)."""
    dy, dx = offsets
    n, _, height, width = x.shape
    reach = int(max(np.abs(dy).max(initial=0), np.abs(dx).max(initial=0)))
    if reach == 0:
        return x.copy()
    padded = np.pad(x, ((0, 0), (0, 0), (reach, reach), (reach, reach)), mode=mode)  # type: ignore[call-overload]
    windows = sliding_window_view(padded, (height, width), axis=(2, 3))  # [N, C, 2r+1, 2r+1, H, W], a view
    return windows[np.arange(n), :, dy + reach, dx + reach]


def flip(x: np.ndarray, which: np.ndarray, axis: int) -> np.ndarray:
    """``x`` with the samples ``which`` marks reversed along ``axis``."""
    out = x.copy()
    out[which] = np.flip(x[which], axis=axis)
    return out
