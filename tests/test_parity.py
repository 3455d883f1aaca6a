"""The exported graphs compute the same model as transformers (tiny random checkpoints)."""
import numpy as np
import pytest
import torch
from helpers import make_checkpoint, quiet
from transformers import AutoModelForCausalLM

import edgespec
from edgespec.export.pipeline import export_model


def reference_logits(checkpoint, ids):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def artifact_logits(model, ids, prefill):
    """Logits at every position: `prefill` tokens in one pass, then one token per step."""
    engine, seq = model.engine, model.sequence  # lower at 0 forgets what it held
    engine.lower(seq, 0, np.array(ids[:prefill]))
    engine.upper(seq, 0, prefill)
    rows = [engine.head(range(prefill)).copy()]
    rows += [engine.prefill(seq, position, [t])[None].copy()
             for position, t in enumerate(ids[prefill:], prefill)]
    return np.concatenate(rows)


def prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(5, 300, n)]


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 500000.0}


@pytest.fixture(scope="module", params=["llama-tied", "qwen2-untied", "llama-tied-llama3rope",
                                                 "gemma3-untied"])
def checkpoint_and_artifact(request, tmp_path_factory):
    arch, tie, *rope = request.param.split("-")
    checkpoint = make_checkpoint(tmp_path_factory.mktemp(request.param), arch=arch,
                                 tie=tie == "tied", seed=1,
                                 rope=LLAMA3_ROPE if rope else None)
    out = tmp_path_factory.mktemp("artifacts") / request.param
    export_model(str(checkpoint), out, precision="fp32", exit_layer=2, log=quiet)
    return checkpoint, edgespec.load(out)


def test_fp32_logits_match_transformers_in_prefill_and_decode(checkpoint_and_artifact):
    checkpoint, model = checkpoint_and_artifact
    ids = prompt(24)
    want = reference_logits(checkpoint, ids)
    got = artifact_logits(model, ids, prefill=10)
    assert np.abs(got - want).max() < 1e-4


def test_fp32_greedy_tokens_match_transformers_generate(checkpoint_and_artifact):
    checkpoint, model = checkpoint_and_artifact
    ids = prompt(12, seed=3)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    model.stop_ids = set()  # compare all 32 tokens, even past an end-of-turn token
    got = model.generate_ids(ids, max_new_tokens=32).tokens
    assert len(set(want)) > 4, "the reference continuation is too degenerate to tell anything"
    assert got == want


def test_prefill_longer_than_a_chunk_matches_transformers(tiny_checkpoint, tiny_fp32):
    from edgespec.engine import CHUNK
    ids = prompt(CHUNK + 40, seed=5)
    model = edgespec.load(tiny_fp32)
    got = model.engine.prefill(model.sequence, 0, ids)
    want = reference_logits(tiny_checkpoint, ids)[-1]
    assert np.abs(got - want).max() < 1e-4


def test_a_token_run_alone_gets_the_bits_it_gets_among_others(tiny_fp32):
    from edgespec.engine import CHUNK
    ids = prompt(CHUNK + 1, seed=6)
    engine = edgespec.load(tiny_fp32).engine
    seq = engine.new_sequence()
    chunked = engine.prefill(seq, 0, ids).copy()
    seq.rollback(0)
    engine.lower(seq, 0, np.array(ids[:CHUNK - 1]))
    engine.upper(seq, 0, CHUNK - 1)
    engine.lower(seq, CHUNK - 1, np.array(ids[CHUNK - 1:]))
    engine.upper(seq, CHUNK - 1, 2)
    np.testing.assert_array_equal(chunked, engine.head([1])[0])


def final_states_in_calls_of(engine, ids, size):
    """The final hidden state of every id, the ids run `size` at a time."""
    seq, rows = engine.new_sequence(), []
    for at in range(0, len(ids), size):
        piece = ids[at:at + size]
        engine.lower(seq, at, np.array(piece))
        engine.upper(seq, at, len(piece))
        rows.append(engine.final_states.numpy()[0, :len(piece)].copy())
    return np.concatenate(rows)


@pytest.mark.parametrize("head_dim", [256, 512])
def test_rows_get_the_same_bits_in_calls_of_any_size_with_wide_heads(head_dim, tmp_path):
    """Attention's scores GEMM slices K = head_dim by the call's total length (Gemma 3's
    256): rows run one by one and in calls of several agree bit for bit across position 64."""
    checkpoint = make_checkpoint(tmp_path / "checkpoint", layers=2, head_dim=head_dim)
    export_model(str(checkpoint), tmp_path / "artifact", precision="fp32", exit_layer=1,
                 log=quiet)
    engine, ids = edgespec.load(tmp_path / "artifact").engine, prompt(80, seed=8)
    alone = final_states_in_calls_of(engine, ids, 1)
    for size in (3, 5, 8, 80):
        np.testing.assert_array_equal(final_states_in_calls_of(engine, ids, size), alone,
                                      err_msg=f"calls of {size}")


def test_int4_rows_get_the_same_bits_alone_and_in_calls_of_any_size(tiny_int4):
    """MatMulNBits gives a row the same bits whatever the call's row count only in blocks of
    32 (larger blocks pair rows; DESIGN.md, "why blocks stay at 32")."""
    engine, ids = edgespec.load(tiny_int4).engine, prompt(24, seed=9)
    alone = final_states_in_calls_of(engine, ids, 1)
    for size in (2, 3, 4, 5, 8):
        np.testing.assert_array_equal(final_states_in_calls_of(engine, ids, size), alone,
                                      err_msg=f"calls of {size}")


def test_rolling_back_the_cache_length_reproduces_logits(tiny_fp32):
    model = edgespec.load(tiny_fp32)
    engine, ids = model.engine, prompt(16, seed=7)
    seq = engine.new_sequence()
    engine.prefill(seq, 0, ids)
    first = [engine.prefill(seq, seq.lower_len, [t]).copy() for t in (11, 12, 13)]
    seq.lower_len -= 3  # forget the three steps without touching the buffers
    seq.upper_len -= 3
    again = [engine.prefill(seq, seq.lower_len, [t]).copy() for t in (11, 12, 13)]
    np.testing.assert_array_equal(np.array(first), np.array(again))


def test_kv_buffers_are_allocated_once_and_reused(tiny_fp32):
    model = edgespec.load(tiny_fp32)
    pointers = {name: value.data_ptr() for name, value in model.sequence.kv.items()}
    model.generate_ids(prompt(8), max_new_tokens=20)
    model.generate_ids(prompt(30), max_new_tokens=20)
    assert {name: value.data_ptr() for name, value in model.sequence.kv.items()} == pointers
