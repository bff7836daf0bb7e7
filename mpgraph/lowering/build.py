"""Build mpgraph's kernel library (``csrc/``) for this machine, once, into a cache.

The CPU kernels need a C++ compiler (``$CXX`` or ``g++``/``c++``); the CUDA kernels need ``nvcc``
(on ``PATH`` or in ``$CUDA_HOME/bin``). The result is cached under ``$MPGRAPH_CACHE`` (default
``~/.cache/mpgraph``) by a hash of the sources, the command and the compiler's version, so a
second session loads it at once. ``$MPGRAPH_CUDA_LIBRARY`` / ``$MPGRAPH_CPU_LIBRARY`` name a
library built elsewhere instead (``prebuilt_library``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from mpgraph.errors import MpgraphError

__all__ = ["PREBUILT", "KernelBuildError", "build_library", "cache_dir", "cublaslt_flags", "cudnn_flags", "prebuilt_library"]

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "csrc"
#: CUDA architectures compiled into the library: machine code for each (Turing, Ampere,
#: Hopper; 75 is the oldest CUDA 13 targets), plus PTX of the newest for GPUs after it.
#: ``$MPGRAPH_CUDA_ARCHS`` overrides (e.g. ``90``).
DEFAULT_ARCHS = ("75", "80", "90")


class KernelBuildError(MpgraphError):
    """The kernel library cannot be built here (no compiler, or the compiler failed)."""


def cache_dir() -> Path:
    return Path(os.environ.get("MPGRAPH_CACHE") or Path.home() / ".cache" / "mpgraph") / "kernels"


def _which(*names: str) -> str | None:
    for name in names:
        if name and (found := shutil.which(name)):
            return found
    return None


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [str(Path(home) / "bin" / "nvcc")] if home else []
    return _which(*candidates, "nvcc", "/usr/local/cuda/bin/nvcc")


def _version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _command(cuda: bool, out: Path) -> list[str]:
    cc = str(SOURCES / "kernels.cc")
    if cuda:
        nvcc = _nvcc()
        if nvcc is None:
            raise KernelBuildError("the CUDA kernels need nvcc (not on PATH, nor in $CUDA_HOME/bin)")
        archs = [a.strip() for a in os.environ.get("MPGRAPH_CUDA_ARCHS", ",".join(DEFAULT_ARCHS)).split(",") if a.strip()]
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
        return [nvcc, "-O3", "-std=c++17", "-shared", "-DMPG_WITH_CUDA", *gencode, *cudnn_flags()[0], *cublaslt_flags()[0],
                "-Xcompiler", "-fPIC,-ffp-contract=off,-fvisibility=hidden",
                cc, *(str(p) for p in sorted(SOURCES.glob("*.cu"))), "-o", str(out)]
    cxx = _which(os.environ.get("CXX", ""), "g++", "c++", "clang++")
    if cxx is None:
        raise KernelBuildError("the CPU kernels need a C++ compiler ($CXX, g++, c++ or clang++)")
    # -ffp-contract=off: no fused multiply-adds, so each operation rounds as ORT's ops do.
    # -fno-math-errno: sqrt vectorizes (it is exact either way; nothing reads errno).
    return [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden",
            cc, "-o", str(out)]


def _site_dirs() -> list[Path]:
    paths = sysconfig.get_paths()
    return [Path(p) for p in dict.fromkeys([paths["purelib"], paths["platlib"], *sys.path]) if p]


def _first(candidates: list[Path], name: str) -> Path | None:
    return next((d for d in candidates if (d / name).is_file()), None)


@functools.cache
def cudnn_flags() -> tuple[tuple[str, ...], str]:
    """The nvcc flags that compile the fused attention (``csrc/sdpa.cu``) against cuDNN, and
    ``""``; or no flags and why not (the library is then built without it).

    Looked for, each first in its variable: cudnn-frontend's headers (``$CUDNN_FRONTEND_INCLUDE``;
    the ``nvidia-cudnn-frontend`` wheel installs them under ``<site-packages>/include``), cuDNN's
    headers (``$CUDNN_INCLUDE``; the ``nvidia-cudnn-cu*`` wheel's ``nvidia/cudnn/include``,
    ``/usr/include``) and ``libcudnn.so.9`` (``$CUDNN_LIB``; the wheel's ``nvidia/cudnn/lib``,
    the system's). ``MPGRAPH_NO_CUDNN=1`` turns it off.
    """
    if os.environ.get("MPGRAPH_NO_CUDNN") == "1":
        return (), "MPGRAPH_NO_CUDNN=1"
    def env(name: str) -> list[Path]:
        return [Path(os.environ[name])] if os.environ.get(name) else []

    sites = _site_dirs()
    wheel = [d / "nvidia" / "cudnn" for d in sites]
    frontend = _first(env("CUDNN_FRONTEND_INCLUDE") + [d / "include" for d in sites], "cudnn_frontend.h")
    headers = _first(env("CUDNN_INCLUDE") + [d / "include" for d in wheel]
                     + [Path("/usr/include"), Path("/usr/local/cuda/include")], "cudnn.h")
    lib = _first(env("CUDNN_LIB") + [d / "lib" for d in wheel]
                 + [Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/local/cuda/lib64")], "libcudnn.so.9")
    missing = [what for what, found in (("cudnn-frontend headers (pip install nvidia-cudnn-frontend)", frontend),
                                        ("cuDNN headers", headers), ("libcudnn.so.9", lib)) if found is None]
    if missing:
        return (), "no " + ", no ".join(missing)
    # cuDNN 9 splits its graph API (the cudnnBackend* and execution-plan calls) into
    # libcudnn_graph; libcudnn is the front door.
    links = [f"-l:{name}" for name in ("libcudnn.so.9", "libcudnn_graph.so.9") if (lib / name).is_file()]
    return ("-DMPG_WITH_CUDNN", f"-I{frontend}", f"-I{headers}", f"-L{lib}", *links,
            "-Xlinker", f"-rpath={lib}"), ""


@functools.cache
def cublaslt_flags() -> tuple[tuple[str, ...], str]:
    """The nvcc flags that compile ``GemmBias`` (``csrc/gemm_bias.cu``) against cuBLASLt, and
    ``""``; or no flags and why not (the library is then built without the CUDA ``GemmBias``).

    Looked for, each first in its variable: ``cublasLt.h`` (``$CUBLASLT_INCLUDE``) and
    ``libcublasLt.so.<nvcc's major>`` (``$CUBLASLT_LIB``), in the CUDA toolkit
    (``$CUDA_HOME``, ``/usr/local/cuda``), the ``nvidia-cublas`` wheel's folders
    (``nvidia/cu13/{include,lib}`` for CUDA 13, ``nvidia/cublas/{include,lib}`` before) and the
    system's. ``MPGRAPH_NO_CUBLASLT=1`` turns it off.
    """
    if os.environ.get("MPGRAPH_NO_CUBLASLT") == "1":
        return (), "MPGRAPH_NO_CUBLASLT=1"
    def env(name: str) -> list[Path]:
        return [Path(os.environ[name])] if os.environ.get(name) else []

    nvcc = _nvcc()
    release = re.search(r"release (\d+)\.", _version(nvcc)) if nvcc else None
    home = env("CUDA_HOME") + env("CUDA_PATH") + [Path("/usr/local/cuda")]
    wheels = [d / "nvidia" / sub for d in _site_dirs() for sub in ("cu13", "cublas")]
    headers = _first(env("CUBLASLT_INCLUDE") + [h / "include" for h in home] + [w / "include" for w in wheels]
                     + [Path("/usr/include")], "cublasLt.h")
    name = f"libcublasLt.so.{release.group(1)}" if release else "libcublasLt.so"
    lib = _first(env("CUBLASLT_LIB") + [h / sub for h in home for sub in ("lib64", "lib")] + [w / "lib" for w in wheels]
                 + [Path("/usr/lib/x86_64-linux-gnu")], name)
    missing = [what for what, found in (("cublasLt.h", headers), (name, lib)) if found is None]
    if missing:
        return (), "no " + ", no ".join(missing)
    return ("-DMPG_WITH_CUBLASLT", f"-I{headers}", f"-L{lib}", f"-l:{name}", "-Xlinker", f"-rpath={lib}"), ""


#: The variables that name a library built elsewhere, used as it is (no compiler needed here).
PREBUILT = {False: "MPGRAPH_CPU_LIBRARY", True: "MPGRAPH_CUDA_LIBRARY"}


def prebuilt_library(cuda: bool) -> Path | None:
    """The library ``$MPGRAPH_CUDA_LIBRARY`` (or ``$MPGRAPH_CPU_LIBRARY``) names, or ``None``.

    A machine with no ``nvcc``, no cudnn-frontend headers or no time to compile runs a library
    built on another machine of the same architecture from the same sources. It is not checked
    against the sources: the variable says which file, the caller answers for it.

    Raises:
        KernelBuildError: The variable names no file.
    """
    name = PREBUILT[cuda]
    value = os.environ.get(name, "")
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.is_file():
        raise KernelBuildError(f"${name} names {path}, which is not a file")
    logger.info("mpgraph kernels: the prebuilt %s from $%s", path, name)
    return path


def build_library(cuda: bool) -> Path:
    """The path of the built library, building it first if the cache lacks it; the library
    ``$MPGRAPH_CUDA_LIBRARY`` / ``$MPGRAPH_CPU_LIBRARY`` names instead, where set
    (``prebuilt_library``).

    Args:
        cuda: Include the CUDA kernels (needs ``nvcc``); the CPU kernels are always in.

    Raises:
        KernelBuildError: No compiler, or it failed (its last lines are in the message); or
            the variable names no file.
    """
    prebuilt = prebuilt_library(cuda)
    if prebuilt is not None:
        return prebuilt
    probe = _command(cuda, Path("OUT"))
    digest = hashlib.sha256()
    for path in sorted(SOURCES.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join(probe).encode() + _version(probe[0]).encode())
    target = cache_dir() / digest.hexdigest()[:16] / f"libmpgraph_kernels{'_cuda' if cuda else ''}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        command = _command(cuda, out)
        logger.info("building mpgraph kernels: %s", " ".join(command))
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelBuildError(f"building the kernel library failed: {e}") from e
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
            raise KernelBuildError(f"building the kernel library failed ({Path(command[0]).name} exit {done.returncode}):\n{tail}")
        os.replace(out, target)  # atomic: a concurrent build of the same key writes the same file
    return target
