"""YAML run files <-> config objects.

A run file has ``name``, ``data``, ``network``, ``objective``, ``solver`` and optionally ``train`` sections (see
``configs/``). Only PyYAML's safe loader is used (``1e-3`` is a float, as in YAML 1.2; a number YAML 1.1 and 1.2
read differently, such as ``010``, is refused). Errors name the
path inside the file
(``network.layers[2].num_output``), what was expected, and the valid keys or types.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from . import _checks
from .backends import BACKEND_NAMES
from .backends.base import PRECISIONS
from .errors import ConfigError, LeafpyError, SerializationError, ShapeError
from .layers.container.sequential import SequentialConfig
from .layers.container.wiring import output_shapes
from .layers.layer import FillerConfig, LayerConfig, WeightConfig, layer_types, lookup
from .solvers.solver import SolverConfig

LAYER_KEYS = ("name", "type", "inputs", "outputs", "params", "propagate_down")
DATA_KEYS = ("dataset", "batch_size", "test_fraction", "seed", "path", "num_classes", "image_size", "channels",
             "skip_unreadable", "cache_dir", "target", "features", "delimiter", "normalize", "class_names",
             "augment", "memory_map", "workers", "decoding")
TRAIN_KEYS = ("epochs", "backend", "precision", "channels_last", "log_every", "keep_best", "monitor",
              "sync_batch_norm")
RUN_KEYS = ("name", "data", "network", "objective", "solver", "train")
CLASS_MONITORS = ("test_accuracy", "test_macro_f1", "test_weighted_f1", "test_top5_accuracy", "test_roc_auc")
"""Held-out scores of a run with classes (top-5 accuracy: with more than 5 classes; ROC AUC: with two)."""
REGRESSION_MONITORS = ("test_mse", "test_mae", "test_r2")
"""Held-out scores of a regression run, in the targets' units."""
MONITORS = ("test_loss", *CLASS_MONITORS, *REGRESSION_MONITORS)
"""The held-out scores ``train.keep_best`` may rank epochs by."""


def higher_is_better(score: str) -> bool:
    """Whether a larger value of this epoch-record score is better (accuracies, F1, R²)."""
    return score.endswith(("accuracy", "f1", "r2", "auc"))


@dataclass
class RunConfig:
    """Everything one training run needs: the solver config holds the network and objective too."""

    name: str
    network: LayerConfig
    objective: LayerConfig
    solver: SolverConfig
    data: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)
    source: str = field(default="", compare=False, repr=False)
    """The file the run was read from ("" for one made in Python)."""
    data_relative: bool = field(default=False, compare=False, repr=False)
    """Whether ``data.path`` was given relative (and is written so into a run directory's run.yaml)."""

    @property
    def batch_size(self) -> int:
        return int(self.data.get("batch_size", self.network.config.inputs[0][1][0]))

    @property
    def epochs(self) -> int:
        return int(self.train.get("epochs", 10))


def _wrap(path: str, fn: Callable[[], Any]) -> Any:
    """Run a constructor; rewrite a ConfigError's ``SomeConfig.field`` prefix into the path in the file."""
    try:
        return fn()
    except ConfigError as e:
        msg = str(e)
        m = re.match(r"^(\w+Config|solver|params|filler)\.", msg)
        if m:
            msg = f"{path}." + msg[m.end():]
        elif not msg.startswith(path):
            msg = f"{path}: {msg}"
        raise ConfigError(msg) from None
    except TypeError as e:
        raise ConfigError(f"{path}: {e}") from None


def _given(d: dict, key: str, default: Any) -> Any:
    """``d[key]``, or ``default`` where the key is missing or null (a ``false`` or ``0`` in its place is kept, for
    the type check to refuse, not taken for the default)."""
    value = d.get(key)
    return default if value is None else value


def _mapping(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        if value is None:
            raise ConfigError(f"{path}: expected a mapping, got nothing (an empty document or section)")
        raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}"[:300])
    return value


def _check_keys(d: dict, valid: tuple[str, ...] | list[str], path: str, what: str) -> None:
    for key in d:
        if key not in valid:
            raise ConfigError(f"{path}: unknown key {key!r} for {what}; valid keys: {', '.join(valid)}")


