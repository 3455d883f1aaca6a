"""`edgespec.load` refuses a missing, truncated, edited or foreign artifact, naming the file."""
import hashlib
import io
import json
import shutil

import numpy as np
import pytest
from helpers import one_error_line, rewrite_artifact_file, run_cli

import edgespec
from edgespec.artifact import FORMAT_VERSION
from edgespec.errors import EdgespecError


@pytest.fixture
def artifact_copy(tiny_int4, tmp_path):
    return shutil.copytree(tiny_int4, tmp_path / "copy")


def test_a_missing_artifact_directory_is_named(tmp_path):
    with pytest.raises(EdgespecError, match="does not exist.*edgespec export"):
        edgespec.load(tmp_path / "nothing")


def test_a_missing_file_is_named(artifact_copy):
    (artifact_copy / "upper.onnx").unlink()
    with pytest.raises(EdgespecError, match="upper.onnx is missing"):
        edgespec.load(artifact_copy)


def test_a_truncated_file_is_named(artifact_copy):
    data = artifact_copy / "lower.data"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(EdgespecError, match="lower.data has .* bytes.*truncated"):
        edgespec.load(artifact_copy, verify=False)  # sizes are checked even without hashing


def test_an_edited_file_is_named(artifact_copy):
    data = artifact_copy / "upper.data"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(EdgespecError, match="upper.data does not match its sha256"):
        edgespec.load(artifact_copy)


def test_a_corrupt_manifest_is_named(artifact_copy):
    (artifact_copy / "manifest.json").write_text("{not json")
    with pytest.raises(EdgespecError, match="manifest.json is corrupt"):
        edgespec.load(artifact_copy)


def test_another_format_version_is_refused(artifact_copy):
    manifest = json.loads((artifact_copy / "manifest.json").read_text())
    manifest["format_version"] = 99
    (artifact_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EdgespecError, match="format version 99.*export the model again"):
        edgespec.load(artifact_copy)


def test_a_format_version_that_is_not_an_integer_says_which_integer(artifact_copy):
    edit_manifest(artifact_copy, lambda m: m.update(format_version="2"))
    with pytest.raises(EdgespecError,
                       match=f'format_version is "2"; it must be the integer {FORMAT_VERSION}'):
        edgespec.load(artifact_copy)


def test_the_cli_reports_a_bad_artifact_in_one_line_and_exits_non_zero(artifact_copy):
    (artifact_copy / "head.onnx").unlink()
    result = run_cli("generate", artifact_copy, "-p", "hi")
    assert result.returncode == 2
    assert "head.onnx is missing" in one_error_line(result.stderr)


def test_debug_shows_the_traceback(artifact_copy):
    (artifact_copy / "head.onnx").unlink()
    result = run_cli("generate", artifact_copy, "-p", "hi", "--debug")
    assert result.returncode != 0 and "Traceback" in result.stderr


def edit_manifest(artifact, edit):
    path = artifact / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


# -- every file the runtime reads is listed, and inside the artifact -------------------------

@pytest.mark.parametrize("name", ["lower.onnx", "upper.data", "head.onnx", "tokenizer.json",
                                  "tokenizer_config.json", "chat_template.jinja"])
def test_a_required_file_the_manifest_does_not_list_is_named(artifact_copy, name):
    edit_manifest(artifact_copy, lambda m: m["files"].pop(name))
    with pytest.raises(EdgespecError, match=f"manifest.json does not list {name}"):
        edgespec.load(artifact_copy)


def test_a_draft_graph_needs_its_data_and_vocabulary(artifact_copy):
    rewrite_artifact_file(artifact_copy, "draft.onnx", (artifact_copy / "head.onnx").read_bytes())
    with pytest.raises(EdgespecError, match="does not list draft.data"):
        edgespec.load(artifact_copy)


