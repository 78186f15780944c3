"""The layer configs and the layer-type registry now live in :mod:`leafpy.layer_config` (below the layers, so that
the codec and the importers need not import them); this name stays for code that imports it from here."""

from ..layer_config import *  # noqa: F403
from ..layer_config import LayerType, Shape, WeightSpec, add_layer_type, type_of_config  # noqa: F401