# --- layers -----------------------------------------------------------------------------------------------------
def _params_list(d: dict, path: str) -> list:
    """A layer's ``params``: a list with one mapping per weight, in the order of the layer's weights."""
    params = _given(d, "params", [])
    if not isinstance(params, (list, tuple)):
        raise ConfigError(f"{path}.params: expected a list with one entry per weight (e.g. params: [{{name: w}}, "
                          f"{{name: b}}]), got {type(params).__name__} {params!r}"[:300])
    return list(params)


def _weight_from_dict(d: Any, path: str) -> WeightConfig:
    d = dict(_mapping(d, path))
    _check_keys(d, ("name", "lr_mult", "decay_mult", "filler"), path, "a weight")
    if isinstance(d.get("filler"), str):  # `filler: he`, short for `filler: {type: he}`
        d["filler"] = {"type": d["filler"]}
    if "filler" in d:
        f = _mapping(d["filler"], f"{path}.filler")
        _check_keys(f, ("type", "value", "std"), f"{path}.filler", "a filler")
        d["filler"] = _wrap(f"{path}.filler", lambda: FillerConfig(**f))
    return _wrap(path, lambda: WeightConfig(**d))


def layer_from_dict(d: Any, path: str = "network", batch: int | None = None) -> LayerConfig:
    """A LayerConfig from its YAML mapping; a declared input shape whose first (batch) entry is null takes
    ``batch`` (a run's data.batch_size; None: a batch of one)."""
    d = _mapping(d, path)
    if "type" not in d:
        raise ConfigError(f"{path}: missing 'type'; known types: {', '.join(layer_types())}")
    type_name = d["type"]
    if not isinstance(type_name, str):
        raise ConfigError(f"{path}.type: expected a layer type name, got {type_name!r}")
    entry = _wrap(f"{path}.type", lambda: lookup(type_name, f"{path}.type"))
    name = d.get("name", path if "." not in path and "[" not in path else None)
    if name is None:
        raise ConfigError(f"{path}: missing 'name'")
    if type_name == "Sequential":
        if path.count(".layers[") >= MAX_DEPTH // 2:
            raise ConfigError(f"{path}: Sequentials nested more than {MAX_DEPTH // 2} deep")
        if "params" in d:  # a container has no weights of its own: the key would set nothing
            raise ConfigError(f"{path} ('{name}', a Sequential): 'params' sets nothing on a Sequential, which has no "
                              "weights of its own; give params to the layers inside it (in its layers)")
        _check_keys(d, ("name", "type", "inputs", "layers", "force_backward", "outputs", "propagate_down"), path,
                    "a Sequential")
        inputs = _given(d, "inputs", [])
        if not isinstance(inputs, list):
            raise ConfigError(f"{path}.inputs: expected a list of {{name, shape}}, got {inputs!r}")
        seq = _wrap(path, lambda: SequentialConfig(force_backward=d.get("force_backward", False)))
        sources = []  # the enclosing container's blobs that feed the declared inputs (its `from`s)
        for i, item in enumerate(inputs):
            item = _mapping(item, f"{path}.inputs[{i}]")
            _check_keys(item, ("name", "shape", "from"), f"{path}.inputs[{i}]", "an input")
            shape = item.get("shape")
            if batch is not None and isinstance(shape, list) and shape and shape[0] is None:
                shape = [batch, *shape[1:]]
            _wrap(path, lambda: seq.add_input(item.get("name"), shape))
            if "from" in item:
                if ".layers[" not in path:  # the outermost network: no enclosing container has a blob to name
                    raise ConfigError(f"{path}.inputs[{i}].from: 'from' is for a nested Sequential's inputs (it names "
                                      "the blob of the enclosing network that feeds one); the outermost network's "
                                      "inputs are fed by the run: remove the 'from'")
                sources.append(item["from"])
        if sources and len(sources) != len(inputs):
            raise ConfigError(f"{path}.inputs: give every input a 'from' (the blob of the enclosing container that "
                              f"feeds it) or none (wired automatically); {len(sources)} of {len(inputs)} have one")
        layers = _given(d, "layers", [])
        if not isinstance(layers, list):
            raise ConfigError(f"{path}.layers: expected a list of layers, got {layers!r}")
        for i, item in enumerate(layers):
            lc = layer_from_dict(item, f"{path}.layers[{i}]", batch)
            try:
                seq.add_layer(lc)
            except ConfigError as e:  # (SequentialConfig's own field name: the entry in the file says more)
                raise ConfigError(f"{path}.layers[{i}]: {str(e).removeprefix('SequentialConfig.layers: ')}") \
                    from None
        return _wrap(path, lambda: LayerConfig(name, seq, inputs=sources, outputs=_given(d, "outputs", []),
                                               propagate_down=_given(d, "propagate_down", [])))
    cls = entry.config_class
    own = [f.name for f in dataclasses.fields(cls)] if cls is not None else []
    _check_keys(d, list(LAYER_KEYS) + own, path, f"a {type_name} layer")
    kwargs = {k: v for k, v in d.items() if k in own}
    config: Any = type_name if cls is None else _wrap(path, lambda: cls(**kwargs))
    params = [_weight_from_dict(p, f"{path}.params[{i}]") for i, p in enumerate(_params_list(d, path))]
    return _wrap(path, lambda: LayerConfig(
        name, config, inputs=_given(d, "inputs", []), outputs=_given(d, "outputs", []), params=params,
        propagate_down=_given(d, "propagate_down", [])))


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _non_default(obj: Any) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
        if default is dataclasses.MISSING or value != default:
            out[f.name] = _plain(value)
    return out


