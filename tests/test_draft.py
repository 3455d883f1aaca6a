"""The draft graph: an exit adapter and a shortlisted head, exported from an adapter file."""
import numpy as np
import pytest
import torch
from helpers import quiet

import edgespec
from edgespec.export import calibrate
from edgespec.export.adapter import AdapterLayer, head_weights, layer_weights
from edgespec.export.pipeline import export_model
from edgespec.export.source import load_source

EXIT = 2
SHORTLIST = 64


@pytest.fixture(scope="module")
def adapter_file(tiny_checkpoint, tmp_path_factory):
    """An adapter file as `--save-adapter` writes it: layer EXIT's weights, perturbed."""
    source = load_source(str(tiny_checkpoint))
    rng = np.random.default_rng(0)
    weights = {k: w + 0.05 * rng.standard_normal(w.shape).astype(np.float32)
               for k, w in layer_weights(source.weights, EXIT).items()}
    counts = rng.integers(0, 100, source.arch.vocab_size)
    path = tmp_path_factory.mktemp("adapter") / "tiny.npz"
    calibrate.save_adapter(path, weights, EXIT, counts, {"source_sha256": source.sha256})
    return path, source, weights, counts


@pytest.fixture(scope="module", params=["fp32", "int4"])
def drafted(request, tiny_checkpoint, adapter_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("artifacts") / f"draft-{request.param}"
    export_model(str(tiny_checkpoint), out, exit_layer=EXIT, precision=request.param,
                 adapter=str(adapter_file[0]), shortlist=SHORTLIST, log=quiet)
    model = edgespec.load(out)
    model.stop_ids = set()
    return model


def reference_draft_logits(adapter_file, exit_states):
    """torch: adapter -> final norm -> lm_head on the exit states; the last row's logits."""
    path, source = adapter_file[:2]
    weights, layer, counts, _ = calibrate.load_adapter(path)
    norm, table = head_weights(source.weights, source.arch)
    with torch.no_grad():
        h = AdapterLayer(source.arch, weights)(torch.from_numpy(exit_states)[None])[0, -1]
        h = h * torch.rsqrt(h.pow(2).mean() + source.arch.rms_norm_eps) * torch.from_numpy(norm)
        logits = (torch.from_numpy(table) @ h).numpy()
    vocab = calibrate.shortlist(counts, SHORTLIST)
    return np.where(np.isin(np.arange(len(logits)), vocab), logits, -np.inf)


def test_the_adapter_file_round_trips_in_fp16(adapter_file):
    path, source, saved, saved_counts = adapter_file
    weights, layer, counts, meta = calibrate.load_adapter(path)
    assert layer == EXIT and meta["source_sha256"] == source.sha256
    np.testing.assert_array_equal(counts, saved_counts)
    assert set(weights) == set(saved)
    for name, w in saved.items():  # the values, as fp16 holds them
        assert weights[name].shape == w.shape
        np.testing.assert_allclose(weights[name], w, rtol=1e-3, atol=1e-4, err_msg=name)


def test_draft_graph_equals_the_torch_adapter_and_catches_up_after_steps(drafted, adapter_file):
    if drafted.artifact.manifest["precision"] != "fp32":
        pytest.skip("exact comparison in fp32; int4 is checked for losslessness")
    engine = drafted.engine
    seq = drafted.sequence
    engine.prefill(seq, 0, list(range(5, 25)))
    for token in (30, 31, 32):  # the adapter KV covers the prompt, then catches up 3 steps
        first = engine.draft_head(seq, seq.lower_len - 1).copy()
        want = reference_draft_logits(adapter_file, seq.exit_states.numpy()[0, :seq.lower_len])
        finite = np.isfinite(want)
        assert np.array_equal(np.isfinite(first), finite) and finite.sum() == SHORTLIST
        assert np.abs(first[finite] - want[finite]).max() < 1e-4
        engine.prefill(seq, seq.lower_len, [token])


def test_greedy_speculative_with_the_draft_graph_equals_plain(drafted):
    for seed in range(6):
        ids = [int(t) for t in np.random.default_rng(seed).integers(5, 300, 12)]
        plain = drafted.generate_ids(ids, 40, mode="plain").tokens
        spec = drafted.generate_ids(ids, 40, draft_k=3, lookup_k=2, adaptive=False)
        assert spec.tokens == plain, f"seed {seed}"
        assert spec.stats.drafters["exit"].drafted > 0


def test_the_artifact_lists_the_draft_graph_and_its_vocabulary(drafted):
    files = drafted.artifact.manifest["files"]
    assert {"draft.onnx", "draft.data", "draft_vocab.npy"} <= set(files)
    assert len(drafted.engine.draft_vocab) == SHORTLIST


def test_a_calibrated_export_measures_and_records_its_choices(tiny_checkpoint, tmp_path,
                                                              monkeypatch, capsys):
    # a small calibration: few prompts, short replies, seconds of training
    for name, value in (("TRAIN_PROMPTS", 12), ("MEASURE_PROMPTS", 2), ("TRAIN_TOKENS", 16),
                        ("MEASURE_TOKENS", 16)):
        monkeypatch.setattr(calibrate, name, value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    lines = []
    manifest = export_model(str(tiny_checkpoint), tmp_path / "auto", exit_layer="auto",
                            adapter="train", shortlist="auto", calibrate=True,
                            adapter_minutes=0.1, save_adapter=tmp_path / "kept.npz",
                            log=lines.append)
    assert any(line.startswith("calibration budget 5 min") and "exit layers 1, 2, 3, an exit "
               "adapter trained on" in line for line in lines), lines
    progress = capsys.readouterr().err  # stderr is no terminal here: bars print lines
    for phase in ("collecting generations: 100%", "training adapter (up to",
                  "plain and 4 draft policies: 100%", "plain and 5 draft policies: 100%"):
        assert phase in progress, phase
    report = manifest["draft"]["calibration"]
    assert {int(e) for e in report["exit_layers"]} == set(calibrate.candidate_exit_layers(4))
    chosen = max(report["policies"], key=lambda r: r["speedup"])["policy"]
    assert manifest["draft"]["k"] == chosen["draft_k"]
    assert all(r["identical"] for rows in report["exit_layers"].values() for r in rows)
    assert calibrate.load_adapter(tmp_path / "kept.npz")[1] == manifest["exit_layer"]
    edgespec.load(tmp_path / "auto").generate("hello", max_new_tokens=8)
