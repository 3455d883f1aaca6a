"""`edgespec export`: the artifact's files, its manifest, weight sharing, int4 numerics."""
import json

import numpy as np
import onnx
import pytest
import torch
from helpers import make_checkpoint, one_error_line, quiet, run_cli
from transformers import AutoModelForCausalLM

import edgespec
import edgespec.export.graph
import edgespec.export.quantize
from edgespec.artifact import FORMAT_VERSION
from edgespec.engine import COST_ROWS
from edgespec.errors import EdgespecError
from edgespec.export import fidelity
from edgespec.export.calibrate import LOOKUP_K
from edgespec.export.pipeline import export_model
from edgespec.export.quantize import (BLOCK, dequantize_int4, dequantize_int8,
                                      quantize_int4, quantize_int8)


def external_tensors(artifact):
    """graph -> {initializer name: (location, offset, length)} for weights stored in files."""
    found = {}
    for graph in ("lower", "upper", "head"):
        model = onnx.load(artifact / f"{graph}.onnx", load_external_data=False)
        found[graph] = {t.name: tuple(e.value for e in t.external_data)
                        for t in model.graph.initializer if t.external_data}
    return found


def test_artifact_has_the_three_graphs_tokenizer_and_a_complete_manifest(tiny_int4):
    manifest = json.loads((tiny_int4 / "manifest.json").read_text())
    for name in ("lower.onnx", "upper.onnx", "head.onnx", "lower.data", "tokenizer.json",
                 "chat_template.jinja", "lower_x4.onnx", "upper_x8.onnx"):
        assert name in manifest["files"] and (tiny_int4 / name).is_file()
    assert set(manifest["files"]) == {p.name for p in tiny_int4.iterdir()} - {"manifest.json"}
    assert not any(name.startswith(("lower_x", "upper_x")) and name.endswith(".data")
                   for name in manifest["files"])  # the batch graphs' weights are lower's, upper's
    assert manifest["format_version"] == FORMAT_VERSION and manifest["precision"] == "int4"
    assert set(manifest["batch_round_costs"]) == {"2", "4", "8"}
    assert manifest["architecture"]["num_layers"] == 4
    assert 1 <= manifest["exit_layer"] < 4
    assert all(len(info["sha256"]) == 64 for info in manifest["files"].values())


def test_every_weight_is_stored_once(tiny_int4):
    tensors = external_tensors(tiny_int4)
    places = [place for graph in tensors.values() for place in graph.values()]
    by_name = {}
    for graph in tensors.values():
        for name, place in graph.items():
            assert by_name.setdefault(name, place) == place, f"{name} is stored twice"
    assert len(set(places)) == len(by_name)
    # the tied embedding table: looked up by lower, multiplied by head, one copy on disk
    assert "embed_tokens.qweight" in tensors["lower"] and "embed_tokens.qweight" in tensors["head"]
    assert tensors["head"]["embed_tokens.qweight"][0] == "lower.data"


@pytest.mark.parametrize("arch, tie, scheme, head_bits", [
    ("llama", True, "zp", 8), ("qwen2", False, "zp", 4),
    ("llama", True, "zp", "mixed"), ("qwen2", False, "zp", "mixed"),
    ("gemma3", True, "zp", 8), ("gemma3", True, "int8", 8), ("qwen2", False, "int8", 8)])
def test_int4_graphs_compute_exactly_the_dequantized_model(arch, tie, scheme, head_bits,
                                                           tmp_path, monkeypatch):
    # accuracy level 0 keeps activations in fp32, so only the weight layout is under test;
    # scheme "int8" is --precision int8: every linear layer and the table at 8 bits
    monkeypatch.setattr(edgespec.export.graph, "ACCURACY_LEVEL", 0)
    monkeypatch.setattr(edgespec.export.graph, "FREQUENT_TOKENS", 100)  # mixed: ids 0..99 at 8 bits
    checkpoint = make_checkpoint(tmp_path / "ckpt", arch=arch, tie=tie)
    precision = "int8" if scheme == "int8" else "int4"
    export_model(str(checkpoint), tmp_path / "a", precision=precision,
                 int4_scheme="zp", head_bits=head_bits,
                 gptq=False, log=quiet)  # GPTQ's codes: tests/test_gptq.py
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = [int(t) for t in np.random.default_rng(2).integers(5, 300, 20)]
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if p.dim() != 2:
                continue
            w = p.numpy()
            if "embed" in name or "lm_head" in name:  # the vocabulary table: head_bits
                w = vocab_table(w, head_bits, frequent=100)
            elif scheme == "int8":
                w = dequantize_int8(quantize_int8(w))
            else:
                w = dequantize_int4(quantize_int4(w))
            p.copy_(torch.from_numpy(w))
        want = reference(torch.tensor([ids])).logits[0].numpy()
    engine = edgespec.load(tmp_path / "a").engine
    seq = engine.new_sequence()
    engine.lower(seq, 0, np.array(ids))
    engine.upper(seq, 0, len(ids))
    got = engine.head(range(len(ids)))
    assert np.abs(got - want).max() < 1e-4


