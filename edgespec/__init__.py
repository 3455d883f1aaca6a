"""edgespec: self-speculative decoding on ONNX Runtime. `edgespec.load(DIR)` opens an artifact."""
from .errors import EdgespecError
from .model import Generation, Model, load
from .sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["load", "Model", "Generation", "SamplingParams", "EdgespecError", "__version__"]
