"""Models and solver checkpoints on disk, in Cap'n Proto (``leaf.capnp``), by role:

- :mod:`.codec`: configs (LayerConfig, SolverConfig) to and from the schema's structs;
- :mod:`.fileformat`: leafpy's file (header, checksum, packed message, raw section of weights), named arrays, and
  the checks every file read passes, with errors that name the file;
- :mod:`.models`: model files and solver checkpoints, as ``Layer.save``/``Layer.load`` and
  ``Solver.save_checkpoint``/``Solver.load_checkpoint`` use them;
- :mod:`.leaf`: Leaf 0.2.1's weight names and flipped convolution filters, and what a Leaf file can represent;
- :mod:`.atomic`: atomic file writing (temporary file, fsync, rename) and stale temporaries.

It knows nothing of running layers or solvers. Every name is importable from here (``leafpy.serialization.X``).
Saving is atomic; loading never trusts the file: its size is capped (``MAX_FILE_BYTES``), the reader has a
traversal and a nesting limit, and every problem is reported as SerializationError naming the file.
"""

from __future__ import annotations

from ..errors import SerializationError
from .atomic import atomic_write, remove_temporaries
from .codec import (
    FIELD_NAMES,
    UNION_MEMBERS,
    read_layer_config,
    read_solver_config,
    schema,
    write_layer_config,
    write_solver_config,
)
from .fileformat import _HEADER as _HEADER
from .fileformat import (
    CHECKPOINT_FIX,
    FORMAT_VERSION,
    LOAD_FIX,
    MAGIC,
    MALFORMED_HINT,
    MAX_WORDS,
    NESTING_LIMIT,
    RAW_ALIGN,
    SAVE_FIX,
    THREADED_CHECKSUM,
    check_finite,
    editable_message,
    encode,
    file_kind,
    read_message,
    reading,
)
from .fileformat import _encode_parts as _encode_parts
from .fileformat import _raw_start as _raw_start
from .fileformat import _RawSection as _RawSection
from .fileformat import _read_parts as _read_parts
from .fileformat import _read_weights as _read_weights
from .fileformat import _write_weights as _write_weights
from .leaf import (
    LEAF_FIELDS,
    LEAF_TYPES,
    LEAF_WEIGHT_NAME,
    check_leaf_representable,
    from_leaf,
    is_leaf_file,
    leaf_aliases,
    leaf_name,
    to_leaf,
)
from .models import (
    COUNT_LIMIT,
    FORMATS,
    STATE_SEPARATOR,
    TRAINER_STATE_FIELDS,
    TRAINER_STATE_LIMIT,
    SavedCheckpoint,
    SavedModel,
    check_trainer_state,
    load_weights,
    model_message,
    opened_model,
    read_checkpoint,
    read_model,
    read_weights,
    save_checkpoint,
    save_model,
    saved_network_config,
)
from .models import _read_trainer_state as _read_trainer_state

MAX_FILE_BYTES = 4 * 1024**3
"""Files larger than this are refused before they are parsed (read when a file is opened: may be changed)."""

__all__ = [
    "MAX_FILE_BYTES", "SerializationError",
    "atomic_write", "remove_temporaries",
    "FIELD_NAMES", "UNION_MEMBERS", "read_layer_config", "read_solver_config", "schema", "write_layer_config",
    "write_solver_config",
    "CHECKPOINT_FIX", "FORMAT_VERSION", "LOAD_FIX", "MAGIC", "MALFORMED_HINT", "MAX_WORDS", "NESTING_LIMIT",
    "RAW_ALIGN", "SAVE_FIX", "THREADED_CHECKSUM", "check_finite", "editable_message", "encode", "file_kind",
    "read_message", "reading",
    "LEAF_FIELDS", "LEAF_TYPES", "LEAF_WEIGHT_NAME", "check_leaf_representable", "from_leaf", "is_leaf_file",
    "leaf_aliases", "leaf_name", "to_leaf",
    "COUNT_LIMIT", "FORMATS", "STATE_SEPARATOR", "TRAINER_STATE_FIELDS", "TRAINER_STATE_LIMIT", "SavedCheckpoint",
    "SavedModel", "check_trainer_state", "load_weights", "model_message", "opened_model", "read_checkpoint",
    "read_model", "read_weights", "save_checkpoint", "save_model", "saved_network_config",
]
