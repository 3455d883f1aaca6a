"""Round costs measured at the threads the artifact runs with: export records its count, and
a runtime with another count measures them again, once."""
import json

import pytest
from helpers import run_cli


@pytest.fixture(scope="module")
def exported(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint exported at 1 and at 4 threads (each export its own process: the
    thread pool is made once per process)."""
    out = tmp_path_factory.mktemp("threads")
    paths = {}
    for threads in (1, 4):
        paths[threads] = out / f"at-{threads}"
        done = run_cli("export", tiny_checkpoint, "-o", paths[threads], "--threads", threads,
                       "--no-calibrate", "--exit-layer", "2", "--no-gptq")
        assert done.returncode == 0, done.stderr
        assert f"plain steps, {threads} threads" in done.stderr
    return paths


def manifest(path):
    return json.loads((path / "manifest.json").read_text())


def test_export_records_the_threads_its_round_costs_were_measured_at(exported):
    # (costs measured twice differ by noise alone, so their values prove nothing here)
    one, four = manifest(exported[1]), manifest(exported[4])
    assert (one["threads"], four["threads"]) == (1, 4)
    assert one["round_costs"] and one["batch_round_costs"]


def test_a_runtime_at_another_count_measures_the_costs_again_once(exported):
    ask = ("generate", exported[1], "-p", "hi", "--max-new-tokens", "2", "--threads", "2")
    first = run_cli(*ask)
    assert first.returncode == 0, first.stderr
    assert "measured at 1 threads and this runtime uses 2; measuring them at 2" in first.stderr
    kept = json.loads((exported[1] / "round_costs.2-threads.json").read_text())
    assert kept["threads"] == 2 and set(kept["round_costs"]) == set(
        manifest(exported[1])["round_costs"])
    again = run_cli(*ask)
    assert again.returncode == 0 and "measuring" not in again.stderr  # kept from the first
    same = run_cli("generate", exported[4], "-p", "hi", "--max-new-tokens", "2",
                   "--threads", "4")
    assert same.returncode == 0 and "measuring" not in same.stderr
