"""`edgespec.load` refuses a missing, truncated, edited or foreign artifact, naming the file."""
import json
import shutil

import pytest
from helpers import one_error_line, run_cli

import edgespec
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


def test_the_cli_reports_a_bad_artifact_in_one_line_and_exits_non_zero(artifact_copy):
    (artifact_copy / "head.onnx").unlink()
    result = run_cli("generate", artifact_copy, "-p", "hi")
    assert result.returncode == 2
    assert "head.onnx is missing" in one_error_line(result.stderr)


def test_debug_shows_the_traceback(artifact_copy):
    (artifact_copy / "head.onnx").unlink()
    result = run_cli("generate", artifact_copy, "-p", "hi", "--debug")
    assert result.returncode != 0 and "Traceback" in result.stderr
