"""benchmarks/gpu_check.py: without CUDA it says so in one line and exits 3; its checks, its
copy counting and its verdict, rehearsed on the CPU provider with the tiny model."""
import json
import subprocess
import sys
from collections import Counter

import numpy as np
import onnxruntime as ort
import pytest
from gguf_files import make_gguf
from onnx import TensorProto, helper

import edgespec.rounds
from benchmarks import gpu_check, host_copies
from edgespec.bench import load_prompts
from edgespec.engine import set_threads

CUDA, CPU = gpu_check.CUDA, gpu_check.CPU
ROWS = [(4, "qa", "hello world, how are you today?"), (2, "qa", "numbers 0 1 2 3"),
        (9, "code", "the quick brown fox jumps over the lazy dog"),
        (7, "math", "speculative decoding drafts and verifies")]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [t]})
                              for i, c, t in ROWS))
    return path


def run_script(*args):
    return subprocess.run([sys.executable, gpu_check.__file__, *map(str, args)],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(CUDA in ort.get_available_providers(), reason="this onnxruntime has CUDA")
def test_without_a_cuda_device_it_says_so_in_one_line_and_exits_3(tmp_path):
    result = run_script("--out", tmp_path)
    assert result.returncode == gpu_check.NO_CUDA == 3
    assert result.stdout.startswith("no CUDA device: this onnxruntime has no CUDA provider")
    assert result.stdout.count("\n") == 1 and result.stderr == ""
    assert list(tmp_path.iterdir()) == []  # nothing exported, no verdict


def test_a_cpu_rehearsal_exports_a_gguf_checks_it_and_an_artifact_and_passes(
        tiny_checkpoint, tiny_int4, prompts, tmp_path):
    gguf_path = make_gguf(tiny_checkpoint, tmp_path / "tiny.Q8_0.gguf")
    out = tmp_path / "out"
    result = run_script("--device", "cpu", gguf_path, "--artifact", tiny_int4, "--out", out,
                        "--prompts", prompts, "--max-new-tokens", 12)
    assert result.returncode == gpu_check.PASSED, result.stderr
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["verdict"] == "pass" and verdict["device"] == "cpu"
    assert [m["artifact"] for m in verdict["models"]] == [str(tiny_int4), str(out / "tiny.Q8_0")]
    assert verdict["models"][1]["source"] == str(gguf_path)
    assert json.loads((out / "tiny.Q8_0" / "manifest.json").read_text())["device"] == "cpu"
    for model in verdict["models"]:
        assert model["passed"] and model["failures"] == []
        for name in ("greedy", "sampled"):  # one prompt per category, the lowest id
            assert model[name]["identical"] == model[name]["prompts"] == 3
            assert [(r["category"], r["question_id"]) for r in model[name]["by_prompt"]] == \
                [("qa", 2), ("math", 7), ("code", 9)]
        assert model["sampled"]["sampling"].startswith("temperature 0.8")
        copies = model["copies"]
        assert copies["plain"]["runs"] == 3  # lower, upper and head once a token, prefill apart
        assert copies["plain"]["copies"] == copies["speculative"]["copies"] == 0  # no bus here
        assert {p for g in copies["graphs"].values() for p in g["nodes_by_provider"]} == {CPU}
    assert "verdict: pass" in result.stdout
    assert "int4, plain: 0.0 host-device copies per token" in result.stdout


def test_speculative_output_that_leaves_plain_fails_the_check(tiny_int4, prompts, tmp_path,
                                                              monkeypatch):
    # a verifier that accepts every draft: speculative replies leave plain ones
    monkeypatch.setattr(edgespec.rounds, "accept",
                        lambda sampler, drafts, logits, history:
                        drafts + [sampler(logits[len(drafts)], history, drafts)])
    out = tmp_path / "verdict.json"
    code = gpu_check.main(["--device", "cpu", "--artifact", str(tiny_int4), "--prompts",
                           str(prompts), "--max-new-tokens", "24", "--json", str(out)])
    assert code == gpu_check.FAILED == 1
    (model,) = json.loads(out.read_text())["models"]
    assert model["passed"] is False and model["greedy"]["different"]
    assert f"greedy: speculative differs from plain on question ids " \
           f"{', '.join(map(str, model['greedy']['different']))}" in model["failures"]


def test_an_artifact_that_does_not_load_fails_with_the_reason(prompts, tmp_path):
    out = tmp_path / "verdict.json"
    code = gpu_check.main(["--device", "cpu", "--artifact", str(tmp_path / "missing"),
                           "--prompts", str(prompts), "--json", str(out)])
    (model,) = json.loads(out.read_text())["models"]
    assert code == gpu_check.FAILED and model["failures"] == [model["failures"][0]]
    assert model["failures"][0].startswith("load: ") and "Traceback" in model["error"]


def test_the_default_prompts_are_the_first_of_each_of_13_categories():
    rows, every = gpu_check.pick_prompts(), load_prompts(gpu_check.PROMPTS)
    assert len(rows) == len({r["category"] for r in rows}) == 13
    for row in rows:
        assert row["question_id"] == min(r["question_id"] for r in every
                                         if r["category"] == row["category"])


def add_session():
    x, z, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
               for n, shape in (("x", [2, 3]), ("z", []), ("y", [2, 3])))
    graph = helper.make_graph([helper.make_node("Add", ["x", "z"], ["y"])], "add", [x, z], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    set_threads()  # the process's one pool, as the engine's sessions share it
    options = ort.SessionOptions()
    options.use_per_session_threads = False
    return ort.InferenceSession(model.SerializeToString(), options, providers=[CPU])


@pytest.mark.parametrize("device, copies", [("cuda", 3), ("cpu", 0)])
def test_every_tensor_bound_outside_the_device_is_a_copy_at_every_run(device, copies):
    session, x, y = add_session(), np.ones([2, 3], np.float32), np.zeros([2, 3], np.float32)
    methods = [vars(ort.IOBinding)["bind_ortvalue_input"], vars(ort.IOBinding)["bind_output"]]
    with host_copies.Transfers(device) as seen:  # "cuda": as if the session ran on a GPU
        binding = session.io_binding()
        binding.bind_cpu_input("x", x)
        binding.bind_ortvalue_input("z", ort.OrtValue.ortvalue_from_numpy(np.array(1, np.float32)))
        binding.bind_output("y", "cpu", 0, np.float32, [2, 3], y.ctypes.data)
        for _ in range(3):
            session.run_with_iobinding(binding)
    assert seen.totals[session] == +Counter(runs=3, to_device=2 * copies, to_host=copies,
                                            to_device_bytes=28 * copies, to_host_bytes=24 * copies)
    assert y.tolist() == [[2.0] * 3] * 2
    assert [vars(ort.IOBinding)["bind_ortvalue_input"], vars(ort.IOBinding)["bind_output"]] \
        == methods  # ONNX Runtime's own methods again


def node(name, op, provider):
    return {"cat": "Node", "name": f"{name}_kernel_time", "ph": "X",
            "args": {"op_name": op, "provider": provider}}


def test_a_profile_gives_runs_placement_and_memcpy_nodes_and_judge_fails_them(tmp_path):
    run = {"cat": "Session", "name": "model_run", "ph": "X"}
    events = [{"cat": "Session", "name": "session_initialization"}] + 2 * [
        run, node("MatMul_1", "MatMulNBits", CUDA), node("Memcpy", "MemcpyToHost", CUDA),
        node("Shape_3", "Shape", CPU)]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(events))
    profile = host_copies.read_profile(path)
    assert profile == {"runs": 2, "nodes_by_provider": {CUDA: 2, CPU: 1},
                       "memcpy_nodes": ["Memcpy (MemcpyToHost)"], "memcpy_per_run": 1.0}
    report = {"sessions": {"lower": {"providers": [CUDA, CPU], "cpu_fallback_disabled": True},
                           "upper": {"providers": [CPU], "cpu_fallback_disabled": False}},
              "copies": {"graphs": {"lower": profile}},
              "greedy": {"different": []}, "sampled": {"different": [81, 91]}}
    assert gpu_check.judge(report, "cuda") == [
        f"upper runs on {CPU}, not {CUDA}",
        "upper: ONNX Runtime's CPU fallback is not disabled",
        f"lower: nodes ran on {{'{CPU}': 1}}, not all on {CUDA}",
        "sampled: speculative differs from plain on question ids 81, 91"]
