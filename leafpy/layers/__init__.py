"""Layers: the registry, the Layer wrapper and every layer type (each in its own module)."""

from . import _load_all  # noqa: F401,E402
from .activation.clip import ClipConfig  # noqa: E402
from .activation.elu import ELUConfig  # noqa: E402
from .activation.gelu import GELUConfig  # noqa: E402
from .activation.leaky_relu import LeakyReLUConfig  # noqa: E402
from .activation.softplus import SoftplusConfig  # noqa: E402
from .common.batch_norm import BatchNormConfig  # noqa: E402
from .common.class_axis import LogSoftmaxConfig, SoftmaxConfig  # noqa: E402
from .common.concat import ConcatConfig, SliceConfig  # noqa: E402
from .common.convolution import ConvolutionConfig  # noqa: E402
from .common.deconvolution import DeconvolutionConfig  # noqa: E402
from .common.dropout import DropoutConfig  # noqa: E402
from .common.eltwise import EltwiseConfig  # noqa: E402
from .common.embedding import EmbeddingConfig  # noqa: E402
from .common.linear import LinearConfig  # noqa: E402
from .common.lrn import LRNConfig  # noqa: E402
from .common.pooling import PoolingConfig  # noqa: E402
from .common.recurrent import GRUConfig, LSTMConfig, RNNConfig  # noqa: E402
from .container.sequential import Sequential, SequentialConfig  # noqa: E402
from .container.wiring import Wiring, plan_gradients, wire  # noqa: E402
from .layer import FillerConfig, Layer, LayerConfig, WeightConfig, Worker, layer_types, lookup, register_layer  # noqa: F401
from .loss.negative_log_likelihood import NegativeLogLikelihoodConfig  # noqa: E402
from .network import Network, Parameters  # noqa: E402
from .utility.flatten import FlattenConfig  # noqa: E402
from .utility.reshape import ReshapeConfig  # noqa: E402

__all__ = ["BatchNormConfig", "ELUConfig", "GELUConfig", "LeakyReLUConfig", "SoftplusConfig",
           "ConcatConfig", "ConvolutionConfig", "DropoutConfig", "EltwiseConfig", "FillerConfig",
           "Layer", "LayerConfig", "LinearConfig", "LRNConfig", "NegativeLogLikelihoodConfig", "PoolingConfig",
           "ReshapeConfig", "Sequential", "SequentialConfig", "SliceConfig", "WeightConfig", "Worker", "layer_types",
           "lookup", "register_layer", "Network", "Parameters", "Wiring",
           "plan_gradients", "wire", "EmbeddingConfig", "GRUConfig", "LSTMConfig", "RNNConfig", "SoftmaxConfig",
           "LogSoftmaxConfig", "FlattenConfig", "DeconvolutionConfig", "ClipConfig"]
