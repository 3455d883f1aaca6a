"""The check of `--device cuda` exports against ONNX Runtime's CUDA kernels (export/cuda_ops.py):
what export writes for each family passes it, and the combinations the CUDA kernels refuse or
read wrongly fail it. The check reads graphs only; no test here needs a GPU."""
import onnx
import pytest
from gguf import GGMLQuantizationType as T
from gguf_files import make_gguf
from helpers import make_checkpoint, quiet

from edgespec.errors import EdgespecError
from edgespec.export.cuda_ops import check_cuda_artifact, check_cuda_graph, needed_release
from edgespec.export.pipeline import export_model

FAMILIES = {"mistral": {"sliding_window": 16}, "qwen2": {}, "gemma3": {}}  # llama: tiny_checkpoint


def cuda_artifact(checkpoint, out):
    export_model(str(checkpoint), out, device="cuda", exit_layer=1, gptq=False, log=quiet)
    return out


@pytest.fixture(scope="module")
def tiny_cuda(tiny_checkpoint, tmp_path_factory):
    return cuda_artifact(tiny_checkpoint, tmp_path_factory.mktemp("cuda-tiny") / "artifact")


@pytest.fixture(scope="module", params=["llama", *FAMILIES])
def cuda_export(request, tmp_path_factory):
    """(family, artifact) of a tiny random model exported with --device cuda."""
    if request.param == "llama":
        return "llama", request.getfixturevalue("tiny_cuda")
    path = tmp_path_factory.mktemp(f"cuda-{request.param}")
    checkpoint = make_checkpoint(path / "checkpoint", arch=request.param, layers=2,
                                 **FAMILIES[request.param])
    return request.param, cuda_artifact(checkpoint, path / "artifact")


def test_every_familys_cuda_export_runs_on_cuda_kernels(cuda_export):
    _, artifact = cuda_export
    checks = check_cuda_artifact(artifact)
    assert {c.graph for c in checks} >= {"lower", "upper", "head", "lower_x8", "upper_x8"}
    for check in checks:
        assert check.problems == [], check.graph
        # a batch graph's per-slot total length, read by GroupQueryAttention from CPU memory
        slots = int(check.graph.partition("_x")[2] or 1)
        kept = [n for n in check.on_cpu if n.endswith("(Gather)")]
        assert len(check.on_cpu) == len(kept) == (slots if slots > 1 else 0), check.on_cpu


def test_a_qwen2_export_needs_the_first_release_whose_cuda_matmulnbits_takes_a_bias(cuda_export):
    family, artifact = cuda_export
    release, what = needed_release(check_cuda_artifact(artifact))
    if family == "qwen2":  # q, k and v biases ride on the MatMulNBits
        assert (release, what) == ("1.28", "MatMulNBits with a bias")
    else:  # the int4/int8 vocabulary table is looked up by GatherBlockQuantized
        assert (release, what) == ("1.23", "GatherBlockQuantized")


def test_matmulnbits_at_bits_cuda_has_no_kernel_for_is_refused(tiny_cuda):
    model = onnx.load(tiny_cuda / "upper.onnx", load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    next(a for a in node.attribute if a.name == "bits").i = 3
    assert check_cuda_graph(model).problems == [
        f"node {node.name} (MatMulNBits): bits 3; CUDA's MatMulNBits takes 2, 4 or 8"]


def test_a_cpu_exports_float_attention_is_refused(tiny_int4):
    problems = check_cuda_graph(tiny_int4 / "lower.onnx").problems
    assert problems and all("(GroupQueryAttention): input query is float; its CUDA kernels "
                            "take bfloat16, float16" in p for p in problems)


def test_a_table_with_4_bit_zero_points_in_rows_of_odd_blocks_is_refused_in_one_line(tmp_path):
    # Qwen2's Q4_1 table at hidden 64: 2 blocks of codes and 1 of residual minima a row; CUDA's
    # GatherBlockQuantized would read every other row's zero points from the wrong row
    checkpoint = make_checkpoint(tmp_path / "ckpt", arch="qwen2", layers=2, tie=True)
    path = make_gguf(checkpoint, tmp_path / "m.gguf", T.Q4_1)
    with pytest.raises(EdgespecError) as refused:
        export_model(str(path), tmp_path / "art", device="cuda", exit_layer=1, log=quiet)
    message = str(refused.value)
    assert "\n" not in message and "(GatherBlockQuantized): 4-bit zero points of rows of 3 " \
        "blocks" in message and "--int4-scheme zp" in message
    assert not (tmp_path / "art").exists()  # no half-written artifact
    export_model(str(path), tmp_path / "zp", device="cuda", exit_layer=1, int4_scheme="zp",
                 gptq=False, log=quiet)  # what the message says to do passes


@pytest.mark.models
def test_qwen2_5_coder_0_5bs_cuda_export_runs_on_cuda_kernels(tmp_path):
    from test_models import MODELS, source_file
    name = "qwen2.5-coder-0.5b"
    export_model(str(source_file(name)), tmp_path / "art", device="cuda",
                 exit_layer=MODELS[name][3], max_context=1024, log=quiet)
    checks = check_cuda_artifact(tmp_path / "art")
    assert {c.graph for c in checks} >= {"lower", "upper", "head"}
    assert all(c.problems == [] for c in checks)
    assert needed_release(checks) == ("1.28", "MatMulNBits with a bias")