@pytest.mark.parametrize("name", ["../outside.bin", "{outside}", "sub/x.bin", "..", ""],
                         ids=["parent", "absolute", "subfolder", "dot-dot", "empty"])
def test_a_file_name_that_is_not_a_plain_name_in_the_artifact_is_refused(artifact_copy, name):
    # the file exists, with the size and hash the manifest gives: only its name is wrong
    data = b"outside the artifact"
    outside = artifact_copy.parent / "outside.bin"
    outside.write_bytes(data)
    name = name.format(outside=outside)
    info = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    edit_manifest(artifact_copy, lambda m: m["files"].update({name: info}))
    with pytest.raises(EdgespecError, match="file name .* plain name"):
        edgespec.load(artifact_copy)


@pytest.mark.parametrize("verify", [True, False])
def test_a_file_that_is_a_symbolic_link_is_refused(artifact_copy, verify):
    # the link's target has the size and hash the manifest gives: only the link is wrong
    outside = artifact_copy.parent / "elsewhere.jinja"
    rewrite_artifact_file(artifact_copy, "chat_template.jinja", b"{{ messages }}")
    (artifact_copy / "chat_template.jinja").rename(outside)
    (artifact_copy / "chat_template.jinja").symlink_to(outside)
    with pytest.raises(EdgespecError, match=f"chat_template.jinja is a symbolic link \\(to "
                                            f"{outside}\\).*plain files inside it"):
        edgespec.load(artifact_copy, verify=verify)


# -- the manifest's fields: checked on open, one line naming the field -----------------------

DELETE = object()
FIELD_CASES = [
    ("max_context", DELETE), ("architecture", DELETE), ("architecture.hidden_size", DELETE),
    ("eos_token_ids", DELETE), ("exit_layer", DELETE), ("chat_template", DELETE),
    ("files", DELETE), ("max_context", "512"), ("max_context", 0), ("max_context", 10**12),
    ("architecture.head_dim", 65), ("format_version", DELETE),
    ("architecture.num_kv_heads", 2.5), ("architecture.vocab_size", True),
    ("exit_layer", 4), ("eos_token_ids", 2), ("eos_token_ids", [10**6]),
    ("activation_dtype", "bfloat16"), ("device", "tpu"), ("draft", []), ("draft.k", "4"),
    ("draft.adaptive", "yes"), ("files.head.data", {"bytes": "256"}),
    ("files.head.data", {"bytes": 256, "sha256": 5}), ("chat_template", "missing.jinja"),
    ("round_costs", [1.0, 1.2]), ("round_costs", {"2": 1.2}), ("round_costs", {"1": 0}),
    ("round_costs", {"1": 1.0, "two": 1.2}), ("round_costs", {"1": 1.0, "2": "1.2"}),
    ("batch_round_costs", {"3": {"3": 1.5}}), ("batch_round_costs", {"2": {"2": 0}}),
    ("batch_round_costs", {"2": {}}), ("batch_round_costs", [1.5]),
    ("sampling", [0.8]), ("sampling", {"temperature": -1}), ("sampling", {"beams": 2}),
    ("residual_dtype", "bfloat16"),
]


def set_field(manifest, dotted, value):
    *parents, last = dotted.split(".")
    for key in parents:
        manifest = manifest[key]
    if value is DELETE:
        del manifest[last]
    else:
        manifest[last] = value


@pytest.mark.parametrize("field, value", FIELD_CASES, ids=[
    f"no {f}" if v is DELETE else f"{f}={v!r}" for f, v in FIELD_CASES])
def test_a_manifest_field_missing_or_of_the_wrong_kind_is_named(artifact_copy, field, value):
    def edit(manifest):
        if field.startswith("files."):  # file names hold dots
            manifest["files"][field[len("files."):]] = value
        else:
            set_field(manifest, field, value)
    edit_manifest(artifact_copy, edit)
    shown = field[len("files."):] if field.startswith("files.") else field
    with pytest.raises(EdgespecError, match=f"manifest.json.*{shown}"):
        edgespec.load(artifact_copy, verify=False)


