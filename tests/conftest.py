"""Shared fixtures: tiny random checkpoints and their artifacts, and the real SmolLM2 ones."""
import os
import shutil
import subprocess

import pytest
import torch
from helpers import make_checkpoint, quiet

from edgespec.export.pipeline import export_model

# torch's threads wait on each other when the cores are busy (a test's subprocesses, another
# run): on 2 busy cores a tiny int4 export took 16 s at one thread, 99 s at two. One thread,
# here and in the subprocesses (run_cli, servers), unless OMP_NUM_THREADS says otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# The fast tier, pytest -m "not slow" (make test-fast), runs in under 2 minutes on 2 cores: it
# leaves out the tests on real models (their markers, the SmolLM2 fixtures), on the 32-layer
# long_artifact or an X screen, and the files below, each ten seconds or more here (exports
# and training of their own, long chats, a browser, a wheel build).
SLOW_FIXTURES = {"smollm2_gguf", "long_artifact", "display"}
SLOW_MARKERS = {"smollm2", "models"}
SLOW_FILES = {"test_adapter.py", "test_budget.py", "test_chat.py", "test_defaults.py",
              "test_draft.py", "test_export.py", "test_gguf.py", "test_gptq.py",
              "test_gpu_check.py", "test_memory.py", "test_source_grid.py",
              "test_speculative.py", "test_threads.py", "test_web_page.py", "test_wheel.py"}


def pytest_collection_modifyitems(items):
    for item in items:
        if (SLOW_FIXTURES & set(item.fixturenames)
                or any(item.get_closest_marker(m) for m in SLOW_MARKERS)
                or item.path.name in SLOW_FILES):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_fp32(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("artifacts") / "tiny-fp32"
    export_model(str(tiny_checkpoint), out, precision="fp32", log=quiet)
    return out


@pytest.fixture(scope="session")
def tiny_int4(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("artifacts") / "tiny-int4"
    export_model(str(tiny_checkpoint), out, precision="int4", log=quiet)
    return out


@pytest.fixture(scope="session")
def long_artifact(tmp_path_factory):
    """A tiny model with room for 4000-token replies, deep enough that one takes seconds
    (lookup drafting races through a random model's loops): slow enough to cancel."""
    path = tmp_path_factory.mktemp("long")
    checkpoint = make_checkpoint(path / "ckpt", max_positions=4096, layers=32,
                                 intermediate_size=1024)
    export_model(str(checkpoint), path / "art", max_context=4096, log=quiet)
    return path / "art"


@pytest.fixture(scope="session")
def smollm2_gguf():
    from edgespec.export.source import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("artifacts") / "smollm2-fp32"
    export_model(str(smollm2_gguf), out, precision="fp32", max_context=1024, log=quiet)
    return out


@pytest.fixture(scope="session")
def smollm2_int4(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("artifacts") / "smollm2-int4"
    export_model(None, out, precision="int4", max_context=1024, log=quiet)
    return out


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf):
    """transformers' own model from the same GGUF: the numeric reference."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def display():
    """An Xvfb screen for Tk windows, one for the session (Tk keeps to the display it first
    opened; the CI installs xvfb)."""
    if shutil.which("Xvfb") is None:
        pytest.fail("Xvfb is not installed: apt-get install xvfb (make test does)")
    read, write = os.pipe()  # Xvfb picks a free display and writes its number here
    server = subprocess.Popen(["Xvfb", "-displayfd", str(write), "-screen", "0", "800x600x24",
                               "-nolisten", "tcp"], pass_fds=[write],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(write)
    with os.fdopen(read) as pipe:
        number = pipe.readline().strip()
    assert number, "Xvfb did not start"
    previous = os.environ.get("DISPLAY")
    os.environ["DISPLAY"] = f":{number}"
    yield os.environ["DISPLAY"]
    server.terminate()
    server.wait(5)
    if previous is None:
        del os.environ["DISPLAY"]
    else:
        os.environ["DISPLAY"] = previous
