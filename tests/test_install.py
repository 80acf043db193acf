"""Installing the checkout gives one import namespace, ``kvspec``, and nothing named ``model``.

DESIGN.md: ``kvspec.model``, ``kvspec.impl`` and ``kvspec.specs`` are mapped onto the
top-level folders through setuptools ``package-dir``; nothing named ``model`` or
``impl`` lands at the top of site-packages. This test builds a wheel of a copy of
the working tree (offline: no index, no build isolation, the running interpreter's
setuptools), installs it with ``--no-deps`` into a fresh virtual environment that
reuses the base interpreter's site packages (so nothing is downloaded), and imports
from a directory outside the checkout. It is part of the default run and takes a
few seconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IGNORED = shutil.ignore_patterns(".venv", ".vllm-venv", ".git", "*.egg-info", "build", "dist", "__pycache__",
                                 ".hypothesis", "out", ".pytest_cache", ".ruff_cache")


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.deep  # builds a wheel and a venv: seconds of CPU for one packaging check
def test_fresh_venv_imports_kvspec_model_not_model(tmp_path: Path) -> None:
    src, wheels, venv, elsewhere = (tmp_path / d for d in ("src", "wheels", "venv", "elsewhere"))
    shutil.copytree(ROOT, src, ignore=IGNORED)
    elsewhere.mkdir()
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                  "-w", str(wheels), str(src)], tmp_path)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("kvspec-*.whl")
    made = _run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], tmp_path)
    assert made.returncode == 0, made.stderr
    py = venv / "bin" / "python"
    installed = _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], tmp_path)
    assert installed.returncode == 0, installed.stdout + installed.stderr

    # kvspec.impl and kvspec.specs need torch and z3, which the base interpreter may lack:
    # they are checked as installed files below, kvspec.model by importing it
    ok = _run([str(py), "-c", "import kvspec.model, kvspec.drivers.engine, kvspec.contract; "
               "print(kvspec.model.__file__)"], elsewhere)
    assert ok.returncode == 0, ok.stderr
    where = Path(ok.stdout.strip())
    assert venv in where.parents and ROOT not in where.parents
    assert where.parent.name == "model" and where.parent.parent.name == "kvspec"

    for top in ("model", "impl", "specs"):
        bad = _run([str(py), "-c", f"import {top}"], elsewhere)
        assert bad.returncode != 0
        assert f"ModuleNotFoundError: No module named '{top}'" in bad.stderr

    (site,) = (venv / "lib").glob("python3*/site-packages")
    for sub in ("model", "impl", "specs"):
        assert (site / "kvspec" / sub / "__init__.py").is_file()
    tops = {p.name for p in site.iterdir() if p.name != "__pycache__"}
    assert tops == {"kvspec", wheel.name.split("-py")[0] + ".dist-info"}
