"""The threads a runtime asks for are the ones its sessions run on; round costs are measured
at them: export records its count, and a runtime with another count measures them again,
once."""
import json
import shutil
import subprocess
import sys

import pytest
from helpers import run_cli

# the OS threads a load starts: the pool's workers, the thread that runs a session its last one
POOL_WORKERS = """import os, sys
import edgespec
before = len(os.listdir("/proc/self/task"))
model = edgespec.load(sys.argv[1], threads=int(sys.argv[2]))
print(len(os.listdir("/proc/self/task")) - before, model.engine.threads)"""


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


@pytest.mark.parametrize("threads", [1, 3])
def test_the_sessions_share_one_pool_of_the_threads_asked(tiny_int4, tmp_path, threads):
    # a process of its own: the pool is made once per process; a copy: the load measures the
    # round costs at this count and keeps them beside the artifact
    artifact = shutil.copytree(tiny_int4, tmp_path / "copy")
    done = subprocess.run([sys.executable, "-c", POOL_WORKERS, str(artifact), str(threads)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(threads - 1), str(threads)]


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