def layer_to_dict(config: LayerConfig) -> dict:
    """The YAML mapping of a LayerConfig."""
    d: dict[str, Any] = {"name": config.name, "type": config.type}
    if config.type == "Sequential":
        # the declared inputs take the key `inputs`: the blobs that feed them, where named, go in their `from`
        seq: SequentialConfig = config.config
        if config.inputs and len(config.inputs) != len(seq.inputs):
            raise ConfigError(f"layer '{config.name}' (Sequential).inputs: expected {len(seq.inputs)} blob names "
                              f"(one per declared input), got {list(config.inputs)}")
        d["inputs"] = [{"name": n, "shape": list(s), **({"from": config.inputs[i]} if config.inputs else {})}
                       for i, (n, s) in enumerate(seq.inputs)]
        if seq.force_backward:
            d["force_backward"] = True
        d["layers"] = [layer_to_dict(lc) for lc in seq.layers]
    elif config.config is not None:
        d.update(_non_default(config.config))
    if config.inputs and config.type != "Sequential":
        d["inputs"] = list(config.inputs)
    if config.outputs:
        d["outputs"] = list(config.outputs)
    if config.params:
        params = []
        for p in config.params:
            pd = {k: v for k, v in _non_default(p).items() if k != "filler"}
            if p.filler is not None:
                pd["filler"] = _non_default(p.filler) or {"type": p.filler.type}
            params.append(pd)
        d["params"] = params
    if config.propagate_down:
        d["propagate_down"] = list(config.propagate_down)
    return d


# --- run files ----------------------------------------------------------------------------------------------------
SOLVER_KEYS = tuple(f.name for f in dataclasses.fields(SolverConfig) if f.name not in ("network", "objective"))


def from_dict(doc: Any, source: str = "<run>") -> RunConfig:
    doc = _mapping(doc, source)
    _check_keys(doc, RUN_KEYS, source, "a run file")
    for key in ("network", "objective"):
        if key not in doc:
            raise ConfigError(f"{source}: missing the '{key}' section")
    data = dict(_mapping(_given(doc, "data", {}), "data"))
    _check_keys(data, DATA_KEYS, "data", "the data section")
    train = dict(_mapping(_given(doc, "train", {}), "train"))
    _check_keys(train, TRAIN_KEYS, "train", "the train section")
    for key in [k for k, v in train.items() if v is None and k != "epochs"]:
        del train[key]  # (null: the default, as for a key left out)
    if "backend" in train and train["backend"] not in BACKEND_NAMES:
        raise ConfigError(f"train.backend: expected one of {', '.join(BACKEND_NAMES)}, got {train['backend']!r}")
    for section, where, key in ((data, "data", "batch_size"), (train, "train", "epochs"),
                                (data, "data", "num_classes")):
        value = section.get(key)
        if value is None and key in section:
            raise ConfigError(f"{where}.{key}: expected a positive integer, got null; give a number, or leave the key "
                              "out for its default")
        if value is not None:  # (a whole float such as 2.0 is that integer, as in the solver section)
            section[key] = _checks.positive_int(f"{where}.{key}", value)
    network = layer_from_dict(doc["network"], "network", data.get("batch_size"))
    if network.type != "Sequential":
        raise ConfigError(f"network.type: expected Sequential, got {network.type!r}")
    objective = layer_from_dict(_objective_section(doc["objective"], network), "objective", data.get("batch_size"))
    if objective.type != "Sequential":
        raise ConfigError(f"objective.type: expected Sequential, got {objective.type!r}")
    solver_doc = dict(_mapping(_given(doc, "solver", {}), "solver"))
    _check_keys(solver_doc, SOLVER_KEYS, "solver", "the solver")
    name = check_run_name(doc.get("name", ""))
    solver_doc.setdefault("name", name)
    solver = _wrap("solver", lambda: SolverConfig(network=network, objective=objective, **solver_doc))
    if train.get("log_every") is not None:
        check_log_every(train["log_every"], "train.log_every")
    check_best_epochs(train.get("keep_best", 0), train.get("monitor", "test_loss"))
    precision = train.get("precision", "fp32")
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    for key in ("sync_batch_norm", "channels_last"):
        if not isinstance(train.get(key, False), bool):
            raise ConfigError(f"train.{key}: expected true or false, got {train[key]!r}")
    _check_data(data)
    return RunConfig(name=name, network=network, objective=objective, solver=solver, data=data, train=train)


