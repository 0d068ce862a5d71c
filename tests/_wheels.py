"""Another framework's real files, taken from its wheel on the package index, never committed.

verl's, ms-swift's and LLaMA-Factory's own NPU patch code is what the integration tests run. The
wheel is downloaded with ``pip download --no-deps`` (the package's dependencies are not needed: only
the named files are extracted), each file's hash is checked, and the files are laid out under a
directory for ``PYTHONPATH``, each package above them given an empty ``__init__.py`` (the package's
real ``__init__`` would import its whole dependency chain). Where the index cannot be reached the
tests skip with the reason, except in CI (``CI=true``), where they fail.
"""

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest


def wheel(tmp_path_factory, requirement: str) -> Path:
    """The wheel of ``requirement`` (``name==version``), downloaded from the package index."""
    directory = tmp_path_factory.mktemp("wheel")
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "-d",
        directory,
    ]
    try:
        download = subprocess.run([*command, requirement], capture_output=True, text=True, timeout=300)
        failure = download.stderr.strip().splitlines()[-1:] if download.returncode else None
    except subprocess.TimeoutExpired:
        failure = ["no answer in 300 s"]
    if failure is not None:
        reason = (
            f"could not download {requirement} from the package index: {' '.join(failure) or 'pip failed'}"
        )
        if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(f"{reason} (CI=true: CI has the index and must run these)")
        pytest.skip(reason)  # a clone without a registry: said, not failed
    (found,) = directory.glob("*.whl")
    return found


def wheel_files(archive: Path, hashes: dict[str, str]) -> dict[str, bytes]:
    """The files at the paths of ``hashes`` in the wheel ``archive``, each checked against its sha256."""
    with zipfile.ZipFile(archive) as opened:
        files = {path: opened.read(path) for path in hashes}
    for path, source in files.items():
        assert hashlib.sha256(source).hexdigest() == hashes[path], f"{path} is not the file of {archive.name}"
    return files


def package_site(root: Path, files: dict[str, bytes]) -> Path:
    """``root`` with each file at its path and an empty ``__init__.py`` in each package above them."""
    for path, source in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source)
        for package in target.relative_to(root).parents:
            if str(package) != "." and not (root / package / "__init__.py").exists():
                (root / package / "__init__.py").touch()
    return root
