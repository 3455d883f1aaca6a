"""Read a Hugging Face checkpoint's safetensors files lazily.

`SafetensorsWeights` maps parameter names to float32 arrays, reading a tensor from its file
when it is looked up (safetensors' own lazy reading) and keeping nothing: export holds one
tensor group at a time, whatever the checkpoint's size and dtype, as it does for a GGUF.
"""
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError

# what every supported architecture's checkpoint names: a file without them is not one
REQUIRED = ("model.embed_tokens.weight", "model.norm.weight",
            "model.layers.0.self_attn.q_proj.weight")


class SafetensorsWeights(Mapping):
    """Hugging Face name -> float32 array, read from the checkpoint's files at each lookup."""

    def __init__(self, files):
        from safetensors import safe_open
        self._file = {}  # parameter name -> the file that holds it
        for path in sorted(Path(f) for f in files):
            try:
                with safe_open(path, "pt") as f:
                    self._file.update(dict.fromkeys(f.keys(), path))
            except Exception as e:  # safetensors raises its own error types
                raise EdgespecError(f"{path} is not a readable safetensors file ({e}); check "
                                    "that it was downloaded whole") from e
        missing = [name for name in REQUIRED if name not in self._file]
        if missing:
            raise EdgespecError(f"the checkpoint's safetensors files hold no {missing[0]} (they "
                                f"name e.g. {next(iter(self._file), 'nothing')}); a text model "
                                "of a supported architecture names its weights model.*")

    def _slice(self, name):
        from safetensors import safe_open
        with safe_open(self._file[name], "pt") as f:
            return f.get_slice(name)

    def __getitem__(self, name):
        from safetensors import safe_open
        with safe_open(self._file[name], "pt") as f:
            return f.get_tensor(name).float().numpy()

    def rows(self, name, rows: range) -> np.ndarray:
        """Rows of a vocabulary table as float32, the rest unread."""
        return self._slice(name)[rows.start:rows.stop].float().numpy()

    def shape(self, name) -> tuple:
        """A tensor's shape, without reading it."""
        return tuple(self._slice(name).get_shape())

    def __iter__(self):
        return iter(self._file)

    def __len__(self):
        return len(self._file)
