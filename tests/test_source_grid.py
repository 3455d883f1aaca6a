"""A quantized GGUF keeps its own grid (int4 scheme "source", the default for one): the
file's codes and scales go into MatMulNBits as they are, each block's minimum an integer
zero point plus a residual; the artifact computes with the file's weights."""
import json

import gguf
import numpy as np
import onnx
import pytest
from gguf import GGMLQuantizationType as T
from gguf_files import make_gguf
from helpers import make_checkpoint, quiet
from test_gguf import K_QUANTS, k_quant_blocks

import edgespec
import edgespec.export.graph
from edgespec.errors import EdgespecError
from edgespec.export import gguf_quants
from edgespec.export.pipeline import export_model
from edgespec.export.quantize import SourceWeight, residual_columns

SYMMETRIC = [T.Q4_0, T.Q5_0, T.Q8_0]  # no minimum: integer zero points hold them exactly


def source_weight(data, qtype, shape) -> SourceWeight:
    return SourceWeight.from_affine(*gguf_quants.affine(data, int(qtype), shape))


def blocks_of(qtype):
    """(raw blocks, shape): real ones from the gguf package's quantizer, or random K-quants."""
    if qtype in K_QUANTS:
        data = k_quant_blocks(qtype)
        return data, (16, 3 * 256)
    w = np.random.default_rng(0).normal(size=(24, 256)).astype(np.float32)
    return gguf.quants.quantize(w, qtype).view(np.uint8), w.shape


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, *K_QUANTS],
                         ids=lambda t: t.name)
def test_the_grid_is_the_dequantized_tensor(qtype):
    data, shape = blocks_of(qtype)
    want = gguf_quants.dequantize(data, int(qtype), shape)
    q = source_weight(data, qtype, shape)
    # codes of 5 and 6 bits go to 8-bit MatMulNBits, 4-bit ones stay at 4
    assert q.bits == (4 if qtype in (T.Q4_0, T.Q4_1, T.Q4_K) else 8)
    assert q.codes.max() < 1 << q.bits
    np.testing.assert_allclose(q.dequantized(), want, rtol=0, atol=1e-6 * np.abs(want).max())
    assert (q.residual is None) == (qtype in SYMMETRIC or qtype == T.Q6_K)


def test_parts_of_other_types_join_exactly():
    # a Q4_1 part (4 bits, blocks of 32, residual) beside a Q6_K one (8 bits, blocks of 16)
    q4 = source_weight(*blocks_of(T.Q4_1)[:1], T.Q4_1, (24, 256))
    data = k_quant_blocks(T.Q6_K, rows=8, row_blocks=1)
    q6 = source_weight(data, T.Q6_K, (8, 256))
    joined = SourceWeight.joined([q4, q6])
    assert (joined.bits, joined.block) == (8, 16)
    np.testing.assert_allclose(joined.dequantized(),
                               np.concatenate([q4.dequantized(), q6.dequantized()]), atol=1e-6)


def test_parts_of_other_grids_stay_apart():
    # q and k (4 bits, blocks of 32) keep their grid beside a Q6_K v (8 bits, blocks of 16)
    q4 = source_weight(*blocks_of(T.Q4_1)[:1], T.Q4_1, (24, 256))
    q6 = source_weight(k_quant_blocks(T.Q6_K, rows=8, row_blocks=1), T.Q6_K, (8, 256))
    groups = SourceWeight.grouped([q4, q4, q6])
    assert [(p.shape, p.bits, p.block) for p in groups] == [((48, 256), 4, 32), ((8, 256), 8, 16)]
    np.testing.assert_array_equal(np.concatenate([p.dequantized() for p in groups]), np.concatenate(
        [q4.dequantized(), q4.dequantized(), q6.dequantized()]))


def test_residual_columns_keep_each_minimum_within_a_step_of_the_rows_residuals():
    q = source_weight(*blocks_of(T.Q4_1)[:1], T.Q4_1, (24, 256))
    n, k = q.shape
    blocks = k // q.block
    wide = residual_columns(q)
    assert wide.shape == (n, k + 32) and wide.residual is None
    # the file's codes, scales and zero points come first, unchanged
    assert np.array_equal(wide.codes[:, :k], q.codes)
    assert np.array_equal(wide.scales[:, :blocks], q.scales)
    # the next columns, times the block sums, give back each block's residual
    minima = wide.dequantized()[:, k:k + blocks]
    # a 4-bit step over their spread (the least-squares fit may clip an extreme one)
    spread = np.maximum(q.residual.max(1, keepdims=True), 0) - np.minimum(
        q.residual.min(1, keepdims=True), 0)
    assert np.all(np.abs(minima - q.residual) <= spread / 15)
    assert np.any(minima != q.residual)  # rounded: not the float32 values