def test_a_max_context_too_large_says_the_bound_and_what_to_do(artifact_copy):
    edit_manifest(artifact_copy, lambda m: m.update(max_context=10**12))
    with pytest.raises(EdgespecError, match="max_context is 1000000000000; it must be an "
                                            "integer in 2..1048576 .*smaller --max-context"):
        edgespec.load(artifact_copy)


@pytest.mark.parametrize("field, value, tensor", [
    ("head_dim", 18, "lower.onnx's past_key.0 has 16"),
    ("num_kv_heads", 1, "lower.onnx's past_key.0 has 2"),
    ("hidden_size", 96, "upper.onnx's exit_hidden has 64"),
    ("vocab_size", 400, "head.onnx's logits has 364"),
    ("num_layers", 6, "upper.onnx should hold 3 layers, but it holds 1"),
])
def test_architecture_numbers_the_graphs_disagree_with_are_named(artifact_copy, field, value,
                                                                  tensor):
    edit_manifest(artifact_copy, lambda m: m["architecture"].update({field: value}))
    with pytest.raises(EdgespecError, match=f"manifest.json says .*{field} is {value}.*{tensor}"):
        edgespec.load(artifact_copy, verify=False)


def test_a_tokenizer_config_that_is_not_an_object_is_named(artifact_copy):
    rewrite_artifact_file(artifact_copy, "tokenizer_config.json", b"[1]")
    with pytest.raises(EdgespecError, match=r"tokenizer_config.json holds \[1\]; it must be a "
                                            "JSON object"):
        edgespec.load(artifact_copy)


def test_the_cli_names_a_missing_manifest_field_in_one_line(artifact_copy):
    edit_manifest(artifact_copy, lambda m: m.pop("max_context"))
    result = run_cli("generate", artifact_copy, "-p", "hi")
    assert result.returncode == 2
    assert "manifest.json has no max_context" in one_error_line(result.stderr)


# -- files whose bytes only the sha256 would catch, read without it (--no-verify) ------------

def corrupt_in_place(path):
    """Same size, other bytes: only the sha256 check would see it."""
    path.write_bytes(b"\xff" * path.stat().st_size)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json",
                                  "chat_template.jinja"])
def test_a_corrupt_text_file_is_named_without_verification(artifact_copy, name):
    corrupt_in_place(artifact_copy / name)
    with pytest.raises(EdgespecError, match=f"{name}.*export the model again"):
        edgespec.load(artifact_copy, verify=False)


def save_draft_vocab(artifact, ids):
    buffer = io.BytesIO()
    np.save(buffer, ids)
    rewrite_artifact_file(artifact, "draft_vocab.npy", buffer.getvalue())


@pytest.mark.parametrize("ids, problem", [
    (np.array([0, 5, 364]), "ids in 0..363"), (np.array([-1, 5]), "ids in 0..363"),
    (np.array([0.5, 2.0]), "integer"), (np.zeros((2, 2), np.int64), "one row"),
    (np.array([], np.int64), "empty"),
], ids=["an id past the vocabulary", "a negative id", "floats", "two rows", "empty"])
def test_a_draft_vocabulary_the_head_cannot_use_is_refused(artifact_copy, ids, problem):
    save_draft_vocab(artifact_copy, ids)
    with pytest.raises(EdgespecError, match=f"draft_vocab.npy.*{problem}"):
        edgespec.load(artifact_copy, verify=False)


def test_a_corrupt_draft_vocabulary_is_named_without_verification(artifact_copy):
    save_draft_vocab(artifact_copy, np.arange(10))
    corrupt_in_place(artifact_copy / "draft_vocab.npy")
    with pytest.raises(EdgespecError, match="draft_vocab.npy is not a readable"):
        edgespec.load(artifact_copy, verify=False)
