"""Export's memory: estimated from the source's header, refused up front when it cannot fit."""
import json

import pytest
from gguf_files import make_gguf
from helpers import one_error_line, run_cli

from edgespec.export.memory import available_bytes, estimate
from edgespec.export.source import load_source


@pytest.fixture(scope="module")
def tiny_gguf(tiny_checkpoint, tmp_path_factory):
    return make_gguf(tiny_checkpoint, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_an_export_that_cannot_fit_is_refused_before_anything_is_built(tiny_gguf, tmp_path):
    out = tmp_path / "art"
    result = run_cli("export", str(tiny_gguf), "-o", str(out), "--max-memory", "0.01",
                     "--no-calibrate", "--exit-layer", "2")
    assert result.returncode == 2
    line = one_error_line(result.stderr)
    assert "this export needs about" in line and "10 MB are allowed" in line
    assert "building" not in result.stderr  # refused before the graphs
    assert not out.exists() and not out.with_name("art.partial").exists()


def test_the_estimate_is_printed_and_an_export_within_it_runs(tiny_gguf, tmp_path):
    out = tmp_path / "art"
    result = run_cli("export", str(tiny_gguf), "-o", str(out), "--max-memory", "64",
                     "--no-calibrate", "--exit-layer", "2")
    assert result.returncode == 0, result.stderr
    assert "memory: about" in result.stderr and "64.0 GB allowed" in result.stderr


def test_the_artifact_estimate_follows_the_written_artifact(smollm2_int4, smollm2_gguf):
    """The estimate's largest term is the artifact's weights: within 10% of what export
    wrote for the bundled model's own grids."""
    manifest = json.loads((smollm2_int4 / "manifest.json").read_text())
    written = sum(f["bytes"] for name, f in manifest["files"].items() if name.endswith(".data"))
    need = estimate(load_source(str(smollm2_gguf)), "int4", "source", 1024)
    assert abs(need.artifact - written) < 0.1 * written
    assert need.peak > need.artifact


def test_available_memory_is_read_from_the_system():
    assert 0 < available_bytes() < 1 << 50


def test_max_memory_must_be_a_positive_number():
    result = run_cli("export", "--max-memory", "0")
    assert result.returncode == 2 and "must be > 0" in result.stderr