OBJECTIVES = {"nll": ("NegativeLogLikelihood", "label"), "mse": ("MeanSquaredError", "target"),
              "softmax_cross_entropy": ("SoftmaxCrossEntropy", "label")}
"""The short objectives (``objective: nll``): the loss layer and the name of its target input."""


def _objective_section(value: Any, network: LayerConfig) -> Any:
    """The objective section in full. A short name (``nll``, ``mse``) or a loss layer alone (``{type:
    NegativeLogLikelihood}``) becomes the Sequential over ``network_out`` and the target (``label`` [N, 1] for
    NLL, ``target`` of the output's shape for MSE), whose shapes, and NLL's ``num_classes``, are the network's
    output's; a Sequential (the explicit form) is returned as it is."""
    short = ", ".join(f"{k} ({t})" for k, (t, _) in OBJECTIVES.items())
    if isinstance(value, str):
        key = {t.lower(): k for k, (t, _) in OBJECTIVES.items()}.get(value.lower(), value.lower())
        if key not in OBJECTIVES:
            raise ConfigError(f"objective: unknown objective {value!r}; short names: {short}; or write the loss "
                              "layer ({type: NegativeLogLikelihood}) or the Sequential over network_out and the target")
        layer: dict = {"name": key, "type": OBJECTIVES[key][0]}
    elif isinstance(value, dict) and value.get("type", "Sequential") != "Sequential":
        key = next((k for k, (t, _) in OBJECTIVES.items() if t == value["type"]), "")
        if not key:
            raise ConfigError(f"objective.type: expected Sequential, or a loss layer alone: "
                              f"{', '.join(t for t, _ in OBJECTIVES.values())}; got {value['type']!r}")
        layer = {"name": key, **value}
    else:
        return value
    out = _network_output(network, f"objective {value!r}" if isinstance(value, str) else "objective")
    target: list = list(out)
    if key != "mse":
        if len(out) != 2:
            what = "log-probabilities" if key == "nll" else "scores"
            raise ConfigError(f"objective: {OBJECTIVES[key][0]} scores {what} of shape [N, classes], but "
                              f"the network's output has shape {list(out)}; end the network with a Linear over the "
                              "classes (after a Flatten) and a LogSoftmax, or score it with mse")
        if layer.setdefault("num_classes", out[1]) != out[1]:
            raise ConfigError(f"objective.num_classes: {layer['num_classes']!r}, but the network's output has "
                              f"{out[1]} classes (shape {list(out)}); leave num_classes out to take the network's")
        target = [out[0], 1]
    return {"type": "Sequential", "inputs": [{"name": "network_out", "shape": list(out)},
                                             {"name": OBJECTIVES[key][1], "shape": target}], "layers": [layer]}


def _network_output(network: LayerConfig, what: str) -> tuple[int, ...]:
    """The shape of the network's one output, for its declared inputs (ConfigError naming ``what`` needs it)."""
    try:
        shapes = output_shapes(network.config)
    except ShapeError as e:
        raise ConfigError(f"network: {e}") from None
    if len(shapes) != 1:
        raise ConfigError(f"{what}: scores one network output, and the network's last layer has {len(shapes)}; "
                          "write the objective as a Sequential that declares its inputs")
    return shapes[0]