def vocab_table(w, head_bits, frequent):
    """The vocabulary table as the int4 graphs compute with it."""
    eight, four = dequantize_int8(quantize_int8(w)), dequantize_int4(quantize_int4(w))
    if head_bits == "mixed":  # the first ids at 8 bits, the rest at 4, each quantized alone
        return np.concatenate([eight[:frequent], dequantize_int4(quantize_int4(w[frequent:]))])
    return eight if head_bits == 8 else four


def test_8_bit_blocks_err_by_at_most_half_a_step():
    w = np.random.default_rng(0).normal(size=(48, 4 * BLOCK)).astype(np.float32)
    q = quantize_int8(w)
    step = np.repeat(q.scales, BLOCK, axis=1)
    assert np.all(np.abs(dequantize_int8(q) - w) <= step / 2 + 1e-6)


def test_zero_point_search_has_less_error_than_min_max(monkeypatch):
    w = np.random.default_rng(0).normal(size=(256, 8 * BLOCK)).astype(np.float32)
    searched = np.square(dequantize_int4(quantize_int4(w)) - w).mean()
    monkeypatch.setattr(edgespec.export.quantize, "SCALE_GRID", np.array([1.0], np.float32))
    monkeypatch.setattr(edgespec.export.quantize, "REFINE_STEPS", 0)
    min_max = np.square(dequantize_int4(quantize_int4(w)) - w).mean()
    assert searched < 0.95 * min_max


def test_weights_already_on_the_8_bit_grid_come_back_exactly():
    w = np.random.default_rng(1).normal(size=(16, 8 * BLOCK)).astype(np.float32)
    on_grid = dequantize_int8(quantize_int8(w))
    np.testing.assert_allclose(dequantize_int8(quantize_int8(on_grid)), on_grid, rtol=0, atol=1e-6)


def test_export_cli_prints_a_summary(tiny_checkpoint, tmp_path):
    result = run_cli("export", tiny_checkpoint, "-o", tmp_path / "m", "--exit-layer", "2",
                     "--precision", "fp16", "--max-context", "256", "--adapter", "none",
                     "--shortlist", "0", "--no-calibrate")
    assert result.returncode == 0, result.stderr
    assert "4 layers, exit layer 2, fp16, context 256" in result.stderr
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert (manifest["exit_layer"], manifest["max_context"]) == (2, 256)


def test_export_cli_refuses_auto_exit_layer_without_calibration(tiny_checkpoint, tmp_path):
    result = run_cli("export", tiny_checkpoint, "-o", tmp_path / "m", "--no-calibrate")
    assert "give a number with --no-calibrate" in one_error_line(result.stderr)


def test_unsupported_architecture_is_named(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "ckpt", layers=2)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "model_type": "gpt2",
                                                        "architectures": ["GPT2LMHeadModel"]}))
    result = run_cli("export", checkpoint, "-o", tmp_path / "out")
    assert result.returncode != 0
    assert "unsupported architecture gpt2; supported: llama, mistral, qwen2, gemma3" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["no/such/dir/model.gguf"], "does not exist"),
    (["./missing-checkpoint"], "does not exist"),
])
def test_a_model_path_that_does_not_exist_is_a_one_line_error(args, message, tmp_path):
    result = run_cli("export", *args, "-o", tmp_path / "out")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert message in one_error_line(result.stderr)


def test_exit_layer_out_of_range_is_refused(tiny_checkpoint, tmp_path):
    with pytest.raises(EdgespecError, match="exit layer 4 is out of range"):
        export_model(str(tiny_checkpoint), tmp_path / "x", exit_layer=4, log=quiet)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("option, message", [
    ({"int4_scheme": "q3_k"}, "unknown int4 scheme q3_k; choose one of auto, source, zp"),
    ({"int4_scheme": "source", "precision": "int8"},
     "--int4-scheme source keeps a GGUF's grids, which --precision int8 would re-round; "
     "drop one of them"),
    ({"head_bits": 6}, "unsupported head bits 6; choose 8, 4 or mixed"),
])
def test_an_unknown_quantization_is_refused_before_the_model_is_read(option, message, tmp_path):
    # the model does not exist either: the option is what gets reported, first
    with pytest.raises(EdgespecError, match=message):
        export_model("no/such/model.gguf", tmp_path / "x", log=quiet, **option)
    assert not (tmp_path / "x").exists()


