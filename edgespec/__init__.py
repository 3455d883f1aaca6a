"""edgespec: self-speculative decoding on ONNX Runtime. `edgespec.load(DIR)` opens an artifact."""
from .errors import EdgespecError
from .model import Generation, Model, load
from .sampling import SamplingParams
from .settings import DraftPolicy, SettingError, Settings

__version__ = "0.1.0"
__all__ = ["load", "Model", "Generation", "Settings", "SamplingParams", "DraftPolicy",
           "SettingError", "EdgespecError", "__version__"]