DATASETS = ("digits", "mnist", "fashion_mnist", "npz", "npy", "image_folder", "csv")
DIGITS_IGNORES = ("path", "num_classes")
"""data keys the bundled digits dataset has no use for (a run file giving them means another dataset)."""
DATASET_KEYS = {"digits": (), "mnist": ("path",), "fashion_mnist": ("path",),
                "npz": ("path", "num_classes", "memory_map"), "npy": ("path", "num_classes"),
                "image_folder": ("path", "image_size", "channels", "skip_unreadable", "cache_dir", "memory_map",
                                 "decoding"),
                "csv": ("path", "target", "features", "delimiter")}
"""The data keys each dataset reads besides :data:`COMMON_DATA_KEYS` (a key another dataset reads would be
ignored: refused, so that a value meant for one never passes unread)."""
COMMON_DATA_KEYS = ("dataset", "batch_size", "test_fraction", "seed", "augment", "normalize", "class_names",
                    "workers")


def check_run_name(name: Any) -> str:
    """A run's name names its directory under runs/ (when no --out is given): a name, never a path."""
    if name is None:
        return ""
    if not isinstance(name, (str, int, float)) or isinstance(name, bool):
        raise ConfigError(f"name: expected the run's name (text), got {type(name).__name__} {name!r}"[:300])
    name = str(name)
    if name in (".", "..") or any(c in name for c in "/\\\0") or os.path.isabs(name):
        raise ConfigError(f"name: {name!r} is a path, and a run's name names its directory under runs/; give a "
                          "name without '/' or '\\' (e.g. mnist-lenet), and choose the directory with --out")
    return name


def check_log_every(log_every: Any, name: str) -> int:
    """A progress line every ``log_every`` iterations: a non-negative integer (0: none); ``name`` says where it
    comes from."""
    if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 0:
        raise ConfigError(f"{name}: expected a non-negative integer (0 turns it off), got {log_every!r}")
    return log_every


def check_best_epochs(keep_best: Any, monitor: Any, keep_best_name: str = "train.keep_best",
                      monitor_name: str = "train.monitor") -> None:
    """Refuse a ``keep_best`` (how many best epochs to keep, 0: none) or a ``monitor`` (what ranks them) that a
    run's training cannot use; the names say where the values come from (the run file's keys by default)."""
    if isinstance(keep_best, bool) or not isinstance(keep_best, int) or keep_best < 0:
        raise ConfigError(f"{keep_best_name}: expected a non-negative integer (0 turns it off), got {keep_best!r}")
    if monitor not in MONITORS:
        raise ConfigError(f"{monitor_name}: expected one of {', '.join(MONITORS)}, got {monitor!r}")


def _check_data(data: dict) -> None:
    """The data section's values (what the dataset files hold is checked when they are read)."""
    dataset = _checks.choice("data.dataset", data.get("dataset", "digits"), DATASETS)
    for key in DIGITS_IGNORES:
        if dataset == "digits" and key in data:
            raise ConfigError(f"data.{key}: the digits dataset is bundled with scikit-learn and has 10 classes, so "
                              f"{key} does not apply to it (got {data[key]!r}); remove it, or set data.dataset to "
                              "npz (or mnist) for your own files")
    own = DATASET_KEYS[dataset]
    for key in data:
        if key not in COMMON_DATA_KEYS and key not in own:
            takes = [k for k, keys in DATASET_KEYS.items() if key in keys]
            got = repr(data[key])
            got = got if len(got) <= 60 else got[:57] + "..."
            raise ConfigError(f"data.{key}: the {dataset} dataset does not read it (got {got}; "
                              f"{' and '.join(takes)} {'do' if len(takes) > 1 else 'does'}); remove it, or set "
                              f"data.dataset to the dataset you mean; {dataset} reads "
                              f"{', '.join(COMMON_DATA_KEYS[1:] + own)}")
    if data.get("test_fraction") is not None:
        _checks.number("data.test_fraction", data["test_fraction"], minimum=0.0, maximum=1.0, min_open=True,
                       max_open=True)
    if "seed" in data:
        _checks.non_negative_int("data.seed", data["seed"])
    path = data.get("path")
    if isinstance(path, dict) and data.get("dataset") == "image_folder":
        if set(path) != {"train", "test"} or not all(isinstance(p, str) and p for p in path.values()):
            raise ConfigError(f"data.path: expected a folder, or {{train: DIR, test: DIR}}, got {path!r}"[:300])
    elif data.get("dataset") == "npy":
        if not isinstance(path, dict) or set(path) not in ({"x", "y"}, {"x_train", "y_train", "x_test", "y_test"}) \
                or not all(isinstance(p, str) and p for p in path.values()):
            raise ConfigError(f"data.path: the npy dataset needs {{x: X.npy, y: Y.npy}} or {{x_train: ..., y_train: "
                              f"..., x_test: ..., y_test: ...}}, got {path!r}"[:300])
    elif "path" in data and (not isinstance(path, str) or not path):
        raise ConfigError(f"data.path: expected a file or directory path, got {path!r}")
    if "workers" in data:
        _checks.non_negative_int("data.workers", data["workers"])
    if "decoding" in data:
        from .sources import decoding

        decoding.check_mode(data["decoding"])
    if "augment" in data:
        from .sources import augment

        augment.from_dict(data["augment"])
    if "normalize" in data or "class_names" in data:
        from .sources import prepare

        prepare.from_dict({"normalize": data.get("normalize"), "class_names": data.get("class_names")}, "data")


