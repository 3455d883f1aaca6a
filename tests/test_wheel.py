"""The wheel: one top-level name, its data inside, and it exports and generates from a fresh
venv outside the checkout."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILT_FROM = ("pyproject.toml", "README.md", "edgespec", "export", "apps")
# the installed name of each folder whose data files must ship (all but their docs)
DATA = {"edgespec/data": "edgespec/data", "export/data": "edgespec/export/data",
        "apps/server/static": "edgespec/apps/server/static"}
# the project's dependencies, found where the running interpreter finds them
DEPENDENCIES = ("onnxruntime", "numpy", "tokenizers", "jinja2", "torch", "transformers", "gguf",
                "onnx", "tqdm", "huggingface_hub")


def run(*args, cwd, timeout=300):
    """A command with this environment minus PYTHONPATH; it must succeed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the sources: an in-place build would reuse the
    checkout's build/, where files from an older layout linger and would ship."""
    tmp = tmp_path_factory.mktemp("wheel")
    for name in BUILT_FROM:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, tmp / "src" / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            (tmp / "src").mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, tmp / "src" / name)
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
        "-q", "-w", tmp / "dist", tmp / "src", cwd=tmp)
    return next((tmp / "dist").glob("edgespec-*.whl"))


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv holding the wheel alone (--no-deps), given the project's dependencies
    by a .pth line naming their directories: a .pth line only adds a directory to sys.path
    and runs none of the .pth files in it, so the checkout's editable install stays out."""
    venv = tmp_path_factory.mktemp("venv") / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=venv.parent)
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
        "-q", wheel, cwd=venv.parent)
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
               cwd=venv.parent).stdout.strip()
    found = [str(Path(importlib.util.find_spec(name).origin).parent.parent)
             for name in DEPENDENCIES]
    lines = dict.fromkeys([sysconfig.get_paths()["purelib"], *found])
    (Path(site) / "project-dependencies.pth").write_text("\n".join(lines) + "\n")
    return venv


def test_the_wheel_holds_only_edgespec_and_its_dist_info(wheel):
    version = wheel.name.split("-")[1]
    names = zipfile.ZipFile(wheel).namelist()
    strays = [n for n in names
              if not n.startswith(("edgespec/", f"edgespec-{version}.dist-info/"))]
    assert not strays, f"files outside edgespec/: {strays}"
    top_level = zipfile.ZipFile(wheel).read(f"edgespec-{version}.dist-info/top_level.txt")
    assert top_level.decode().split() == ["edgespec"]


def test_the_wheel_ships_every_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, installed in DATA.items():
        files = [p.relative_to(ROOT / folder).as_posix() for p in (ROOT / folder).rglob("*")
                 if p.is_file() and p.suffix not in (".md", ".pyc")]
        assert files, folder
        missing = [f for f in files if f"{installed}/{f}" not in names]
        assert not missing, f"{folder}: not in the wheel: {missing}"


def test_the_installed_wheel_imports_itself_not_the_checkout(venv, tmp_path):
    code = ("import importlib.util, json, edgespec, edgespec.export.calibrate as c, "
            "edgespec.apps.server.page as page\n"
            "print(json.dumps({'files': [edgespec.__file__, c.__file__, page.__file__], "
            "'adapters': [p.name for p in c.READY.glob('*.npz')], "
            "'page': sorted(page.load_page()), "
            "'strays': [n for n in ('export', 'apps') if importlib.util.find_spec(n)]}))")
    found = json.loads(run(venv / "bin" / "python", "-c", code, cwd=tmp_path).stdout)
    for path in found["files"]:
        assert Path(path).resolve().is_relative_to(venv.resolve()), path
    assert found["adapters"] == ["smollm2-135m-instruct.npz"]
    assert "/" in found["page"] and found["strays"] == []


def test_the_installed_edgespec_exports_and_generates_outside_the_checkout(
        venv, tiny_checkpoint, tmp_path):
    edgespec = venv / "bin" / "edgespec"
    # int4 with GPTQ, quality and fidelity: the export reads each of its data files
    run(edgespec, "export", tiny_checkpoint, "-o", "tiny", "--exit-layer", "2",
        "--no-calibrate", "--max-context", "256", cwd=tmp_path)
    manifest = json.loads((tmp_path / "tiny" / "manifest.json").read_text())
    assert manifest["build"]["int4_gptq"] and "quality" in manifest
    reply = run(edgespec, "generate", "tiny", "-p", "hello", "--max-new-tokens", "8",
                "--json", cwd=tmp_path)
    assert json.loads(reply.stdout)["n_generated"] > 0
