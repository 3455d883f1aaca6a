"""Integration on the larger real GGUF models (Qwen2.5-Coder, Gemma 3), when their files are present.

Fetch them with `benchmarks/fetch_models.sh` (into models/sources/, which git ignores);
without them every test here skips and says which file is missing. Each model is exported
once (the default: the file's own grids; a fixed exit layer, no calibration) and checked: the
file's tensors dequantize as the gguf package does, the artifact follows the full-precision
model on export's quality passage and fidelity gate, a chat reply is on topic, and greedy
speculative decoding equals plain. Gemma 3 is exported for CUDA too, its float16 graphs run
on the CPU provider against the float32 export.
"""
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import quiet

import edgespec

pytestmark = pytest.mark.models

SOURCES = Path(__file__).resolve().parent.parent / "models" / "sources"

# name: (file, fetch_models.sh argument, precision, exit layer, least top-1 agreement, a
# prompt ("raw:" text for base models: the Gemma 3 270M here is the pretrained one), a word
# its reply must hold)
MODELS = {
    "qwen2.5-coder-0.5b": ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen0.5b", "auto", 18,
                           0.95, "Write a Python function that reverses a string.", "def "),
    "gemma3-270m": ("gemma-3-270m-q4_k_m.gguf", "gemma3-270m", "auto", 13, 0.95,
                    "raw:The capital of France is Paris. The capital of Italy is", "Rome"),
    "qwen2.5-coder-1.5b": ("qwen2.5-coder-1.5b.gguf", "qwen1.5b", "auto", 21, 0.80,
                           "Write a Python function that reverses a string.", "def "),
}


def source_file(name) -> Path:
    file, fetch = MODELS[name][:2]
    path = SOURCES / file
    if not path.is_file():
        pytest.skip(f"{path} is absent: run `benchmarks/fetch_models.sh {fetch}` to fetch it")
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """exported(name, device) -> the artifact of a model present, exported once per device."""
    from edgespec.export.pipeline import export_model
    artifacts = {}

    def export(name, device="cpu"):
        if (name, device) not in artifacts:
            path = source_file(name)
            out = tmp_path_factory.mktemp("models") / f"{name}-{device}"
            precision, exit_layer = MODELS[name][2:4]
            export_model(str(path), out, precision=precision, exit_layer=exit_layer,
                         max_context=1024, device=device, log=quiet)
            artifacts[name, device] = out
        return artifacts[name, device]
    return export


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, exported):
    """(name, artifact path) of each model present, exported once."""
    return request.param, exported(request.param)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_tensor_type_in_the_file_dequantizes_as_the_gguf_package_does(name):
    import gguf
    from edgespec.export.gguf import GGUFFile
    path = source_file(name)
    header, reader = GGUFFile(path), gguf.GGUFReader(path)
    smallest = {}  # one tensor of each type, the smallest, to keep this quick
    for tensor in reader.tensors:
        kind = int(tensor.tensor_type)
        if kind not in smallest or tensor.n_bytes < smallest[kind].n_bytes:
            smallest[kind] = tensor
    for kind, tensor in smallest.items():
        want = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        got = header.array(tensor.name)
        assert np.array_equal(got.view(np.uint32), want.reshape(got.shape).view(np.uint32)), \
            f"{tensor.name} ({tensor.tensor_type.name})"


def test_artifact_follows_the_full_precision_model_on_the_quality_passage(model):
    name, artifact = model
    quality = json.loads((artifact / "manifest.json").read_text())["quality"]
    assert quality["top1_agreement"] >= MODELS[name][4], quality


def test_artifact_keeps_the_files_answers_on_the_fidelity_gate(model):
    # the default keeps the file's own grids: greedy replies stay with the model's
    name, artifact = model
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["build"]["int4_scheme"] == "source"
    fidelity = manifest["fidelity"]
    assert fidelity["first16_equal"] >= fidelity["questions"] * 2 // 3, fidelity
    assert fidelity["top1_agreement"] >= MODELS[name][4], fidelity


def test_reply_is_on_topic(model):
    name, artifact = model
    prompt, word = MODELS[name][5:]
    raw = prompt.startswith("raw:")  # plain text for a base model, else one chat turn
    reply = edgespec.load(artifact).generate(prompt.removeprefix("raw:"), max_new_tokens=48,
                                             raw=raw, temperature=0)
    assert word in reply.text, reply.text


def test_speculative_greedy_equals_plain_on_dev_prompts(model):
    from edgespec.bench import load_prompts
    _, artifact = model
    loaded = edgespec.load(artifact)
    for row, k in zip(load_prompts(per_category=1)[:6], [2, 4, 6, 3, 5, 1]):
        ids = loaded.encode(row["turns"][0])
        plain = loaded.generate_ids(ids, 96, mode="plain", temperature=0)
        spec = loaded.generate_ids(ids, 96, draft_k=k, temperature=0)
        assert spec.tokens == plain.tokens, f"prompt {row['question_id']} ({row['category']}), k {k}"


def test_gemma3_cuda_graphs_stay_finite_and_follow_the_float32_export(exported):
    # Gemma 3's residual stream passes float16's range at the first token; the CUDA export
    # keeps it in float32 around float16 layers. Both artifacts run here on the CPU provider.
    from edgespec.export.quality import QUALITY_TEXT
    logits = {}
    for device in ("cpu", "cuda"):
        loaded = edgespec.load(exported("gemma3-270m", device), device="cpu")
        ids = loaded.encode(QUALITY_TEXT.read_text(), raw=True)[:128]  # from the BOS token
        engine = loaded.engine
        seq = engine.new_sequence()
        engine.lower(seq, 0, np.array(ids))
        engine.upper(seq, 0, len(ids))
        assert np.isfinite(engine.final_states.numpy()[0, :len(ids)]).all(), device
        logits[device] = engine.head(range(len(ids))).astype(np.float64)
    want, got = logits["cpu"], logits["cuda"]
    assert np.isfinite(got).all()
    # float16's rounding alone moves a near tie now and then and the distributions barely;
    # an inf in the residual stream moves both far
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9
    log_p, log_q = (x - logsumexp(x) for x in (want, got))
    assert np.mean(np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)) <= 0.02  # KL, nats


def logsumexp(x):
    top = x.max(-1, keepdims=True)
    return top + np.log(np.exp(x - top).sum(-1, keepdims=True))