def to_dict(run: RunConfig) -> dict:
    if not isinstance(run, RunConfig):
        raise ConfigError(f"config: expected a RunConfig (from config.load or config.loads), got {type(run).__name__}")
    solver = _non_default(dataclasses.replace(run.solver, network=None, objective=None))
    solver.pop("network", None)
    solver.pop("objective", None)
    if solver.get("name") == run.name:
        solver.pop("name")
    doc: dict[str, Any] = {"name": run.name}
    if run.data:
        doc["data"] = dict(run.data)
    if run.train:
        doc["train"] = dict(run.train)
    doc["network"] = layer_to_dict(run.network)
    doc["objective"] = layer_to_dict(run.objective)
    doc["solver"] = solver
    return doc


class _DuplicateKey(yaml.YAMLError):
    pass


class _SafeLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, reading exponent floats without a dot (``1e-3``, ``5e-4``) as numbers, as YAML
    1.2 does (YAML 1.1, which PyYAML follows, reads them as strings), and refusing a key given twice in one mapping
    (PyYAML keeps the last silently, so a second ``base_lr:`` would quietly win)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *anchor' entries may be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if first is not key_node:
                    raise _DuplicateKey(f"line {key_node.start_mark.line + 1}: key {key!r} is given twice (first "
                                        f"at line {first.start_mark.line + 1}); keep one")
        return super().construct_mapping(node, deep=deep)


MAX_DEPTH = 128
"""Deepest nesting of mappings and lists a run file may have (each nested Sequential takes two levels)."""
MAX_ALIASES = 100
"""Most aliases (``*name``) a run file may use."""
MAX_EXPANSION = 200_000
"""Most values a run file's aliases may add once expanded (a "billion laughs" would add 10**9)."""
MAX_NODES = 1_000_000
"""Most values (mappings, lists and scalars) a run file may write out: each costs PyYAML about 20 us and 1 KB
before anything is checked, so a file of plain values is refused within about 20 s and 1 GB (a 1000-layer
network with 1000 class names is about 20,000 values; the run.yaml of a table of 100,000 columns lists them all)."""


class _TooBig(yaml.YAMLError):
    pass


