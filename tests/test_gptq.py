"""GPTQ (export/gptq.py): int4 codes chosen for the layer's outputs, in the same format."""
import json

import numpy as np
import onnx
from helpers import quiet, run_cli

import edgespec.export.graph
from edgespec.export.gptq import gptq_int4
from edgespec.export.pipeline import export_model
from edgespec.export.quantize import BLOCK, dequantize_int4, quantize_int4


def correlated_inputs(k, tokens=4096, seed=0):
    """Activations as a layer sees them: correlated channels, a few much larger ones."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(tokens, k)) @ (np.eye(k) + 0.1 * rng.normal(size=(k, k)))
    x[:, :8] *= 10
    return x.astype(np.float32)


def output_error(x, w, q):
    return np.linalg.norm(x @ dequantize_int4(q).T - x @ w.T) / np.linalg.norm(x @ w.T)


def test_gptq_cuts_the_output_error_of_rounding_each_weight():
    k = 6 * BLOCK
    x = correlated_inputs(k)
    w = (0.05 * np.random.default_rng(1).normal(size=(96, k))).astype(np.float32)
    gram = x.T.astype(np.float64) @ x
    assert output_error(x, w, gptq_int4(w, gram)) < 0.7 * output_error(x, w, quantize_int4(w))


def test_gptq_keeps_the_searched_scales_and_zero_points_and_changes_only_codes():
    k = 4 * BLOCK
    x = correlated_inputs(k, tokens=1024)
    w = np.random.default_rng(2).normal(size=(40, k)).astype(np.float32)
    rounded, chosen = quantize_int4(w), gptq_int4(w, x.T.astype(np.float64) @ x)
    assert chosen.packed.shape == rounded.packed.shape
    np.testing.assert_array_equal(chosen.scales, rounded.scales)
    np.testing.assert_array_equal(chosen.zero_points, rounded.zero_points)
    assert (chosen.packed != rounded.packed).any()


def test_gptq_on_uncorrelated_inputs_is_plain_rounding():
    # with H diagonal no column's error can be made up by another
    w = np.random.default_rng(3).normal(size=(24, 3 * BLOCK)).astype(np.float32)
    gram = np.diag(np.random.default_rng(4).uniform(0.5, 2.0, 3 * BLOCK))
    np.testing.assert_array_equal(gptq_int4(w, gram).packed, quantize_int4(w).packed)


def int4_weights(artifact):
    """Initializer name -> array for an artifact's quantized weights."""
    found = {}
    for graph in ("lower", "upper"):
        model = onnx.load(artifact / f"{graph}.onnx")
        found.update({t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer
                      if t.name.startswith(("layers.", "embed_tokens."))})
    return found


def test_export_chooses_layer_and_table_weights_by_gptq(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(edgespec.export.graph, "FREQUENT_TOKENS", 100)  # ids 100.. in 4 bits
    for name, gptq in (("gptq", True), ("rounded", False)):
        export_model(str(tiny_checkpoint), tmp_path / name, exit_layer=2, gptq=gptq, log=quiet)
    gptq, rounded = int4_weights(tmp_path / "gptq"), int4_weights(tmp_path / "rounded")
    assert gptq.keys() == rounded.keys()
    chosen = [f"layers.{layer}.{linear}" for layer in range(4)
              for linear in ("qkv", "o", "gate_up", "down")] + ["embed_tokens.rare"]
    for name in chosen:  # the tied table's 4-bit rows serve the lm_head
        np.testing.assert_array_equal(gptq[name + ".scales"], rounded[name + ".scales"])
        assert (gptq[name + ".qweight"] != rounded[name + ".qweight"]).any(), name
    np.testing.assert_array_equal(gptq["embed_tokens.frequent.qweight"],
                                  rounded["embed_tokens.frequent.qweight"])  # 8 bits: rounded


def test_export_cli_skips_gptq_when_told(tiny_checkpoint, tmp_path):
    result = run_cli("export", tiny_checkpoint, "-o", tmp_path / "a", "--exit-layer", "2",
                     "--no-calibrate", "--no-gptq")
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["build"]["int4_gptq"] is False
