"""Builds the CPU kernels (every `.cpp` of this folder, with its headers) into one library for
the CPU at hand.

The build is one g++ call (a few seconds: no torch headers) with -march=native (-mcpu=native on
ARM), cached per source, compiler flags and CPU (model name and instruction-set flags), so a
machine with another CPU builds its own copy. Processes starting together build it once, under
a file lock."""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
# Every translation unit and every header of this folder: the headers are read into the
# cache key too, so a new or changed one rebuilds the library (no list to keep by hand).
SOURCES = sorted(os.path.join(_HERE, name) for name in os.listdir(_HERE) if name.endswith(".cpp"))
HEADERS = sorted(os.path.join(_HERE, name) for name in os.listdir(_HERE) if name.endswith(".h"))
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp",
          # Let loops reduce in vector lanes; no -ffast-math: its crtfastmath would turn on
          # flush-to-zero for the whole process (torch included).
          "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]


def _target_flags(march: str | None = None) -> list[str]:
    """-march=native (-mcpu=native on ARM), or `march` (tests build the kernels for an older x86
    too: what runs on other machines runs here, on a CPU with more instructions). On x86, loops
    GCC vectorizes itself take 512-bit lanes where the target has AVX-512; ARM's GCC rejects
    that option."""
    if platform.machine() in ("aarch64", "arm64"):
        return [f"-march={march}" if march else "-mcpu=native"]
    return [f"-march={march or 'native'}", "-mprefer-vector-width=512"]


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def library_path(build_dir: str, compiler: str, march: str | None = None) -> str:
    texts = []
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            texts.append(f.read())
    key = hashlib.sha256(b"\0".join([*texts, " ".join(_FLAGS + _target_flags(march)).encode(),
                                     compiler.encode(), _cpu_identity().encode()]))
    return os.path.join(build_dir, f"cpu-ops-{key.hexdigest()[:16]}.so")


def _sha256(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    digest = hashlib.sha256()
    while chunk := os.read(fd, 1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def open_intact(path: str) -> int | None:
    """A read-only descriptor of the library at `path` if it is the one this build wrote (a
    sha256 of its bytes was written beside it, `path`.sha256), else None. A file planted under
    the predictable name, or cut short, is not, and is built again before anything loads it.
    Loading through the descriptor (/proc/self/fd) loads the very bytes that were checked."""
    try:
        fd = os.open(f"{path}.sha256", os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            expected = f.read().strip()
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    if _sha256(fd) == expected:
        return fd
    os.close(fd)
    return None


def is_intact(path: str) -> bool:
    fd = open_intact(path)
    if fd is not None:
        os.close(fd)
    return fd is not None


def build(build_dir: str, march: str | None = None) -> str:
    """The path of this CPU's compiled library, built first if need be (or again, when the
    cached file is not intact). Raises RuntimeError (with the compiler's message) when no
    compiler is found or the build fails."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    os.makedirs(build_dir, mode=0o700, exist_ok=True)
    path = library_path(build_dir, compiler, march)
    if is_intact(path):
        return path
    lock_fd = os.open(os.path.join(build_dir, "cpu-ops.lock"),
                      os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(lock_fd, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if not is_intact(path):
            with tempfile.TemporaryDirectory(dir=build_dir) as scratch:  # 0700, fresh name
                tmp = os.path.join(scratch, "cpu-ops.so")
                cmd = [compiler, *_FLAGS, *_target_flags(march), *SOURCES, "-o", tmp]
                done = subprocess.run(cmd, capture_output=True, text=True)  # nosec B603
                if done.returncode != 0:
                    raise RuntimeError(f"building the CPU kernels failed: "
                                       f"{done.stderr[-2000:]}")
                fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    digest = _sha256(fd)
                finally:
                    os.close(fd)
                with open(os.path.join(scratch, "digest"), "w") as f:
                    f.write(digest)
                os.replace(tmp, path)
                os.replace(os.path.join(scratch, "digest"), f"{path}.sha256")
    return path