class _BoundedLoader(_SafeLoader):
    """The safe loader, refusing documents of more than MAX_NODES values, nested deeper than MAX_DEPTH, with more
    than MAX_ALIASES aliases, or whose aliases add more than MAX_EXPANSION values once expanded, before anything is
    built from them."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0
        self._nodes = 0

    def compose_node(self, parent, index):
        self._nodes += 1
        if self._nodes > MAX_NODES:
            mark = self.peek_event().start_mark
            raise _TooBig(f"line {mark.line + 1}: more than {MAX_NODES} values; a run file names a network, its data "
                          "and a solver (large arrays belong in data files)")
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                mark = self.peek_event().start_mark
                raise _TooBig(f"line {mark.line + 1}: more than {MAX_ALIASES} aliases (*name); write the values out")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise _TooBig(f"line {mark.line + 1}: nested more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node):
        sizes: dict[int, int] = {}

        def size(n: Any) -> int:  # values once aliases are expanded; each distinct node is visited once
            key = id(n)
            if key not in sizes:
                sizes[key] = 0  # a recursive alias counts as one value here; the constructor reports it
                if isinstance(n, yaml.MappingNode):
                    total = 1 + sum(size(k) + size(v) for k, v in n.value)
                elif isinstance(n, yaml.SequenceNode):
                    total = 1 + sum(size(v) for v in n.value)
                else:
                    total = 1
                sizes[key] = total
            return sizes[key]

        total = size(node)
        if total - len(sizes) > MAX_EXPANSION:
            raise _TooBig(f"its aliases expand it from {len(sizes)} to {total} values (they may add at most "
                          f"{MAX_EXPANSION}); write the values out")
        return super().construct_document(node)


class _SafeDumper(yaml.SafeDumper):
    """``yaml.safe_dump``'s dumper, knowing the loader's exponent floats: a text such as ``1e3`` (a class named so)
    is written quoted, so that it reads back as text."""


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
for _kind in (_SafeLoader, _SafeDumper):
    _kind.add_implicit_resolver(
        _FLOAT,
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )


class _Ambiguous(yaml.YAMLError):
    pass


def _unambiguous(loader: yaml.SafeLoader, node: yaml.ScalarNode, kind: str) -> str:
    """A number's text, refused where YAML 1.1 (PyYAML's, which leafpy reads with: files leafpy wrote rely on it)
    and YAML 1.2 read it differently: ``010`` (eight in 1.1, ten in 1.2), ``1_000``, ``1:30`` (ninety in 1.1) and
    ``0b101`` (text in 1.2)."""
    text = str(loader.construct_scalar(node))
    digits = text.lstrip("+-")
    octal = kind == "integer" and re.fullmatch(r"0[0-7]+", digits) and int(digits, 8) != int(digits, 10)
    if octal or "_" in digits or ":" in digits or digits.startswith("0b"):
        raise _Ambiguous(f"line {node.start_mark.line + 1}: {text} is read as another {kind} by YAML 1.1 than by "
                         "YAML 1.2 (or as text); write it as a plain decimal number, or quote it for text")
    return text


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    _unambiguous(loader, node, "integer")
    return yaml.SafeLoader.construct_yaml_int(loader, node)


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    _unambiguous(loader, node, "number")
    return yaml.SafeLoader.construct_yaml_float(loader, node)


_SafeLoader.add_constructor(_INT, _construct_int)
_SafeLoader.add_constructor(_FLOAT, _construct_float)


def _yaml(text: str) -> Any:
    """The YAML document in ``text``, bounded (see _BoundedLoader); a value its tag cannot hold (``!!float abc``)
    is a YAMLError too."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as e:
        raise yaml.YAMLError(f"a value cannot be read: {e!r}") from None
    finally:
        loader.dispose()


