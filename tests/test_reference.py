"""The gates' float32 reference (export/reference.py) computes the full transformers model,
one decoder layer in memory at a time, and its speculative greedy replies
(export/fidelity.py) are transformers' greedy replies whatever the draft."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf_files import make_gguf
from helpers import make_checkpoint

import edgespec.export.reference
from edgespec.export import fidelity
from edgespec.export.gguf import GGUFWeights
from edgespec.export.reference import EMBEDDING, HEAD, Reference
from edgespec.export.source import load_source

LENGTHS = (7, 20, 13, 1)  # one batch, right-padded; Gemma's window is 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    return {(arch, tie): make_checkpoint(tmp / f"{arch}-{tie}", arch=arch, tie=tie, seed=5)
            for arch, tie in (("llama", True), ("qwen2", False), ("gemma3", True))}


def source_of(checkpoints, arch, tie, form, tmp_path):
    checkpoint = checkpoints[arch, tie]
    return load_source(str(checkpoint if form == "checkpoint"
                           else make_gguf(checkpoint, tmp_path / "m.gguf")))


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, n).tolist() for n in LENGTHS]


@pytest.mark.parametrize("form", ["checkpoint", "gguf"])
@pytest.mark.parametrize("arch, tie", [("llama", True), ("qwen2", False), ("gemma3", True)])
def test_scores_equal_the_full_models_top1_and_log_probabilities(
        checkpoints, arch, tie, form, tmp_path, monkeypatch):
    monkeypatch.setattr(edgespec.export.reference, "VOCAB_SLICE", 100)  # the last one short
    source = source_of(checkpoints, arch, tie, form, tmp_path)
    full = source.torch_model  # the whole transformers model of the same weights
    reference = Reference(source.arch, source.weights)
    for ids, states in zip(batch(), reference.hidden(batch())):
        with torch.no_grad():
            logits = full(torch.tensor([ids])).logits[0].double()
        top1, log_p = reference.scores(states, ids[1:])
        want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), ids[1:]].numpy()
        assert top1.tolist() == logits.argmax(-1).tolist()
        np.testing.assert_allclose(log_p, want, rtol=0, atol=1e-4)


def test_a_pass_holds_one_weight_and_a_slice_of_the_vocabulary_table(
        checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(edgespec.export.reference, "VOCAB_SLICE", 100)
    whole, rows = [], []  # the tensors read whole, the sizes of the row ranges read
    getitem, read_rows = GGUFWeights.__getitem__, GGUFWeights.rows
    monkeypatch.setattr(GGUFWeights, "__getitem__",
                        lambda self, name: whole.append(name) or getitem(self, name))
    monkeypatch.setattr(GGUFWeights, "rows",
                        lambda self, name, r: rows.append(len(r)) or read_rows(self, name, r))
    source = source_of(checkpoints, "qwen2", False, "gguf", tmp_path)
    reference = Reference(source.arch, source.weights)
    model, held = reference.model, []  # (weights held by all layers, by the part running)
    parts = [part for layer in model.layers for part in layer.modules()
             if next(part.parameters(recurse=False), None) is not None]
    for part in parts:  # after the part's own hook has read its weights
        part.register_forward_pre_hook(lambda module, args: held.append(
            (sum(p.numel() for p in model.layers.parameters()),
             sum(p.numel() for p in module.parameters(recurse=False)))))
    ids = batch()[1]
    reference.scores(reference.hidden([ids])[0], ids[1:])
    layers = sum(source.weights.nbytes(name) // 4 for name in source.weights
                 if name.startswith("model.layers."))
    assert len(held) == len(parts) and all(total == own for total, own in held)
    assert sum(own for _, own in held) == layers  # every weight read, once
    assert all(p.numel() == 0 for p in model.layers.parameters())  # dropped after the pass
    vocab = source.arch.vocab_size
    assert all(vocab not in t.shape for t in (*model.parameters(), *model.buffers()))
    assert not {EMBEDDING, HEAD} & set(whole) and 0 < max(rows) <= 100


def test_an_mlp_runs_a_few_positions_at_a_time_and_gives_the_same_states(
        checkpoints, tmp_path, monkeypatch):
    source = source_of(checkpoints, "qwen2", False, "gguf", tmp_path)
    sequences = [batch()[1]] * 3
    whole = Reference(source.arch, source.weights).hidden(sequences)
    monkeypatch.setattr(edgespec.export.reference, "MLP_ROWS", 5)
    reference, widths = Reference(source.arch, source.weights), []
    for layer in reference.model.layers:
        layer.mlp.down_proj.register_forward_pre_hook(
            lambda module, args: widths.append(args[0].shape[0]))
    for a, b in zip(whole, reference.hidden(sequences)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert max(widths) == 5


def greedy_replies(full, prompts, stop_ids):
    """transformers' generate(): the replies the speculative ones must equal."""
    replies = []
    for ids in prompts:
        with torch.no_grad():
            out = full.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=fidelity.REPLY_TOKENS, do_sample=False, top_p=None, top_k=None,
                temperature=None, eos_token_id=list(stop_ids), pad_token_id=min(stop_ids))
        replies.append([t for t in out[0, len(ids):].tolist() if t not in stop_ids])
    return replies


