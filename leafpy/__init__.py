"""leafpy: a layer-and-solver deep learning framework in the style of Leaf and Caffe.

Networks are declared as LayerConfigs nested in Sequential containers, trained by a Solver, and run unchanged on
the native (NumPy), cuda (CuPy) and webgpu (wgpu-py) backends. ``import leafpy`` imports neither CuPy nor wgpu.
"""

from . import (  # noqa: E402
                     config,
                     data,
                     train,  # noqa: E402  (after the layers and solvers it trains)
)
from .backends import available_backends, backend
from .backends.base import Backend
from .errors import BackendError, BackendUnavailable, ConfigError, LeafpyError, SerializationError, ShapeError
from .layers import (
                     BatchNormConfig,
                     ClipConfig,
                     ConcatConfig,
                     ConvolutionConfig,
                     DeconvolutionConfig,
                     DropoutConfig,
                     EltwiseConfig,
                     ELUConfig,
                     EmbeddingConfig,
                     FillerConfig,
                     FlattenConfig,
                     GELUConfig,
                     GRUConfig,
                     Layer,
                     LayerConfig,
                     LeakyReLUConfig,
                     LinearConfig,
                     LogSoftmaxConfig,
                     LRNConfig,
                     LSTMConfig,
                     NegativeLogLikelihoodConfig,
                     Network,
                     PoolingConfig,
                     ReshapeConfig,
                     RNNConfig,
                     Sequential,
                     SequentialConfig,
                     SliceConfig,
                     SoftmaxConfig,
                     SoftplusConfig,
                     WeightConfig,
                     layer_types,
                     register_layer,
)
from .metrics import ConfusionMatrix, predictions
from .solvers import LR_POLICIES, Solver, SolverConfig
from .tensor import SharedTensor
from .train import Callback, Trainer

__version__ = "0.1.0"

__all__ = [
    "Backend", "BackendError", "BackendUnavailable", "BatchNormConfig", "ConfigError", "ConvolutionConfig",
    "ConcatConfig", "DropoutConfig", "EltwiseConfig", "LRNConfig", "SliceConfig",
    "FillerConfig", "Layer", "LayerConfig", "LeafpyError", "Network", "LinearConfig", "NegativeLogLikelihoodConfig",
    "PoolingConfig", "ReshapeConfig", "SerializationError", "Sequential", "SequentialConfig", "ShapeError",
    "SharedTensor", "WeightConfig", "available_backends", "backend", "layer_types", "register_layer",
    "ConfusionMatrix", "LR_POLICIES", "Solver", "SolverConfig", "config", "data", "predictions",
    "Callback", "Trainer", "train",
    "EmbeddingConfig", "GRUConfig", "LSTMConfig", "RNNConfig", "SoftmaxConfig", "LogSoftmaxConfig", "FlattenConfig",
    "DeconvolutionConfig",
    "ELUConfig", "GELUConfig", "LeakyReLUConfig", "SoftplusConfig", "ClipConfig",
]


def __getattr__(name: str) -> object:
    """``lp.onnx`` and ``lp.web``, imported on first use (lp.onnx needs the onnx package only when a model is read
    or written)."""
    if name in ("onnx", "web"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'leafpy' has no attribute {name!r}")
