"""The exit adapter: collected data, parity of the trained layer with the exported graph,
and training that improves the draft (tiny random model)."""
import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from helpers import quiet
from onnx import numpy_helper

from edgespec.engine import PAD_ROWS, _session_options
from edgespec.export.adapter import (AdapterLayer, agreement, collect, distill_loss,
                                     head_weights, layer_weights, train)
from edgespec.export.graph import Blocks, Graph, Lengths
from edgespec.export.pipeline import export_model
from edgespec.export.source import Architecture, load_source

PROMPTS = ["the quick brown fox", "hello world, how are you?", "numbers 0 1 2 3"]
MANY_PROMPTS = [f"{a} {b}" for a in ("hello", "the lazy dog", "numbers 4 5", "speculative")
                for b in ("world", "fox jumps", "drafts and verifies", "7 8 9", "how are you")]


def manifest(artifact):
    return json.loads((artifact / "manifest.json").read_text())


def test_collect_records_exit_states_and_the_verifiers_top_k(tiny_int4, tmp_path):
    sequences = collect(tiny_int4, PROMPTS, max_new_tokens=8, top_k=5, cache_dir=tmp_path,
                        log=quiet)
    hidden = manifest(tiny_int4)["architecture"]["hidden_size"]
    assert len(sequences) == 3
    for s in sequences:
        length = len(s.exit_states)
        assert s.exit_states.shape == (length, hidden) and s.exit_states.dtype == np.float32
        assert len(s.tokens) == length and 1 <= s.trained <= 8
        assert s.trained == length - s.start  # every position from the last prompt one on
        assert s.top_ids.shape == s.top_probs.shape == (s.trained, 5)
        np.testing.assert_allclose(s.top_probs.sum(-1), 1, atol=1e-5)
        assert (np.diff(s.top_probs, axis=-1) <= 0).all()  # best first
        # greedy: the token fed at each generated position is the verifier's top token
        np.testing.assert_array_equal(s.tokens[s.start + 1:], s.top_ids[:-1, 0])


def test_collect_resumes_from_its_cache(tiny_int4, tmp_path):
    first = collect(tiny_int4, PROMPTS, max_new_tokens=8, top_k=5, cache_dir=tmp_path,
                    log=quiet)
    files = sorted(tmp_path.glob("*.npz"))
    assert len(files) == 3
    written = [f.stat().st_mtime_ns for f in files]
    messages = []
    again = collect(tiny_int4, PROMPTS, max_new_tokens=8, top_k=5, cache_dir=tmp_path,
                    log=messages.append)
    assert "3 cached, 0 new" in messages[0]
    assert [f.stat().st_mtime_ns for f in sorted(tmp_path.glob("*.npz"))] == written
    for a, b in zip(first, again):
        assert a.start == b.start
        for name in ("exit_states", "top_ids", "top_probs", "tokens"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    collect(tiny_int4, PROMPTS[:1], max_new_tokens=6, top_k=5, cache_dir=tmp_path,
            log=quiet)
    assert len(list(tmp_path.glob("*.npz"))) == 4  # other settings: another sequence


def random_layer(arch, layer, rng):
    """Hugging Face names for one layer, random, at a scale that separates implementations."""
    h, q, kv, m = (arch.hidden_size, arch.num_heads * arch.head_dim,
                   arch.num_kv_heads * arch.head_dim, arch.intermediate_size)
    shapes = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
              "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
              "mlp.gate_proj.weight": (m, h), "mlp.up_proj.weight": (m, h),
              "mlp.down_proj.weight": (h, m)}
    if arch.attention_bias:
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                       "self_attn.v_proj.bias": (kv,)})
    w = {k: rng.normal(0, 0.2, s) for k, s in shapes.items()}
    w.update({k: 1 + rng.normal(0, 0.1, h) for k in ("input_layernorm.weight",
                                                     "post_attention_layernorm.weight")})
    return {f"model.layers.{layer}.{k}": v.astype(np.float32) for k, v in w.items()}


def onnx_layer(arch, weights, layer, hidden, max_context=64):
    """The exported math of one layer: export.graph's Blocks, run by ONNX Runtime."""
    g = Graph("adapter")
    x = g.input("hidden", np.float32, [1, "seq", arch.hidden_size])
    out = Blocks(arch, weights, "fp32", max_context).layers(g, x, layer, layer + 1, Lengths(g))
    g.output(out, "out", np.float32, [1, "seq", arch.hidden_size])
    model = g.model([numpy_helper.from_array(a, n) for n, a in g.initializers.items()])
    # the engine's options: the process has one ONNX Runtime thread pool once an engine ran
    session = ort.InferenceSession(model.SerializeToString(), _session_options(2),
                                   providers=["CPUExecutionProvider"])
    length = hidden.shape[1]
    past = np.zeros([1, arch.num_kv_heads, max_context, arch.head_dim], np.float32)
    total = length + PAD_ROWS  # the lengths count the rows the graph appends
    feeds = {"hidden": hidden, "seqlens_k": np.array([total - 1], np.int32),
             "total_seq_len": np.array(total, np.int32),
             f"past_key.{layer}": past, f"past_value.{layer}": past}
    return session.run(["out"], feeds)[0]


@pytest.mark.parametrize("bias,rope", [(False, {}), (True, {}),
                                       (False, {"rope_type": "llama3", "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 16})])
def test_adapter_layer_computes_what_the_export_graph_computes(bias, rope):
    arch = Architecture(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=96,
                        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                        rope_theta=10000.0, rope_scaling=rope, attention_bias=bias)
    rng = np.random.default_rng(0)
    weights = random_layer(arch, 2, rng)
    hidden = rng.normal(0, 1, [1, 37, arch.hidden_size]).astype(np.float32)
    want = onnx_layer(arch, weights, 2, hidden)
    with torch.no_grad():
        got = AdapterLayer(arch, layer_weights(weights, 2))(torch.from_numpy(hidden)).numpy()
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())
    assert np.abs(got - hidden).max() > 0.1  # the layer did something


@pytest.fixture(scope="module")
def tiny_exit_1(tiny_checkpoint, tmp_path_factory):
    """Exit after layer 1 of 4: at the default exit (3), layer E's copy is the whole upper."""
    out = tmp_path_factory.mktemp("artifacts") / "tiny-fp32-e1"
    export_model(str(tiny_checkpoint), out, exit_layer=1, precision="fp32", log=quiet)
    return out


EPOCHS = 15


def test_training_improves_the_draft_over_its_start(tiny_checkpoint, tiny_exit_1, tmp_path):
    sequences = collect(tiny_exit_1, MANY_PROMPTS, max_new_tokens=12, top_k=8,
                        cache_dir=tmp_path, log=quiet)
    source = load_source(str(tiny_checkpoint))
    exit_layer = manifest(tiny_exit_1)["exit_layer"]
    init = layer_weights(source.weights, exit_layer)
    norm, table = head_weights(source.weights, source.arch)
    messages = []
    # a count of epochs, not a time budget: a busy machine must not train less
    trained, _ = train(sequences, source.arch, init, norm, table, minutes=5, epochs=EPOCHS,
                       cache_dir=tmp_path, log=messages.append)
    assert set(trained) == set(init)
    assert distill_loss(sequences, source.arch, trained, norm, table) < \
        0.9 * distill_loss(sequences, source.arch, init, norm, table)
    assert agreement(sequences, source.arch, trained, norm, table) > \
        agreement(sequences, source.arch, init, norm, table)
    assert any("held-out top-1 agreement" in m for m in messages)
    assert list(tmp_path.glob("adapter-*.pt"))  # a checkpoint to resume from
