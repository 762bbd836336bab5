"""Fetch vLLM's released sources for the compatibility tests (stdlib only, any Python 3.11+).

    python tests/compat/fetch_vllm.py --dest .vllmsrc [VERSION ...]

For each version (default: every one in :data:`SDISTS`) it downloads ``vllm-<v>.tar.gz`` from
the package index pip is configured to use (``PIP_INDEX_URL``, ``pip config get
global.index-url``, else PyPI), through the index's JSON form (PEP 691), checks the file
against the sha256 pinned below, and unpacks only ``vllm/**/*.py`` and ``pyproject.toml`` into
``<dest>/x/vllm-<v>/``. Downloads are kept in ``<dest>/dl`` (a second run downloads nothing).

Why not ``pip download``: pip builds the sdist's metadata and rejects it ("inconsistent
version: expected '0.11.0', but metadata has '0.11.0+cu130'"). No vLLM package is installed,
no wheel (250-440 MB each) is fetched, no GPU is needed: tests/compat/vllm_publisher.py loads
the few leaf modules it needs from these trees.

Exit status: 0 when every version is there and matches its pin; 1 otherwise, with one line
saying which version and why.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

PYPI = "https://pypi.org/simple"

# sha256 of each released sdist, as PyPI's simple index lists them (checked 2026-12-01).
SDISTS = {
    "0.10.2": "57608f44cf61f5d80fb182c98e06e524cb2925bb528258a7b247c8e43a52d13e",
    "0.11.0": "f435a64c24e9c4178d657a76f8edd8548ddc444012f7d06a9f79ac3a6392bfae",
    "0.25.1": "ddbdec3f1c0f21afa70b7eb6ddf3faa29d26b1302ee4b5d5e00ec3af41b0c2e4",
    "0.26.0": "23e9fa19d7e20ce7dcc1c074d41503e2116d23f19e688f5d5ea91b741f958502",
    "0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
}


class FetchError(Exception):
    """One version could not be fetched or did not match its pin; the message says which."""


def index_url() -> str:
    """The simple index pip would use: ``PIP_INDEX_URL``, pip's config, else PyPI."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"].rstrip("/")
    try:
        got = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        got = ""
    return (got or PYPI).rstrip("/")


def sdist_files(index: str) -> dict[str, dict]:
    """filename -> the index's file entry (``url``, ``hashes``) for the vllm project."""
    req = urllib.request.Request(f"{index}/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return {f["filename"]: f for f in json.load(resp)["files"]}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def download(url: str, path: Path) -> None:
    part = path.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=600) as resp, part.open("wb") as out:
        while block := resp.read(1 << 20):
            out.write(block)
    part.rename(path)


def unpack(archive: Path, version: str, out: Path) -> Path:
    """Extract ``vllm/**/*.py`` and ``pyproject.toml`` of one sdist; returns the tree's root."""
    top = f"vllm-{version}/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers()
                   if (m.name.startswith(top + "vllm/") and m.name.endswith(".py")) or m.name == top + "pyproject.toml"]
        tar.extractall(out, members=members, filter="data")
    return out / f"vllm-{version}"


def fetch(version: str, dest: Path, files: dict[str, dict] | None) -> Path:
    """One version into ``dest/x/vllm-<version>``; ``files`` is None when nothing is to download."""
    if version not in SDISTS:
        raise FetchError(f"vllm {version}: no pinned sha256 (known: {', '.join(SDISTS)})")
    name = f"vllm-{version}.tar.gz"
    archive = dest / "dl" / name
    if not archive.exists():
        entry = (files or {}).get(name)
        if entry is None:
            raise FetchError(f"vllm {version}: {name} is not on the index")
        if entry.get("hashes", {}).get("sha256") not in (None, SDISTS[version]):
            raise FetchError(f"vllm {version}: the index lists sha256 {entry['hashes']['sha256']}, "
                             f"pinned {SDISTS[version]}")
        print(f"fetch_vllm: downloading {name} ({entry.get('size', 0) / 1e6:.1f} MB)", flush=True)
        download(entry["url"], archive)
    got = sha256(archive)
    if got != SDISTS[version]:
        archive.unlink()
        raise FetchError(f"vllm {version}: {name} has sha256 {got}, pinned {SDISTS[version]} (removed)")
    tree = unpack(archive, version, dest / "x")
    print(f"fetch_vllm: {name} sha256 ok -> {tree}", flush=True)
    return tree


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dest", default=".vllmsrc", help="folder for dl/ and x/ (default .vllmsrc)")
    ap.add_argument("versions", nargs="*", default=list(SDISTS), help=f"default: {' '.join(SDISTS)}")
    args = ap.parse_args(argv)
    dest = Path(args.dest)
    (dest / "dl").mkdir(parents=True, exist_ok=True)
    missing = [v for v in args.versions if not (dest / "dl" / f"vllm-{v}.tar.gz").exists()]
    try:
        files = sdist_files(index_url()) if missing else None
        for version in args.versions:
            fetch(version, dest, files)
    except FetchError as exc:
        print(f"fetch_vllm: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # network or disk
        print(f"fetch_vllm: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
