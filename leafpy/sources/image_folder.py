"""A folder of images, one subfolder per class (their names, sorted, give the class indices), decoded with Pillow
into uint8 [N, C, H, W] and kept in a memory-mapped cache keyed by the folder's content, so a later run reads the
cache instead of decoding again. Files are untrusted: Pillow's decompression-bomb limit holds, the images' declared
sizes are checked against memory before anything is decoded, and a file that cannot be decoded is an error naming
it (or, with ``skip_unreadable``, skipped and listed)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._memory import available_memory
from ..errors import ConfigError, LeafpyError
from .mapped import Mapped
from .parts import Parts

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
"""The files read as images (case does not matter); other files in a class folder are ignored."""

MAX_IMAGES = 10_000_000
"""The most images one folder may hold."""

CACHE_VERSION = 1


def _pil() -> Any:
    try:
        from PIL import Image, ImageOps
    except ImportError as e:
        raise LeafpyError("image folders need Pillow: pip install pillow (or the data extra: pip install "
                          "\".[data]\")") from e
    return Image, ImageOps


def is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(EXTENSIONS)


def list_classes(root: str) -> tuple[list[str], list[str], np.ndarray]:
    """(class names, image files, their class indices) of a folder with one subfolder per class."""
    if not os.path.isdir(root):
        raise ConfigError(f"data.path: {root} is not a directory; give a folder holding one subfolder of images "
                          "per class")
    names = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    files: list[str] = []
    labels: list[int] = []
    for k, name in enumerate(names):
        found = image_files(os.path.join(root, name))
        files += found
        labels += [k] * len(found)
        if len(files) > MAX_IMAGES:
            raise LeafpyError(f"{root}: more than {MAX_IMAGES} images; split the data into several folders")
    if not files:
        raise ConfigError(f"data.path: {root} holds no images in class subfolders ({root}/CLASS/IMAGE.png; "
                          f"images are {', '.join(EXTENSIONS)})")
    empty = [n for k, n in enumerate(names) if k not in set(labels)]
    if empty:
        raise ConfigError(f"data.path: the class folder{'s' * (len(empty) > 1)} {', '.join(map(repr, empty))} in "
                          f"{root} hold{'s' * (len(empty) == 1)} no images; remove {'them' if len(empty) > 1 else 'it'}"
                          " or add images")
    return names, files, np.array(labels, np.int64)


def image_files(folder: str) -> list[str]:
    """The images under ``folder`` (its subfolders too), sorted by path."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out += [os.path.join(dirpath, f) for f in sorted(filenames) if is_image(f)]
        if len(out) > MAX_IMAGES:
            raise LeafpyError(f"{folder}: more than {MAX_IMAGES} images; split the data into several folders")
    return sorted(out)


def check_memory(files: Sequence[str], image_size: Sequence[int], channels: int, mapped: bool = False) -> None:
    """Refuse, before decoding, a set whose arrays (uint8 and float32; uint8 alone when ``mapped``, served from
    the cache) would not fit in the memory available."""
    need = len(files) * int(image_size[0]) * int(image_size[1]) * channels * (1 if mapped else 5)
    have = available_memory()
    if have is not None and need > have:
        raise LeafpyError(f"{os.path.dirname(os.path.dirname(files[0]))}: {len(files)} images of "
                          f"{image_size[0]}x{image_size[1]}x{channels} need {need / 2**30:.1f} GiB "
                          f"({'uint8' if mapped else 'uint8 and float32'}), more than the {have / 2**30:.1f} GiB "
                          "available; use a smaller image_size or fewer images"
                          + ("" if mapped else ", or data.memory_map: true (the samples read from the cache)"))


def decode(path: str, image_size: Sequence[int], channels: int) -> np.ndarray:
    """One image as uint8 [channels, H, W]: EXIF orientation applied, a GIF's first frame, 16-bit samples scaled
    to 8, converted to grayscale or RGB and resized (bilinear) to ``image_size``. A file Pillow cannot decode, or
    one past its decompression-bomb limit, is a LeafpyError naming it."""
    Image, ImageOps = _pil()
    h, w = int(image_size[0]), int(image_size[1])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                img.seek(0)
                img = ImageOps.exif_transpose(img)
                if img.mode in ("I;16", "I;16B", "I;16L", "I"):
                    wide = np.asarray(img, dtype=np.float64)
                    top = 65535.0 if img.mode.startswith("I;16") or wide.max(initial=0) > 255 else 255.0
                    img = Image.fromarray(np.clip(wide * (255.0 / top) + 0.5, 0, 255).astype(np.uint8), "L")
                img = img.convert("L" if channels == 1 else "RGB")
                if img.size != (w, h):
                    img = img.resize((w, h), Image.Resampling.BILINEAR)
                a = np.asarray(img, dtype=np.uint8)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, Image.DecompressionBombWarning,
            EOFError) as e:
        raise LeafpyError(f"{path}: cannot decode the image ({type(e).__name__}: {e}); remove or replace the file, "
                          "or set data.skip_unreadable: true to skip such files") from e
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


def decode_all(files: Sequence[str], image_size: Sequence[int], channels: int, skip_unreadable: bool,
               mapped: bool = False) -> tuple[np.ndarray, list[int]]:
    """uint8 [N, C, H, W] of the files that decode, and the indices of those skipped (``skip_unreadable``)."""
    check_memory(files, image_size, channels, mapped)
    out = np.empty((len(files), channels, int(image_size[0]), int(image_size[1])), np.uint8)
    skipped: list[int] = []
    for i, f in enumerate(files):
        try:
            out[i - len(skipped)] = decode(f, image_size, channels)
        except LeafpyError:
            if not skip_unreadable:
                raise
            skipped.append(i)
    return out[:len(files) - len(skipped)], skipped


