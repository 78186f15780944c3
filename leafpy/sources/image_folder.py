"""A folder of images, one subfolder per class (their names, sorted, give the class indices), decoded with Pillow
into uint8 [N, C, H, W] and kept in a memory-mapped cache keyed by the folder's content, so a later run reads the
cache instead of decoding again; without a cache the images are decoded as they are first read (see
:mod:`.decoding`), so the first epoch trains while the folder is decoded. Files are untrusted: Pillow's
decompression-bomb limit holds, the images' declared sizes are checked against memory before anything is decoded,
and a file that cannot be decoded is an error naming it (or, with ``skip_unreadable``, skipped and listed)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import struct
import tempfile
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import _checks
from .._memory import available_memory
from ..errors import ConfigError, LeafpyError
from . import decoding
from .mapped import Mapped
from .parts import Parts

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
"""The files read as images (case does not matter); other files in a class folder are ignored."""

MAX_IMAGES = 10_000_000
"""The most images one folder may hold."""

CACHE_VERSION = 3
"""Part of a cache's key: raised when decoding changes what a file gives (2: floating-point images scaled, where
they had been clipped to black; 3: 32-bit integer images outside [0, 65535] refused, where they had been
clipped)."""

WIDE_MODES = ("I;16", "I;16B", "I;16L", "I", "F")
"""Pillow's modes of 16-bit, 32-bit integer and floating-point pixels, scaled to 8 bits as they are decoded."""
VIA_RGB = ("LAB",)
"""Pillow's modes it converts to RGB but not straight to grayscale (CIELAB): converted to RGB first, so their gray
is that of the image's RGB decode."""
BAND_PIXELS = 1 << 20
"""How many pixels of such an image are scaled at a time (in float64: 8 MB)."""
DECODE_BYTES = 16
"""The most memory decoding an image holds at once, a pixel: its pixels as Pillow keeps them (up to 4 bytes each),
a copy (turned upright, or handed to NumPy to scale wide pixels to 8 bits), the 8-bit result and the image
converted to grayscale or RGB (up to 4 bytes a pixel)."""

EXIF_ORIENTATION = 0x0112
"""The EXIF tag of how a photo is turned (5-8: a quarter turn, so its stored width is its height)."""


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
    """The images under ``folder`` (its subfolders too, linked ones as well), sorted by path. A folder met again
    (a link to one already walked, or a link cycle) is walked once."""
    out = []
    walked = {os.path.realpath(folder)}
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = [d for d in sorted(dirnames) if not d.startswith(".") and _first_visit(dirpath, d, walked)]
        out += [os.path.join(dirpath, f) for f in sorted(filenames) if is_image(f)]
        if len(out) > MAX_IMAGES:
            raise LeafpyError(f"{folder}: more than {MAX_IMAGES} images; split the data into several folders")
    return sorted(out)


def _first_visit(parent: str, name: str, walked: set[str]) -> bool:
    """Whether the folder ``parent/name`` leads somewhere not walked yet (then counted as walked)."""
    real = os.path.realpath(os.path.join(parent, name))
    if real in walked:
        return False
    walked.add(real)
    return True


def check_memory(files: Sequence[str], image_size: Sequence[int], channels: int, mapped: bool = False) -> None:
    """Refuse, before decoding into memory, a set whose uint8 images would not fit in the memory available
    (``mapped``: a memory-mapped run, whose cache could not be written)."""
    need = len(files) * int(image_size[0]) * int(image_size[1]) * channels
    have = available_memory()
    if have is not None and need > have:
        raise LeafpyError(f"{os.path.dirname(os.path.dirname(files[0]))}: {len(files)} images of "
                          f"{image_size[0]}x{image_size[1]}x{channels} need {need / 2**30:.1f} GiB (uint8), more "
                          f"than the {have / 2**30:.1f} GiB available; use a smaller image_size or fewer images"
                          + ("" if mapped else ", or data.memory_map: true (the samples read from the cache)"))