def loads(text: str, source: str = "<string>", overrides: Sequence[str] = ()) -> RunConfig:
    """A RunConfig from YAML text, with ``overrides`` (``"solver.base_lr=0.01"``, see :func:`override`) applied."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{source}: not UTF-8 text (byte {e.start}); save the run file as UTF-8") from None
    if not isinstance(text, str):
        raise ConfigError(f"config.loads: expected the YAML text of a run file (str), got {type(text).__name__}")
    if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f"config.loads: overrides must be a list of 'KEY=VALUE' strings, got {overrides!r}")
    try:
        doc = _yaml(text)
    except (_DuplicateKey, _TooBig, _Ambiguous) as e:
        raise ConfigError(f"{source}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    for item in overrides:
        doc = override(doc, item)
    return from_dict(doc, source)


def override(doc: Any, item: str) -> Any:
    """``doc`` (a run file's YAML data) with one value replaced: ``item`` is ``KEY=VALUE`` where KEY is a dotted
    path (``solver.base_lr``, ``data.batch_size``; a list element by index or, for layers, by name:
    ``network.layers.conv1.num_output``) and VALUE is read as YAML (``0.01``, ``adam``, ``[5, 5]``)."""
    where = f"--set {item}"
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"{where}: expected KEY=VALUE with a dotted KEY, e.g. solver.base_lr=0.01")
    try:
        value = _yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: the value is not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: the run file is not a mapping")
    node: Any = doc
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        here = ".".join(parts[:depth + 1])
        if isinstance(node, dict):
            if last:
                node[part] = value
            else:
                if node.get(part) is None:  # a section the file leaves out
                    node[part] = {}
                node = node[part]
        elif isinstance(node, list):
            if part.isascii() and part.isdigit():
                index = int(part)
                if index >= len(node):
                    raise ConfigError(f"{where}: {here}: the list has {len(node)} entries")
            else:
                names = [e.get("name") if isinstance(e, dict) else None for e in node]
                if part not in names:
                    raise ConfigError(f"{where}: {here}: no entry named {part!r} (entries: "
                                      f"{', '.join(str(n) for n in names if n is not None) or 'none'})")
                index = names.index(part)
            if last:
                node[index] = value
            else:
                node = node[index]
        else:
            raise ConfigError(f"{where}: {'.'.join(parts[:depth])} is {node!r}, not a section to set {part!r} in")
    return doc


MAX_FILE_BYTES = 16 * 2**20
"""Largest run file read (the shipped ones are 1-2 KB; a run.yaml lists a table's columns and a dataset's classes)."""
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
"""The run files installed with leafpy (``digits_lenet``, ``mnist_lenet``...)."""


def shipped() -> list[str]:
    """Names of the run files installed with leafpy, usable as ``leafpy train NAME`` or ``config.load(NAME)``."""
    try:
        return sorted(f[:-5] for f in os.listdir(SHIPPED_DIR) if f.endswith(".yaml"))
    except OSError:
        return []


RUN_FILE = "run.yaml"
"""The resolved run a training run leaves in its output directory."""


def resolve(path: str | os.PathLike) -> str:
    """The run file ``path`` names: a run directory's ``run.yaml``; ``path`` itself when it exists or names a
    directory; otherwise, for a bare name such as ``digits_lenet`` (or ``digits_lenet.yaml``), the run file of that
    name shipped with leafpy (a directory of that name that holds no run file does not hide it)."""
    path = os.fspath(path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, RUN_FILE)):
        return os.path.join(path, RUN_FILE)
    bare = not (os.sep in path or (os.altsep and os.altsep in path))
    stem = path[:-5] if path.endswith(".yaml") else path
    if bare and stem in shipped() and (not os.path.exists(path) or os.path.isdir(path)):
        return os.path.join(SHIPPED_DIR, stem + ".yaml")
    return path


def load(path: str | os.PathLike, overrides: Sequence[str] = ()) -> RunConfig:
    """A RunConfig from a YAML run file, with ``overrides`` (``"solver.base_lr=0.01"``) applied. A bare name
    that is not a file here (``digits_lenet``) reads the run file of that name shipped with leafpy, and a run
    directory that leafpy train wrote its ``run.yaml``."""
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"config.load: expected a path to a YAML run file, got {type(path).__name__} {path!r}")
    path = resolve(path)
    try:
        with _checks.open_regular(path, "a YAML run file") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
        if len(raw) > MAX_FILE_BYTES:
            raise ConfigError(f"{path}: larger than {MAX_FILE_BYTES // 2**20} MB; a run file is a few KB of YAML")
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); save the run file as UTF-8") from None
    except OSError as e:
        hint = ""
        stem = os.path.basename(path)[:-5] if path.endswith(".yaml") else None
        if isinstance(e, FileNotFoundError) and os.sep not in path:
            hint = f" (run files shipped with leafpy: {', '.join(shipped()) or 'none'})"
        elif isinstance(e, FileNotFoundError) and stem in shipped():  # the README's configs/NAME.yaml elsewhere
            hint = f"; leafpy ships a run file of that name, read from any directory by its name alone: {stem}"
        raise LeafpyError(f"{path}: cannot read the run file: {e.strerror or e}{hint}") from e
    try:
        run = loads(text, path, overrides)
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(path) else f"{path}: {msg}") from None
    run.source = path
    return run


def data_base(run: RunConfig) -> str:
    """The directory a relative ``data.path`` is relative to: a run directory's run.yaml (which leafpy train wrote)
    records it relative to that directory, so the directory moves with its data; any other run file's is relative
    to the working directory."""
    if run.source and os.path.basename(run.source) == RUN_FILE:
        return os.path.dirname(run.source)
    return ""


def dumps(run: RunConfig) -> str:
    return yaml.dump(to_dict(run), Dumper=_SafeDumper, sort_keys=False, default_flow_style=None, width=120,
                     allow_unicode=True)


def save(run: RunConfig, path: str | os.PathLike) -> None:
    from .serialization.atomic import atomic_write

    _checks.path("config.save: path", path)
    try:
        atomic_write(path, dumps(run).encode("utf-8"))
    except SerializationError:
        raise
