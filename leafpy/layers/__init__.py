"""Layers: the registry, the Layer wrapper and every layer type (each in its own module)."""

from .layer import (FillerConfig, Layer, LayerConfig, Worker, WeightConfig, layer_types, lookup,  # noqa: F401
                    register_layer)
from . import _load_all  # noqa: F401,E402
from .common.convolution import ConvolutionConfig  # noqa: E402
from .common.dropout import DropoutConfig  # noqa: E402
from .common.linear import LinearConfig  # noqa: E402
from .common.pooling import PoolingConfig  # noqa: E402
from .container.sequential import Sequential, SequentialConfig  # noqa: E402
from .loss.negative_log_likelihood import NegativeLogLikelihoodConfig  # noqa: E402
from .utility.reshape import ReshapeConfig  # noqa: E402