def default_cache_dir() -> str:
    return os.environ.get("LEAFPY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "leafpy", "images")


def cache_key(files: Sequence[str], image_size: Sequence[int], channels: int) -> str:
    """A digest of the folder's content as the file system describes it (names, sizes, modification times) and
    of the decoding asked for: a file added, removed, renamed or changed gives another key."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps([CACHE_VERSION, list(map(int, image_size)), channels]).encode())
    for f in files:
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def cached_decode(files: Sequence[str], image_size: Sequence[int], channels: int, skip_unreadable: bool,
                  cache_dir: str | None, mapped: bool = False) -> tuple[np.ndarray, list[int]]:
    """:func:`decode_all` through the cache in ``cache_dir`` (None: decode without one): ``KEY.npy`` (uint8,
    memory-mapped when read) and ``KEY.json`` (the files skipped)."""
    if cache_dir is None:
        return decode_all(files, image_size, channels, skip_unreadable, mapped)
    key = cache_key(files, image_size, channels)
    array_path, meta_path = os.path.join(cache_dir, key + ".npy"), os.path.join(cache_dir, key + ".json")
    shape = (channels, int(image_size[0]), int(image_size[1]))
    try:
        with open(meta_path) as f:
            skipped = [int(i) for i in json.load(f)["skipped"]]
        images = np.load(array_path, mmap_mode="r", allow_pickle=False)
        if images.dtype == np.uint8 and images.shape == (len(files) - len(skipped), *shape) \
                and (skip_unreadable or not skipped):
            return images, skipped
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no cache yet, or a damaged one: decode again
    images, skipped = decode_all(files, image_size, channels, skip_unreadable, mapped)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        _replace(cache_dir, array_path, lambda f: np.save(f, images))
        _replace(cache_dir, meta_path, lambda f: f.write(json.dumps({"skipped": skipped}).encode()))
    except OSError as e:  # a cache that cannot be written costs a decode next time, nothing else
        warnings.warn(f"leafpy: cannot write the image cache in {cache_dir} ({e.strerror or e})", stacklevel=2)
        return images, skipped
    return (np.load(array_path, mmap_mode="r", allow_pickle=False) if mapped else images), skipped


def _replace(directory: str, target: str, write: Any) -> None:
    """Write a cache file through a temporary one beside it, so a reader never sees half of it."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_folder(root: str, image_size: Sequence[int], channels: int, skip_unreadable: bool,
                cache_dir: str | None, mapped: bool = False) -> tuple[list[str], Any, np.ndarray, list[str]]:
    """(class names, float32 images [N, C, H, W] in [0, 1], labels, the files skipped) of one class folder;
    ``mapped``: the images as :class:`Mapped` samples over the uint8 cache, converted a batch at a time."""
    names, files, labels = list_classes(root)
    images, skipped = cached_decode(files, image_size, channels, skip_unreadable, cache_dir, mapped)
    if skipped:
        labels = np.delete(labels, skipped)
    if not len(labels):
        raise LeafpyError(f"{root}: none of the {len(files)} images could be decoded")
    samples = Mapped(images) if mapped else images.astype(np.float32) / np.float32(255.0)
    return names, samples, labels, [files[i] for i in skipped]


def check_size(image_size: Any, channels: Any) -> tuple[tuple[int, int], int]:
    if not isinstance(image_size, (list, tuple)) or len(image_size) != 2 or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 65536 for v in image_size):
        raise ConfigError(f"data.image_size: expected [height, width] in pixels, got {image_size!r}")
    if channels not in (1, 3) or isinstance(channels, bool):
        raise ConfigError(f"data.channels: expected 1 (grayscale) or 3 (RGB), got {channels!r}")
    return (int(image_size[0]), int(image_size[1])), int(channels)


def read(path: str | dict[str, str], *, image_size: Sequence[int] | None = None, channels: int = 3,
         skip_unreadable: bool = False, cache_dir: str | None = "default", memory_map: bool = False) -> Parts:
    """A folder with one subfolder of images per class, or ``{"train": DIR, "test": DIR}`` (see
    ``lp.data.image_folder``), as :class:`Parts`."""
    if cache_dir == "default":
        cache_dir = default_cache_dir()
    roots = path if isinstance(path, dict) else {"train": path}
    if isinstance(path, dict) and set(path) != {"train", "test"}:
        raise ConfigError(f"data.path: expected a folder, or {{train: DIR, test: DIR}}, got {path!r}"[:300])
    if image_size is None:
        files = list_classes(roots["train"])[1]
        with _pil()[0].open(files[0]) as first:
            image_size = (first.height, first.width)
    size, channels = check_size(list(image_size), channels)
    parts = {k: read_folder(os.fspath(v), size, channels, skip_unreadable, cache_dir, memory_map)
             for k, v in roots.items()}
    names, x, y, skipped = parts["train"]
    name = os.path.basename(os.path.normpath(os.fspath(roots["train"])))
    test = None
    if "test" in parts:
        test_names, x_test, y_test, test_skipped = parts["test"]
        unknown = sorted(set(test_names) - set(names))
        if unknown:
            raise ConfigError(f"data.path.test: {roots['test']} has class folders the training folder "
                              f"{roots['train']} lacks: {', '.join(map(repr, unknown))}")
        test = (x_test, np.searchsorted(names, np.asarray(test_names)[y_test]).astype(np.int64))
        skipped = skipped + test_skipped
    return Parts(name, x, y, len(names), test, tuple(names), tuple(skipped))
