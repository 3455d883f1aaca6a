"""GGUF import: our dequantizers equal the gguf package's, the file is read by its header
first, and a GGUF written from a checkpoint exports to the checkpoint's logits."""
import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_files import make_gguf
from helpers import make_checkpoint, one_error_line, quiet, run_cli
from transformers import AutoModelForCausalLM

import edgespec
from edgespec.errors import EdgespecError
from edgespec.export import gguf_quants
from edgespec.export.gguf import GGUFFile
from edgespec.export.pipeline import export_model
from edgespec.export.source import load_source

# types the gguf package can quantize: real blocks made by its own quantizer
QUANTIZABLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16, T.F16, T.F32]
# K-quants it only dequantizes: random blocks (every byte pattern is a valid block; only
# the float16 scales are kept finite)
K_QUANTS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def ours(data: np.ndarray, qtype, shape):
    return gguf_quants.dequantize(data.view(np.uint8), int(qtype), shape)


def same_bits(a, b):
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32),
                          np.asarray(b, np.float32).view(np.uint32))


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_dequantized_blocks_equal_the_gguf_package_bit_for_bit(qtype):
    w = np.random.default_rng(0).normal(size=(24, 256)).astype(np.float32)
    data = gguf.quants.quantize(w, qtype)
    assert same_bits(ours(data, qtype, w.shape), gguf.quants.dequantize(data, qtype))


def k_quant_blocks(qtype, rows=16, row_blocks=3):
    size = gguf_quants.BLOCKS[int(qtype)][1]
    rng = np.random.default_rng(int(qtype))
    data = rng.integers(0, 256, (rows, row_blocks, size), dtype=np.uint8)
    for at in K_QUANTS[qtype]:  # scales of about 1e-3..1e-1, never inf or nan
        data[..., at:at + 2] = rng.uniform(1e-3, 1e-1, (rows, row_blocks, 1)).astype(
            np.float16).view(np.uint8)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(K_QUANTS), ids=lambda t: t.name)
def test_k_quant_blocks_equal_the_gguf_package_bit_for_bit(qtype):
    rows, row_blocks = 16, 3
    data = k_quant_blocks(qtype, rows, row_blocks)
    want = gguf.quants.dequantize(data, qtype)
    assert want.shape == (rows, row_blocks * 256)
    assert same_bits(ours(data, qtype, want.shape), want)


def test_large_tensors_are_converted_in_chunks_with_the_same_result(monkeypatch):
    w = np.random.default_rng(1).normal(size=(40, 320)).astype(np.float32)
    data = gguf.quants.quantize(w, T.Q5_0)
    whole = ours(data, T.Q5_0, w.shape)
    monkeypatch.setattr(gguf_quants, "CHUNK_BLOCKS", 7)  # 400 blocks in uneven chunks
    assert same_bits(ours(data, T.Q5_0, w.shape), whole)


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    """(checkpoint, its GGUF in Q8_0) for a tiny Llama."""
    tmp = tmp_path_factory.mktemp("gguf")
    checkpoint = make_checkpoint(tmp / "ckpt", layers=2, seed=4)
    return checkpoint, make_gguf(checkpoint, tmp / "tiny.Q8_0.gguf", T.Q8_0)