def test_a_layer_width_off_the_int4_blocks_is_refused(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "ckpt", layers=2, intermediate_size=80)
    with pytest.raises(EdgespecError, match="the model's intermediate_size is 80"):
        export_model(str(checkpoint), tmp_path / "x", exit_layer=1, log=quiet)
    export_model(str(checkpoint), tmp_path / "x", exit_layer=1, precision="fp16", log=quiet)


def test_an_interrupted_export_leaves_no_half_written_artifact(tiny_checkpoint, tmp_path):
    def interrupt_late(message):  # Ctrl-C once the graphs are written
        if message.startswith("measuring quality"):
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        export_model(str(tiny_checkpoint), tmp_path / "x", exit_layer=2, log=interrupt_late)
    assert list(tmp_path.iterdir()) == []


def test_export_measures_quality_against_the_full_precision_model(tiny_fp32, tiny_int4):
    fp32, int4 = (json.loads((a / "manifest.json").read_text())["quality"]
                  for a in (tiny_fp32, tiny_int4))
    # the fp32 graphs compute the reference model (test_parity), so they agree everywhere
    assert fp32["top1_agreement"] == 1.0
    assert fp32["perplexity"] == pytest.approx(fp32["reference_perplexity"], rel=1e-3)
    assert int4["reference_perplexity"] == fp32["reference_perplexity"]
    assert int4["top1_agreement"] < 1.0 and int4["perplexity"] != fp32["perplexity"]


def test_an_uncalibrated_export_ships_the_adaptive_policy_with_prompt_lookup(tiny_int4):
    manifest = json.loads((tiny_int4 / "manifest.json").read_text())
    assert manifest["draft"] == {"k": 4, "threshold": 0.0, "lookup_k": LOOKUP_K, "adaptive": True}
    # what a verify costs by rows, measured on this machine, plans lookup's drafts
    costs = manifest["round_costs"]
    assert costs["1"] == 1.0 and set(costs) == {str(rows) for rows in COST_ROWS}
    assert all(cost > 0 for cost in costs.values())


def test_export_measures_fidelity_of_greedy_answers(tiny_fp32, tiny_int4):
    fp32, int4 = (json.loads((a / "manifest.json").read_text())["fidelity"]
                  for a in (tiny_fp32, tiny_int4))
    n = len(fidelity.questions())
    assert fp32["questions"] == int4["questions"] == n >= 24
    # the fp32 graphs compute the reference model: every greedy reply starts the same
    assert fp32["first16_equal"] == n and fp32["top1_agreement"] == 1.0
    assert int4["top1_agreement"] < 1.0 and int4["first16_equal"] < n
    assert fp32["reference_right"] == int4["reference_right"] <= n


def test_cuda_graphs_keep_a_residual_stream_past_fp16s_range(tmp_path):
    # Gemma 3's residual stream passes fp16's 65504; this tiny one's post-MLP norms scale it
    # past that too, so fp16 graphs would carry inf
    from safetensors.numpy import load_file, save_file
    checkpoint = make_checkpoint(tmp_path / "ckpt", arch="gemma3")
    weights = load_file(checkpoint / "model.safetensors")
    for name in weights:
        if name.endswith("post_feedforward_layernorm.weight"):
            weights[name] += np.float32(40000)
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})
    ids = [int(t) for t in np.random.default_rng(0).integers(5, 300, 40)]
    logits = {}
    for device in ("cpu", "cuda"):
        export_model(str(checkpoint), tmp_path / device, device=device, log=quiet)
        engine = edgespec.load(tmp_path / device, device="cpu").engine
        seq = engine.new_sequence()
        engine.lower(seq, 0, np.array(ids))
        engine.upper(seq, 0, len(ids))
        states = engine.final_states.numpy()[0, :len(ids)]
        assert np.abs(states).max() > 65504 and np.isfinite(states).all(), device
        logits[device] = engine.head(range(len(ids))).astype(np.float32)
    manifest = json.loads((tmp_path / "cuda" / "manifest.json").read_text())
    assert (manifest["activation_dtype"], manifest["residual_dtype"]) == ("float16", "float32")
    # what is left is the fp16 layers' own rounding
    np.testing.assert_allclose(logits["cuda"], logits["cpu"], rtol=0, atol=0.5)
