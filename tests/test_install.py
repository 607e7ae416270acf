"""hpmoe installs beside the torch a user already has, without a network: into an
environment whose torch is another release (2.11.0 here, as on a GPU machine), pip
takes the checkout with ``--no-build-isolation --no-index`` and neither replaces that
torch nor downloads anything, and the build prints no deprecation warning."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _env_with_torch(where: Path, version: str) -> Path:
    """A venv holding this environment's packages (pip, setuptools, torch, numpy, as
    links) but not hpmoe, whose torch's metadata says ``version``; its python."""
    venv.create(where, with_pip=False)
    python = where / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for entry in Path(sysconfig.get_path("purelib")).iterdir():
        if not entry.name.startswith(("torch-", "hpmoe", "__editable__")):
            (site / entry.name).symlink_to(entry)
    meta = site / f"torch-{version}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    (meta / "RECORD").write_text("")
    return python


def _checkout(where: Path) -> None:
    for name in ("hpmoe", "pyproject.toml", "README.md"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, where / name)


@pytest.mark.parametrize("no_deps", [True, False], ids=["no-deps", "deps-checked-offline"])
def test_installs_offline_beside_another_torch_without_replacing_it(tmp_path: Path, no_deps: bool) -> None:
    python = _env_with_torch(tmp_path / "env", "2.11.0")
    src = tmp_path / "src"
    src.mkdir()
    _checkout(src)
    argv = [python, "-m", "pip", "install", "-v", "--no-index", "--no-build-isolation", "-e", str(src)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}  # no wheel folder, no pip.conf
    proc = subprocess.run(argv + (["--no-deps"] if no_deps else []), capture_output=True, text=True,
                          timeout=300, env={**env, "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "deprecat" not in (proc.stdout + proc.stderr).lower(), proc.stderr[-3000:]
    probe = "import hpmoe, importlib.metadata as m; print(hpmoe.__file__); print(m.version('torch'))"
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120, check=True,
                         cwd=tmp_path).stdout.split()
    assert out == [str(src / "hpmoe" / "__init__.py"), "2.11.0"]