def decode(path: str, image_size: Sequence[int], channels: int) -> np.ndarray:
    """One image as uint8 [channels, H, W]: EXIF orientation applied, a GIF's first frame, 16-bit samples scaled
    to 8, converted to grayscale or RGB and resized (bilinear) to ``image_size``. A file Pillow cannot decode (its
    readers of damaged files raise NotImplementedError, IndexError, TypeError... as well as OSError), or one past
    its decompression-bomb limit, is a LeafpyError naming it."""
    Image, ImageOps = _pil()
    h, w = int(image_size[0]), int(image_size[1])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                limit = Image.MAX_IMAGE_PIXELS  # (checked here too: the warning filter above is the process's, and
                if limit and img.width * img.height > limit:  # a decoding thread's may be restored under another's)
                    raise ValueError(f"{img.width}x{img.height} pixels, more than Pillow's decompression bomb limit "
                                     f"Image.MAX_IMAGE_PIXELS ({limit})")
                _check_decode_memory(path, img.width * img.height)
                img.seek(0)
                img = ImageOps.exif_transpose(img)
                if img.mode in WIDE_MODES:
                    img = Image.fromarray(_eight_bit(img), "L")
                if channels == 1 and img.mode in VIA_RGB:
                    img = img.convert("RGB")
                img = img.convert("L" if channels == 1 else "RGB")
                if img.size != (w, h):
                    img = img.resize((w, h), Image.Resampling.BILINEAR)
                a = np.asarray(img, dtype=np.uint8)
    except (OSError, ValueError, TypeError, SyntaxError, Image.DecompressionBombError, Image.DecompressionBombWarning,
            EOFError, NotImplementedError, IndexError, KeyError, struct.error) as e:  # (what Pillow's readers raise
        # for damaged files: TypeError for a TIFF tag of another type; anything else is a bug, left to surface)
        raise LeafpyError(f"{path}: cannot decode the image ({type(e).__name__}: {str(e)[:200]}); remove or replace "
                          "the file, or set data.skip_unreadable: true to skip such files") from e
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


def _check_decode_memory(path: str, pixels: int) -> None:
    """Refuse, from its header, an image whose decoding would take more memory than this process has available
    (see :data:`DECODE_BYTES`): a 171 KB PNG can hold 9400x9400 16-bit pixels."""
    need, have = pixels * DECODE_BYTES, available_memory()
    if have is not None and need > have:
        raise LeafpyError(f"{path}: decoding its {pixels:,} pixels needs about {_checks._bytes(need)}, more than "
                          f"the {_checks._bytes(have)} available; save the image smaller, or remove it")


