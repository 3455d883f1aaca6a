"""The CUDA path on a machine without CUDA: what cannot run there is refused or skipped in one
line, before any work, and nothing runs on the CPU in CUDA's place without a word.

ONNX Runtime here has no CUDA provider, so a CUDA session is the real one failing to find its
kernels; where a GPU is needed past that, the engine's device is set to "cuda" on a CPU
engine (the device faked, the code that checks it real)."""
import json

import pytest
from helpers import quiet

import edgespec
from edgespec import bench
from edgespec.apps.server.capacity import check_parallel
from edgespec.engine import CUDA, batch_round_costs, open_session
from edgespec.errors import EdgespecError
from edgespec.export.pipeline import export_model
from edgespec.settings import Settings


@pytest.fixture(scope="module")
def tiny_cuda(tiny_checkpoint, tmp_path_factory):
    """The tiny model exported for CUDA (float16 graphs), and what export said."""
    out, lines = tmp_path_factory.mktemp("cuda") / "tiny-cuda", []
    export_model(str(tiny_checkpoint), out, device="cuda", calibrate=True, log=lines.append)
    return out, lines


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_cuda_artifact_without_cuda_is_refused_not_run_on_the_cpu(tiny_cuda):
    path, _ = tiny_cuda
    with pytest.raises(EdgespecError) as error:
        edgespec.load(path)
    assert "exported for CUDA, and this onnxruntime has no CUDA provider" in one_line(error)
    assert "device cpu" in one_line(error)
    assert edgespec.load(path, device="cpu").engine.device == "cpu"  # asked for: it runs


def test_a_cpu_artifact_asked_to_run_on_cuda_is_refused(tiny_int4):
    with pytest.raises(EdgespecError) as error:
        edgespec.load(tiny_int4, device="cuda")
    assert "exported for the CPU" in one_line(error)
    assert "--device cuda" in one_line(error)


def test_a_cuda_session_refuses_nodes_without_a_cuda_kernel(tiny_cuda):
    # no CUDA kernel exists here at all: every node would fall back to the CPU
    path, _ = tiny_cuda
    with pytest.raises(EdgespecError) as error:
        open_session(str(path / "head.onnx"), "head.onnx", CUDA, 1)
    assert "head.onnx has nodes with no CUDAExecutionProvider kernel" in one_line(error)


def test_a_cuda_export_without_cuda_skips_what_runs_the_artifact(tiny_cuda):
    path, lines = tiny_cuda
    manifest = json.loads((path / "manifest.json").read_text())
    skipped = [line for line in lines if "so they are skipped" in line]
    assert len(skipped) == 1 and "no CUDA provider" in skipped[0]
    assert manifest["device"] == "cuda" and manifest["draft"]["adaptive"]
    for measured in ("quality", "fidelity", "round_costs", "batch_round_costs"):
        assert measured not in manifest
    assert "quality and fidelity: not measured" in lines[-1]


@pytest.mark.parametrize("option", [{"adapter": "train"}, {"shortlist": 256}])
def test_a_cuda_export_that_must_run_the_artifact_is_refused_before_building(
        tiny_checkpoint, tmp_path, option):
    out = tmp_path / "refused"
    with pytest.raises(EdgespecError) as error:
        export_model(str(tiny_checkpoint), out, device="cuda", log=quiet, **option)
    assert "run the artifact to make its draft" in one_line(error)
    assert not out.exists() and not out.with_name("refused.partial").exists()


@pytest.fixture
def on_gpu(tiny_int4):
    """A model whose engine says it runs on CUDA."""
    model = edgespec.load(tiny_int4)
    model.engine.device = "cuda"
    return model


def test_several_replies_at_once_are_refused_up_front_on_cuda(on_gpu):
    for start in (lambda: on_gpu.generate_many(["a", "b"], parallel=2),
                  lambda: on_gpu.batch(4),
                  lambda: check_parallel(4, on_gpu.engine, None),
                  lambda: on_gpu.engine.forward([])):
        with pytest.raises(EdgespecError) as error:
            start()
        assert "runs on the CPU provider only" in one_line(error)


def test_bench_parallel_is_refused_before_decoding_on_cuda(on_gpu):
    rows = [{"prompt": "hello", "category": "chat"}]
    with pytest.raises(EdgespecError, match="CPU provider only"):
        bench.run_parallel(on_gpu, rows, Settings(), [4])
    assert on_gpu.sequence.lower_len == 0  # not even the warm-up ran


def test_batch_round_costs_are_not_measured_on_cuda(on_gpu):
    assert batch_round_costs(on_gpu.engine) == {}


@pytest.mark.parametrize("policy", [{"draft_k": 3, "lookup_k": 0, "draft_threshold": 0.1},
                                    {"draft_k": 0, "lookup_k": 8}], ids=["exit", "lookup"])
@pytest.mark.parametrize("sampling, most", [({"temperature": 0}, 256),
                                            ({"temperature": 0.9, "top_k": 5}, 512)],
                         ids=["greedy", "top-k"])
def test_a_round_reads_a_few_candidates_not_logits_from_a_cuda_head(tiny_cuda, policy,
                                                                     sampling, most):
    # most: host-bound bytes per committed token (the logits are 1 KB a row here)
    path, _ = tiny_cuda
    model = edgespec.load(path, device="cpu")  # the CUDA graphs, run here on the CPU
    model.stop_ids, engine = set(), model.engine
    prompt, new = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], 40
    a_row = engine.vocab_size * engine.dtype(0).itemsize  # prefill's, once a reply
    accepted = 0
    for seed in range(3):
        replies = {}
        for mode, options in (("plain", {}), ("speculative", {"adaptive": False, **policy})):
            before = engine.host_bytes
            replies[mode] = model.generate_ids(prompt, new, mode=mode, seed=seed, **sampling,
                                               **options)
            per_token = (engine.host_bytes - before - a_row) / new
            assert per_token <= most, (mode, per_token)
        assert replies["speculative"].tokens == replies["plain"].tokens
        accepted += replies["speculative"].stats.accepted
    assert accepted > 0


def test_settings_that_read_the_whole_row_still_copy_it(tiny_cuda):
    path, _ = tiny_cuda
    model = edgespec.load(path, device="cpu")
    engine, new = model.engine, 20
    a_row = engine.vocab_size * engine.dtype(0).itemsize
    for options in ({"temperature": 0.9, "top_k": 0}, {"temperature": 0, "repetition_penalty": 1.2}):
        before = engine.host_bytes
        model.generate_ids([5, 6, 7], new, mode="plain", ignore_eos=True, **options)
        assert engine.host_bytes - before >= new * a_row