def test_the_header_names_architecture_tensors_and_types_without_reading_data(gguf_pair):
    _, path = gguf_pair
    header = GGUFFile(path)
    assert header.architecture == "llama" and header.field("block_count") == 2
    assert header.tensors["blk.0.attn_q.weight"][:2] == (int(T.Q8_0), (64, 64))
    assert header.type_counts() == {"F32": 5, "Q8_0": 15}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_a_gguf_exports_to_the_logits_of_the_checkpoint_it_was_written_from(arch, tmp_path):
    # llama.cpp's layout undone: names, Llama's q/k permutation, Gemma's 1 + w norms
    extra = dict(layers=6, query_pre_attn_scalar=16,  # what llama.cpp assumes for Gemma 3
                 layer_types=["sliding_attention"] * 5 + ["full_attention"]) \
        if arch == "gemma3" else {}
    checkpoint = make_checkpoint(tmp_path / "ckpt", arch=arch, tie=arch != "qwen2", seed=2,
                                 **extra)
    path = make_gguf(checkpoint, tmp_path / "m.gguf", T.F32)
    export_model(str(path), tmp_path / "a", precision="fp32", exit_layer=2, log=quiet)
    ids = [int(t) for t in np.random.default_rng(3).integers(5, 300, 20)]
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0].numpy()
    engine = edgespec.load(tmp_path / "a").engine
    seq = engine.new_sequence()
    engine.lower(seq, 0, np.array(ids))
    engine.upper(seq, 0, len(ids))
    assert np.abs(engine.head(range(len(ids))) - want).max() < 1e-4


def test_gguf_weights_are_read_one_tensor_at_a_time(gguf_pair):
    checkpoint, path = gguf_pair
    source = load_source(str(path))
    assert not isinstance(source.weights, dict)  # a view on the file, not a loaded model
    table = source.weights["model.embed_tokens.weight"]
    want = gguf.quants.dequantize(GGUFFile(path).raw("token_embd.weight").reshape(table.shape[0], -1),
                                  T.Q8_0)
    assert same_bits(table, want)
    assert source.weights.nbytes("model.embed_tokens.weight") == table.nbytes


def _with_tensor_type(path, out, tensor_type):
    """A copy of a GGUF with the type id of one tensor changed in its tensor table."""
    data = bytearray(path.read_bytes())
    name = b"blk.1.ffn_up.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8  # past n_dims and the two dims
    data[at:at + 4] = tensor_type.to_bytes(4, "little")
    out.write_bytes(bytes(data))
    return out


def test_export_refuses_an_unsupported_architecture_in_one_line(gguf_pair, tmp_path):
    bad = make_gguf(gguf_pair[0], tmp_path / "bad.gguf", T.Q8_0, arch_name="bert")
    result = run_cli("export", bad, "-o", tmp_path / "out", "--no-calibrate", "--exit-layer", "1")
    assert result.returncode != 0 and not (tmp_path / "out").exists()
    assert "unsupported architecture bert in bad.gguf; supported: llama, qwen2, gemma3" in \
        one_error_line(result.stderr)


def test_export_refuses_an_unsupported_tensor_type_by_name_before_reading_weights(
        gguf_pair, tmp_path):
    bad = _with_tensor_type(gguf_pair[1], tmp_path / "bad.gguf", 11)
    result = run_cli("export", bad, "-o", tmp_path / "out", "--no-calibrate", "--exit-layer", "1")
    assert result.returncode != 0 and not (tmp_path / "out").exists()
    assert "unsupported GGUF tensor type Q3_K (blk.1.ffn_up.weight) in bad.gguf" in \
        one_error_line(result.stderr)


def test_a_truncated_gguf_is_named(gguf_pair, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_pair[1].read_bytes()[:300])
    with pytest.raises(EdgespecError, match="cut.gguf is not a readable GGUF file"):
        load_source(str(cut))


def test_export_reports_progress_of_every_phase(gguf_pair, tmp_path):
    result = run_cli("export", gguf_pair[1], "-o", tmp_path / "m", "--no-calibrate",
                     "--exit-layer", "1", "--adapter", "none", "--shortlist", "0")
    assert result.returncode == 0, result.stderr
    for phase in ("read llama: 2 layers", "GGUF tensors Q8_0 15, F32 5", "memory: about",
                  "building int4 graphs (exit layer 1): layers + head: 100%", "3/3",
                  "measuring quality", "measuring fidelity"):
        assert phase in result.stderr, phase
    assert json.loads((tmp_path / "m" / "manifest.json").read_text())["architecture"][
        "model_type"] == "llama"