def _eight_bit(img: Any) -> np.ndarray:
    """A 16-bit, 32-bit integer or floating-point image's pixels as uint8, scaled to its white (16-bit: 65535; 32-bit
    integers: 255, or 65535 where a pixel is brighter, refused outside [0, 65535]; floats: see :func:`_float_top`)
    and rounded, in float64 a band of rows at a time into the result (a whole image in float64, and its temporaries,
    took 30 bytes a pixel)."""
    wide = np.asarray(img)  # (as Pillow holds them: uint16, int32 or float32)
    if img.mode == "I":
        _check_integers(wide)
    top = 65535.0 if img.mode.startswith("I;16") or wide.max(initial=0) > 255 else 255.0
    if img.mode == "F":  # 32-bit floats: in [0, 1] (scaled to 255) or in [0, 255]
        top = _float_top(wide)
    out = np.empty(wide.shape, np.uint8)
    step = max(1, BAND_PIXELS // max(1, wide.shape[1]))
    for start in range(0, len(wide), step):
        band = wide[start:start + step].astype(np.float64)
        band *= 255.0 / top
        band += 0.5
        out[start:start + step] = np.clip(band, 0, 255, out=band)  # (truncated, as astype(np.uint8) does)
    return out


def _check_integers(values: np.ndarray) -> None:
    """Refuse a 32-bit integer image (Pillow's mode I) with values outside [0, 65535]: they have no white leafpy can
    tell (clipped, a negative pixel would be black and one past 65535 white)."""
    low, high = int(values.min(initial=0)), int(values.max(initial=0))
    if low < 0 or high > 65535:
        raise ValueError(f"a 32-bit integer image with values outside [0, 65535] (from {low} to {high}); save it as "
                         "8- or 16-bit pixels")


def _float_top(values: np.ndarray) -> float:
    """The white of a floating-point image (Pillow's mode F, as a float TIFF): 1.0 where its values lie in [0, 1],
    255.0 where in [0, 255]; others (negative, larger, not finite) have no white leafpy can tell, and are refused."""
    finite = np.isfinite(values)
    if not finite.all() or values.min(initial=0) < 0 or values.max(initial=0) > 255:
        seen = (f"from {values[finite].min():g} to {values[finite].max():g}" if finite.any() else "none finite") + \
            ("" if finite.all() else ", some not finite")
        raise ValueError(f"a floating-point image with values outside [0, 1] and [0, 255] ({seen}); save it as 8- or "
                         "16-bit pixels")
    return 1.0 if values.max(initial=0) <= 1 else 255.0


def decode_all(files: Sequence[str], image_size: Sequence[int], channels: int, skip_unreadable: bool,
               mapped: bool = False, workers: int = 0, mode: str = "auto") -> tuple[np.ndarray, list[int]]:
    """uint8 [N, C, H, W] of the files that decode, and the indices of those skipped (``skip_unreadable``);
    ``workers`` > 1 threads or processes decode (``mode``, :data:`decoding.MODES`), the files taken in order all
    the same."""
    check_memory(files, image_size, channels, mapped)
    out = np.empty((len(files), channels, int(image_size[0]), int(image_size[1])), np.uint8)
    skipped: list[int] = []
    for i, image in enumerate(_each(files, image_size, channels, workers, mode)):
        if isinstance(image, LeafpyError):
            if not skip_unreadable:
                raise image
            skipped.append(i)
        elif isinstance(image, Exception):  # (a reader's own failure, met by a decoding process)
            raise image
        else:
            out[i - len(skipped)] = image
    return out[:len(files) - len(skipped)], skipped


WINDOW = 256
"""How many files :func:`_each` gives its threads at a time (what it holds decoded ahead of its reader)."""


def decode_or_error(path: str, image_size: Sequence[int], channels: int) -> np.ndarray | LeafpyError:
    """:func:`decode`, or the LeafpyError that names the file."""
    try:
        return decode(path, image_size, channels)
    except LeafpyError as e:
        return e


def processes(workers: int, image_size: Sequence[int], channels: int) -> decoding.Processes:
    return decoding.Processes(workers, image_size, channels,
                              functools.partial(decode_or_error, image_size=image_size, channels=channels))


def _each(files: Sequence[str], image_size: Sequence[int], channels: int, workers: int, mode: str = "auto"
          ) -> Iterator[np.ndarray | Exception]:
    """Each file decoded, or the LeafpyError that names it, in file order (or what else decoding raised, where
    decoding processes met it: threads raise it)."""
    one = functools.partial(decode_or_error, image_size=image_size, channels=channels)
    if workers <= 1:
        yield from map(one, files)
        return
    with contextlib.ExitStack() as stack:
        trial = decoding.TRIAL_FILES * workers
        done: list[np.ndarray | LeafpyError] = []
        many: Callable[[Sequence[str]], Iterable[np.ndarray | LeafpyError]] = functools.partial(map, one)
        if mode != "processes":
            pool = stack.enter_context(ThreadPoolExecutor(workers, thread_name_prefix="leafpy-decode"))
            if decoding.threads_pay(one, files[:2 * trial], pool, done):  # not for small files (the GIL)
                many = functools.partial(pool.map, one)
        if mode == "processes" or (mode == "auto" and len(files) - len(done) >= decoding.PROCESS_MIN_FILES):
            started = stack.enter_context(processes(workers, image_size, channels))
            tries = files[len(done):len(done) + 2 * decoding.PROCESS_TRIAL_FILES * workers]
            if mode == "processes" or decoding.processes_pay(lambda fs: list(many(fs)), tries, started, done):
                yield from done
                yield from _ahead(started.map, [files[s:s + WINDOW] for s in range(len(done), len(files), WINDOW)])
                return
            started.close()  # slower here: ended now, not when the last file is decoded
        yield from done
        for start in range(len(done), len(files), WINDOW):
            yield from many(files[start:start + WINDOW])


def _ahead(decode: Callable[[Sequence[str]], list], windows: list[Sequence[str]]) -> Iterator:
    """decode(window) of each window in turn, the next one asked for while the one before is read (the decoding
    processes never wait for their reader)."""
    with ThreadPoolExecutor(1, thread_name_prefix="leafpy-decode-ahead") as ahead:
        pending = [ahead.submit(decode, w) for w in windows[:1]]
        for w in windows[1:]:
            got = pending.pop().result()
            pending.append(ahead.submit(decode, w))
            yield from got
        for p in pending:
            yield from p.result()


def default_cache_dir() -> str:
    return os.environ.get("LEAFPY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "leafpy", "images")


def cache_key(files: Sequence[str], image_size: Sequence[int], channels: int) -> str:
    """A digest of the folder's content as the file system describes it (names, sizes, modification times) and
    of the decoding asked for: a file added, removed, renamed or changed gives another key."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps([CACHE_VERSION, list(map(int, image_size)), channels]).encode())
    for f in files:
        try:
            st = os.stat(f)
            size, mtime = st.st_size, st.st_mtime_ns
        except OSError:  # a link to nothing, a file gone: it fails to decode, and is named then (or skipped)
            size, mtime = -1, -1
        h.update(f"{os.path.abspath(f)}\0{size}\0{mtime}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def cached_decode(files: Sequence[str], image_size: Sequence[int], channels: int, skip_unreadable: bool,
                  cache_dir: str | None, mapped: bool = False, workers: int = 0, mode: str = "auto"
                  ) -> tuple[Any, list[int]]:
    """The images through the cache in ``cache_dir`` (None: without one): ``KEY.npy`` (uint8, memory-mapped
    when ``mapped``, else read into memory) and ``KEY.json`` (the files skipped), and the indices of the files
    skipped. Without a cache: a :class:`decoding.Decoder` (``workers`` threads), which writes the cache once it
    has decoded every file; with ``skip_unreadable`` (which files are left out decides the rows) every file is
    decoded first."""
    key = cache_key(files, image_size, channels)
    if cache_dir is not None:
        decoding.remove_dead_temporaries(cache_dir)
        found = _cached(files, image_size, channels, skip_unreadable, cache_dir, key)
        if found is not None:
            return (found[0] if mapped else np.array(found[0])), found[1]
    if not skip_unreadable:
        return _decoder(files, image_size, channels, cache_dir, key, mapped, workers, mode), []
    images, skipped = decode_all(files, image_size, channels, skip_unreadable, mapped, workers, mode)
    if cache_dir is not None and _keep(cache_dir, key, images, skipped) and mapped:
        images = np.load(os.path.join(cache_dir, key + ".npy"), mmap_mode="r", allow_pickle=False)
    return images, skipped


def _cached(files: Sequence[str], image_size: Sequence[int], channels: int, skip_unreadable: bool, cache_dir: str,
            key: str) -> tuple[np.ndarray, list[int]] | None:
    """The cached images (memory-mapped) and files skipped, or None (no cache yet, or a damaged one)."""
    shape = (channels, int(image_size[0]), int(image_size[1]))
    cap = 64 + 24 * len(files)  # {"skipped": [...]}: at most every file's index
    try:
        with open(os.path.join(cache_dir, key + ".json")) as f:
            text = f.read(cap + 1)
        if len(text) > cap:
            return None
        skipped = [int(i) for i in json.loads(text)["skipped"]]
        if skipped != sorted(set(skipped)) or (skipped and not 0 <= skipped[0] <= skipped[-1] < len(files)):
            return None
        images = np.load(os.path.join(cache_dir, key + ".npy"), mmap_mode="r", allow_pickle=False)
        if images.dtype == np.uint8 and images.shape == (len(files) - len(skipped), *shape) \
                and (skip_unreadable or not skipped):
            return images, skipped
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        pass
    return None


def _keep(cache_dir: str, key: str, images: np.ndarray, skipped: list[int], decoded_in: str | None = None) -> bool:
    """Write the cache (``decoded_in``: a temporary file in ``cache_dir`` already holding ``images``, renamed);
    a cache that cannot be written is a warning (it costs a decode next time, nothing else)."""
    array_path = os.path.join(cache_dir, key + ".npy")
    try:
        os.makedirs(cache_dir, exist_ok=True)
        if decoded_in is not None:
            if isinstance(images, np.memmap):
                images.flush()
            os.replace(decoded_in, array_path)
        else:
            _replace(cache_dir, array_path, lambda f: np.save(f, images))
        _replace(cache_dir, os.path.join(cache_dir, key + ".json"),
                 lambda f: f.write(json.dumps({"skipped": skipped}).encode()))
    except OSError as e:
        warnings.warn(f"leafpy: cannot write the image cache in {cache_dir} ({e.strerror or e})", stacklevel=2)
        return False
    return True


def _decoder(files: Sequence[str], image_size: Sequence[int], channels: int, cache_dir: str | None, key: str,
             mapped: bool, workers: int, mode: str = "auto") -> decoding.Decoder:
    """A Decoder of ``files`` whose last decoded row writes the cache; ``mapped``: its rows go to a temporary
    file in ``cache_dir`` (removed if the decode never completes), which becomes the cache, else to memory."""
    shape = (len(files), channels, int(image_size[0]), int(image_size[1]))
    buffer: np.ndarray | None = None
    temporary: str | None = None
    if mapped and cache_dir is not None:
        try:
            os.makedirs(cache_dir, exist_ok=True)
            buffer, temporary = decoding.temporary_map(cache_dir, shape)
        except OSError as e:
            warnings.warn(f"leafpy: cannot write the image cache in {cache_dir} ({e.strerror or e}); decoding "
                          "into memory", stacklevel=3)
            cache_dir = None
    if buffer is None:
        check_memory(files, image_size, channels, mapped)
        buffer = np.empty(shape, np.uint8)
    decoder = decoding.Decoder(files, lambda path: decode(path, image_size, channels), buffer, workers,
                               processes=lambda: processes(workers, image_size, channels), mode=mode)
    cleanup = weakref.finalize(decoder, decoding.remove, temporary) if temporary is not None else None

    def finish(images: np.ndarray) -> None:
        if cache_dir is not None:
            _keep(cache_dir, key, images, [], temporary)
        if cleanup is not None:
            cleanup.detach()

    decoder.finish = finish
    return decoder


def _replace(directory: str, target: str, write: Any) -> None:
    """Write a cache file through a temporary one beside it, so a reader never sees half of it."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=decoding.temporary_prefix())
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_folder(root: str, image_size: Sequence[int], channels: int, skip_unreadable: bool,
                cache_dir: str | None, mapped: bool = False, workers: int = 0, mode: str = "auto"
                ) -> tuple[list[str], Any, np.ndarray, list[str]]:
    """(class names, images [N, C, H, W] as :class:`Mapped` samples (float32 in [0, 1], converted a batch at a
    time from uint8: in memory, the cache file when ``mapped``, or decoded as first read), labels, the files
    skipped) of one class folder."""
    names, files, labels = list_classes(root)
    images, skipped = cached_decode(files, image_size, channels, skip_unreadable, cache_dir, mapped, workers, mode)
    if skipped:
        labels = np.delete(labels, skipped)
    if not len(labels):
        raise LeafpyError(f"{root}: none of the {len(files)} images could be decoded")
    return names, Mapped(images), labels, [files[i] for i in skipped]


def _first_size(files: Sequence[str], skip_unreadable: bool) -> tuple[int, int]:
    """[height, width] of the first image that decodes (``skip_unreadable``), else of the first: the size the
    folder's images are brought to where none is given."""
    for f in files:
        try:
            image = decode(f, (1, 1), 1)  # (a whole decode: whatever a reader raises, as for every other file)
        except LeafpyError:
            if not skip_unreadable:
                raise
            continue
        del image
        with _pil()[0].open(f) as first:  # as decode sees it: upright, EXIF's orientation applied
            turned = first.getexif().get(EXIF_ORIENTATION) in (5, 6, 7, 8)  # a quarter turn (or a transpose)
            return (first.width, first.height) if turned else (first.height, first.width)
    raise LeafpyError(f"{os.path.dirname(os.path.dirname(files[0]))}: none of the {len(files)} images could be "
                      "decoded")


def check_size(image_size: Any, channels: Any) -> tuple[tuple[int, int], int]:
    if not isinstance(image_size, (list, tuple)) or len(image_size) != 2 or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 65536 for v in image_size):
        raise ConfigError(f"data.image_size: expected [height, width] in pixels, got {image_size!r}")
    if channels not in (1, 3) or isinstance(channels, bool):
        raise ConfigError(f"data.channels: expected 1 (grayscale) or 3 (RGB), got {channels!r}")
    return (int(image_size[0]), int(image_size[1])), int(channels)


def read(path: str | dict[str, str], *, image_size: Sequence[int] | None = None, channels: int = 3,
         skip_unreadable: bool = False, cache_dir: str | None = "default", memory_map: bool = False,
         workers: int = 0, decoding_in: str = "auto") -> Parts:
    """A folder with one subfolder of images per class, or ``{"train": DIR, "test": DIR}`` (see
    ``lp.data.image_folder``), as :class:`Parts`."""
    if cache_dir == "default":
        cache_dir = default_cache_dir()
    roots = path if isinstance(path, dict) else {"train": path}
    if isinstance(path, dict) and set(path) != {"train", "test"}:
        raise ConfigError(f"data.path: expected a folder, or {{train: DIR, test: DIR}}, got {path!r}"[:300])
    if image_size is None:
        image_size = _first_size(list_classes(roots["train"])[1], skip_unreadable)
    size, channels = check_size(list(image_size), channels)
    mode = decoding.check_mode(decoding_in)
    parts = {k: read_folder(os.fspath(v), size, channels, skip_unreadable, cache_dir, memory_map, workers, mode)
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