def logits(path, ids):
    engine = edgespec.load(path).engine
    seq = engine.new_sequence()
    engine.lower(seq, 0, np.array(ids))
    engine.upper(seq, 0, len(ids))
    return engine.head(range(len(ids)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("grid") / "ckpt", layers=2, seed=5)


@pytest.mark.parametrize("qtype", [*SYMMETRIC, T.Q4_1], ids=lambda t: t.name)
def test_a_quantized_gguf_exports_with_its_own_weights_by_default(qtype, checkpoint, tmp_path,
                                                                  monkeypatch):
    # accuracy level 0 keeps activations in fp32, so only the weights are under test; the
    # reference is the same file exported in fp32, its tensors dequantized
    monkeypatch.setattr(edgespec.export.graph, "ACCURACY_LEVEL", 0)
    path = make_gguf(checkpoint, tmp_path / "m.gguf", qtype)
    export_model(str(path), tmp_path / "fp32", precision="fp32", exit_layer=1, log=quiet)
    manifest = export_model(str(path), tmp_path / "grid", exit_layer=1, log=quiet)
    assert manifest["build"]["int4_scheme"] == "source" and manifest["precision"] == "int4"
    ids = [int(t) for t in np.random.default_rng(3).integers(5, 300, 20)]
    want = logits(tmp_path / "fp32", ids)
    error = np.abs(logits(tmp_path / "grid", ids) - want).max()
    if qtype in SYMMETRIC:
        assert error < 1e-4
        return
    # Q4_1's minima: the residual columns round them a little; re-rounding the weights to
    # zero points (the zp scheme) errs far more
    export_model(str(path), tmp_path / "zp", int4_scheme="zp", exit_layer=1, gptq=False,
                 log=quiet)
    assert error < 0.25 * np.abs(logits(tmp_path / "zp", ids) - want).max()


def test_a_layer_mixing_grids_runs_each_at_its_own_bits(checkpoint, tmp_path, monkeypatch):
    # a Q4_K_M-like mix: v at 8 bits beside 4-bit q and k; the 4-bit parts stay at 4 bits
    monkeypatch.setattr(edgespec.export.graph, "ACCURACY_LEVEL", 0)
    path = make_gguf(checkpoint, tmp_path / "m.gguf", T.Q4_1, types={"v_proj": T.Q8_0})
    export_model(str(path), tmp_path / "fp32", precision="fp32", exit_layer=1, log=quiet)
    export_model(str(path), tmp_path / "grid", exit_layer=1, log=quiet)
    lower = onnx.load(tmp_path / "grid" / "lower.onnx", load_external_data=False)
    bits = [next(a.i for a in n.attribute if a.name == "bits") for n in lower.graph.node
            if n.op_type == "MatMulNBits" and ".qkv" in n.input[1]]
    assert sorted(bits) == [4, 8]
    ids = [int(t) for t in np.random.default_rng(4).integers(5, 300, 20)]
    want = logits(tmp_path / "fp32", ids)
    assert np.abs(logits(tmp_path / "grid", ids) - want).max() < 0.05 * np.abs(want).max()


def test_the_source_scheme_needs_a_quantized_gguf(checkpoint, tmp_path):
    with pytest.raises(EdgespecError) as error:
        export_model(str(checkpoint), tmp_path / "a", int4_scheme="source", log=quiet)
    assert str(error.value).startswith("--int4-scheme source keeps a quantized GGUF")


def test_a_float_source_is_rounded_to_zero_points_by_default(checkpoint, tmp_path):
    manifest = export_model(str(checkpoint), tmp_path / "a", exit_layer=1, gptq=False, log=quiet)
    assert manifest["build"]["int4_scheme"] == "zp"


def test_rows_of_a_source_grid_get_the_same_bits_alone_and_in_calls_of_any_size(tmp_path):
    # the residual's block sums included (a ReduceSum: each row summed alone)
    from test_parity import final_states_in_calls_of, prompt
    wide = make_checkpoint(tmp_path / "ckpt", layers=2, seed=6, intermediate_size=1024)
    path = make_gguf(wide, tmp_path / "m.gguf", T.Q4_1)
    export_model(str(path), tmp_path / "grid", exit_layer=1, log=quiet)
    engine, ids = edgespec.load(tmp_path / "grid").engine, prompt(24, seed=9)
    alone = final_states_in_calls_of(engine, ids, 1)
    for size in (2, 3, 5, 8):
        np.testing.assert_array_equal(final_states_in_calls_of(engine, ids, size), alone,
                                      err_msg=f"calls of {size}")
