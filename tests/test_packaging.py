"""The wheel built from the checkout is the whole package: every tracked file under picofx/ is in it,
nothing else sits beside picofx at the top level, and from the wheel's files alone (not the
checkout, not the editable install) every module imports and the `picofx` command runs."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import picofx

ROOT = Path(__file__).resolve().parents[1]


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to know the source tree's files")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return [name for name in out.split("\0") if name]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the tracked files, as a fresh clone has them (a build/ folder
    left in the checkout by an earlier build could otherwise smuggle stale modules in)."""
    source, dist = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    for name in tracked_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(dist)], check=True, timeout=300)
    [built] = dist.glob("picofx-*.whl")
    return built


@pytest.fixture(scope="module")
def unpacked(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("unpacked")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    return target


def run_from_wheel(unpacked: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """Python with the unpacked wheel first on its path, started outside the checkout."""
    env = {"PYTHONPATH": str(unpacked), "PATH": "/usr/bin:/bin", "PICOFX_CACHE": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_wheel_holds_every_tracked_file_under_picofx(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in tracked_files() if name.startswith("picofx/") and name not in names]
    assert not missing, f"the wheel leaves out {missing}: is its package in pyproject's package discovery?"


def test_the_wheel_has_no_top_level_package_beside_picofx(wheel):
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"picofx", f"picofx-{picofx.__version__}.dist-info"}, tops


def test_every_module_imports_from_the_wheel_alone(unpacked, tmp_path):
    script = (
        "import importlib, pkgutil, picofx\n"
        f"assert picofx.__file__.startswith({str(unpacked)!r}), picofx.__file__\n"
        "names = [m.name for m in pkgutil.walk_packages(picofx.__path__, 'picofx.') if m.name != 'picofx.__main__']\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(len(names))\n")
    done = run_from_wheel(unpacked, tmp_path, "-c", script)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) > 50  # every sub-package walked, not only the top


def test_python_m_picofx_answers_from_the_wheel(unpacked, tmp_path):
    version = run_from_wheel(unpacked, tmp_path, "-m", "picofx", "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip().startswith(f"picofx {picofx.__version__} (torch ")