@pytest.fixture(scope="module")
def greedy(checkpoints):
    """(source, prompts, stop ids, transformers' greedy replies): one reply ends early at a
    stop id taken from the middle of its reply without stops."""
    source = load_source(str(checkpoints["llama", True]))
    prompts = batch(1)
    free = greedy_replies(source.torch_model, prompts, {source.eos_token_ids[0]})
    stop_ids = {source.eos_token_ids[0], free[0][10]}
    return source, prompts, stop_ids, greedy_replies(source.torch_model, prompts, stop_ids)


def drafter_from(replies, prompts, wrong_every, vocab):
    """A drafter that knows the greedy replies and gets every `wrong_every`-th token wrong
    (0: never)."""
    def draft(ids, n):
        i = next(k for k, p in enumerate(prompts) if ids[:len(p)] == p)
        done = len(ids) - len(prompts[i])
        right = replies[i][done:done + n]
        return [(t + 1) % vocab if wrong_every and k % wrong_every == wrong_every - 1 else t
                for k, t in enumerate(right)]
    return draft


@pytest.mark.parametrize("wrong_every", [0, 5, 1])
def test_speculative_replies_equal_greedy_generate_whatever_the_draft(greedy, wrong_every):
    source, prompts, stop_ids, want = greedy
    # one reply stopped early, one went on to the end
    assert len(want[0]) <= 10 and max(map(len, want)) == fidelity.REPLY_TOKENS
    draft = drafter_from(want, prompts, wrong_every, source.arch.vocab_size)
    replies, rounds = fidelity.reference_replies(Reference(source.arch, source.weights),
                                                 prompts, stop_ids, draft)
    assert [replies[i] for i in range(len(prompts))] == want
    # each round accepts the drafted tokens up to the first wrong one, plus the bonus
    longest = fidelity.REPLY_TOKENS
    assert rounds == {0: 1, 5: -(-longest // 5), 1: longest}[wrong_every]


def test_a_draft_of_nothing_still_finishes_in_reply_tokens_rounds(greedy):
    source, prompts, stop_ids, want = greedy
    replies, rounds = fidelity.reference_replies(Reference(source.arch, source.weights),
                                                 prompts, stop_ids, lambda ids, n: [])
    assert [replies[i] for i in range(len(prompts))] == want
    assert rounds == fidelity.REPLY_TOKENS


def one_round(monkeypatch):
    """A budget of one round (a second per clock reading, 1.5 s allowed)."""
    clock = iter(range(100))
    monkeypatch.setattr(fidelity, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    return 1.5


def test_a_time_budget_leaves_the_unfinished_replies_out(greedy, monkeypatch):
    source, prompts, stop_ids, want = greedy
    vocab = source.arch.vocab_size
    right, wrong = drafter_from(want, prompts, 0, vocab), drafter_from(want, prompts, 1, vocab)

    def draft(ids, n):  # right on the first prompt only
        return (right if ids[:len(prompts[0])] == prompts[0] else wrong)(ids, n)

    replies, rounds = fidelity.reference_replies(Reference(source.arch, source.weights),
                                                 prompts, stop_ids, draft,
                                                 seconds=one_round(monkeypatch))
    assert replies == {0: want[0]} and rounds == 1


def test_the_fidelity_gate_of_a_faithful_artifact_takes_one_reference_round(
        tiny_checkpoint, tiny_fp32):
    # the fp32 graphs compute the reference model: its drafts are the reference's replies
    gate = fidelity.measure(load_source(str(tiny_checkpoint)), tiny_fp32, 512)
    assert gate["questions"] == len(fidelity.questions()) and gate["reference_rounds"] == 1
    assert "left_out" not in gate and gate["first16_equal"] == gate["questions"]


def test_a_fidelity_gate_with_a_budget_measures_the_questions_it_affords(
        tiny_checkpoint, tiny_fp32, monkeypatch):
    # each clock reading a second later: the first reply "takes" a second, a question four
    clock = iter(range(1000))
    monkeypatch.setattr(fidelity, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    gate = fidelity.measure(load_source(str(tiny_checkpoint)), tiny_fp32, 512, seconds=20)
    assert gate["questions"] == 5
    assert gate["left_out"] == len(fidelity.questions()) - 5


def test_a_fidelity_gate_cut_before_any_reply_is_finished_says_so(
        tiny_checkpoint, tiny_int4, monkeypatch):
    # the int4 artifact's drafts go astray within 48 tokens on every question
    gate = fidelity.measure(load_source(str(tiny_checkpoint)), tiny_int4, 512,
                            seconds=one_round(monkeypatch))
    assert gate["questions"] == 0 and gate["left_out"] == len(fidelity.questions())
