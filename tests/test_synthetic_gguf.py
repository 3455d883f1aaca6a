"""benchmarks/synthetic_gguf.py: a Llama-shaped Q4_K_M GGUF of random blocks that the
exporter loads, whose weights dequantize to finite values of the intended spread."""
import gguf
import numpy as np
import pytest

from benchmarks.synthetic_gguf import (NORM_SPREAD, WEIGHT_STD, Shape, main, tensor_plan,
                                       use_more_bits)
from edgespec.export import gguf_quants
from edgespec.export.gguf import GGUFFile
from edgespec.export.source import load_source

TINY = dict(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=49408)


def tiny_args(path, seed=0):
    return [str(path), "--seed", str(seed)] + [
        a for k, v in TINY.items() for a in ("--" + k.replace("_", "-"), str(v))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("synthetic") / "tiny.gguf"
    main(tiny_args(path))
    return path


def test_the_default_plan_is_llama_3_1_8b_q4_k_m():
    plan = tensor_plan(Shape())
    counts = {kind.name: sum(k == kind for _, _, k in plan) for kind in {k for _, _, k in plan}}
    assert counts == {"F32": 65, "Q4_K": 193, "Q6_K": 33}  # a real Q4_K_M file's, less rope_freqs
    assert [i for i in range(32) if use_more_bits(i, 32)] == [
        0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    size = sum(gguf_quants.nbytes(int(k), int(np.prod(s))) for _, s, k in plan)
    assert 4.85e9 < size < 4.95e9


def test_the_exporter_loads_it_as_the_asked_llama(tiny):
    source = load_source(str(tiny))
    a = source.arch
    assert (a.model_type, a.num_layers, a.hidden_size, a.intermediate_size,
            a.num_heads, a.num_kv_heads, a.head_dim, a.vocab_size) == (
        "llama", 2, 256, 512, 4, 2, 64, 49408)
    assert (a.rope_theta, a.max_position_embeddings, a.tie_word_embeddings) == (
        500000.0, 131072, False)
    assert len(source.tokenizer) == 49408
    assert source.tokenizer.convert_ids_to_tokens(49152) == "<|reserved_0|>"
    assert source.tokenizer("<|im_start|>user")["input_ids"][0] == 1
    assert (source.eos_token_ids, source.bos_token_id) == ([2], 1)
    assert "<|im_start|>" in source.chat_template


def test_tensor_types_follow_q4_k_m(tiny):
    file = GGUFFile(tiny)
    # layer 0 keeps Q4_K for attn_v and ffn_down; layer 1, the last eighth, gets Q6_K
    assert file.type_counts() == {"F32": 5, "Q4_K": 13, "Q6_K": 3}
    assert gguf_quants.type_name(file.tensors["blk.1.ffn_down.weight"][0]) == "Q6_K"
    assert gguf_quants.type_name(file.tensors["output.weight"][0]) == "Q6_K"


def test_every_tensor_dequantizes_to_finite_weights_of_the_intended_spread(tiny):
    file = GGUFFile(tiny)
    for name, (kind, shape, _) in file.tensors.items():
        w = file.array(name)
        assert np.isfinite(w).all(), name
        if kind == gguf_quants.F32:
            assert abs(w.mean() - 1) < 0.01, name
            assert abs(w.std() - NORM_SPREAD) < 0.2 * NORM_SPREAD, name
        else:
            assert abs(w.mean()) < 0.05 * WEIGHT_STD, name
            assert abs(w.std() - WEIGHT_STD) < 0.05 * WEIGHT_STD, name
            # llama.cpp's own arithmetic (the gguf package) reads the same blocks
            theirs = gguf.quants.dequantize(np.asarray(file.raw(name)),
                                            gguf.GGMLQuantizationType(kind))
            assert np.array_equal(theirs.reshape(shape), w), name


def test_the_same_seed_writes_the_same_bytes(tiny, tmp_path):
    main(tiny_args(tmp_path / "again.gguf"))
    main(tiny_args(tmp_path / "other.gguf", seed=1))
    assert (tmp_path / "again.gguf").read_bytes() == tiny.read_bytes()
    assert (tmp_path / "other.gguf").read_bytes() != tiny.read_bytes()


def test_a_shape_without_whole_blocks_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "bad.gguf"), "--hidden", "300"])
    assert "multiples of 256" in capsys.readouterr().err
    assert not (tmp_path / "bad.gguf").exists()
