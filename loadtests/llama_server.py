"""llama-server as a peer: built once from the llama.cpp source vendored in the llama-cpp-python sdist, then started
on a free port with the same GGUF our engine loads.

    .venv/bin/python loadtests/llama_server.py --build              # ~15 min on 2 cores; cached afterwards
    .venv/bin/python loadtests/llama_server.py --build --isa avx2   # AVX2/FMA/F16C only, AVX-512 off

The build is native (this CPU's own instruction set) or, with `isa="avx2"` (or TOKENWEIR_CPU_ISA=avx2 in the
environment, the switch that also builds our kernels for AVX2 only), for the AVX2 class of CPUs: GGML_NATIVE off,
AVX2/FMA/F16C on, AVX-512 off. CPU only, into a cache outside the repository (`$TOKENWEIR_CACHE` or
~/.cache/tokenweir), one build directory per ISA. Every step prints what it runs; a failure says why and returns None
so the benchmark can skip the row instead of dying.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request

from tokenweir.kernels.cpu import ops as cpu_ops

SDIST = "llama-cpp-python==0.3.36"
CACHE = os.environ.get("TOKENWEIR_CACHE", os.path.expanduser("~/.cache/tokenweir"))
SOURCE = os.path.join(CACHE, "llama.cpp-0.3.36")
ISA_FLAGS = {
    "native": ["-DGGML_NATIVE=ON"],
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF"],
}  # fmt: skip


def binary_path(isa: str) -> str:
    return os.path.join(SOURCE, "build" if isa == "native" else f"build-{isa}", "bin", "llama-server")


def _run(cmd: list[str], cwd: str | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def build(jobs: int | None = None, isa: str | None = None) -> str | None:
    """Return the path of a built llama-server for `isa` (default: TOKENWEIR_CPU_ISA, else native), building it if
    the cache lacks one; None (with the reason printed) when the toolchain or the download is missing."""
    isa = isa or cpu_ops.cpu_isa()
    assert isa in ISA_FLAGS, f"isa: one of {sorted(ISA_FLAGS)}"
    binary = binary_path(isa)
    if os.path.exists(binary):
        return binary
    for tool in ("cmake", "ninja", "g++"):
        if shutil.which(tool) is None:
            print(f"llama-server: skipped, {tool} is not installed", file=sys.stderr)
            return None
    build_dir = os.path.dirname(os.path.dirname(binary))
    try:
        os.makedirs(CACHE, exist_ok=True)
        sdists = glob.glob(os.path.join(CACHE, "llama_cpp_python-*.tar.gz"))
        if not sdists:
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", CACHE])
            sdists = glob.glob(os.path.join(CACHE, "llama_cpp_python-*.tar.gz"))
        if not os.path.isdir(os.path.join(SOURCE, "ggml")):
            print(f"unpacking vendor/llama.cpp from {os.path.basename(sdists[0])}", flush=True)
            with tarfile.open(sdists[0]) as tar:
                prefix = tar.getnames()[0].split("/")[0] + "/vendor/llama.cpp/"
                members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
                for m in members:
                    m.name = m.name[len(prefix) :]
                tar.extractall(SOURCE, members=[m for m in members if m.name], filter="data")
        started = time.monotonic()
        _run(
            [
                "cmake", "-S", SOURCE, "-B", build_dir, "-G", "Ninja",
                "-DCMAKE_BUILD_TYPE=Release", *ISA_FLAGS[isa], "-DGGML_CUDA=OFF", "-DLLAMA_CURL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
            ]
        )  # fmt: skip
        _run(
            [
                "cmake",
                "--build",
                build_dir,
                "--target",
                "llama-server",
                "-j",
                str(jobs or os.cpu_count()),
            ]
        )
        print(f"llama-server ({isa}) built in {time.monotonic() - started:.0f}s: {binary}", flush=True)
    except (subprocess.CalledProcessError, OSError, IndexError, tarfile.TarError, urllib.error.URLError) as exc:
        print(f"llama-server: skipped, the build failed: {exc}", file=sys.stderr)
        return None
    return binary if os.path.exists(binary) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    binary: str, model: str, parallel: int, threads: int, ctx_per_slot: int = 1400, extra: list[str] | None = None
) -> tuple[subprocess.Popen, str]:
    """Start llama-server with `parallel` slots (and `extra` flags) and wait until /health answers; returns (process,
    base URL)."""
    port = free_port()
    cmd = [
        binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(parallel), "-t", str(threads),
        "-c", str(ctx_per_slot * parallel), "--timeout", "3600", "--no-webui", *(extra or []),
    ]  # fmt: skip
    log_path = f"/tmp/llama-server-{port}.log"  # its own log, for when it fails mid-run
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    print(f"  llama-server log: {log_path}", flush=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 120)
    except RuntimeError:
        proc.kill()
        raise
    return proc, url


def wait_healthy(proc: subprocess.Popen, url: str, deadline_s: float) -> None:
    """Poll url/health until it answers 200; RuntimeError if the process exits or the deadline passes."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy in {deadline_s:.0f} s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--isa", choices=sorted(ISA_FLAGS), default=None, help="default: TOKENWEIR_CPU_ISA, else native")
    args = ap.parse_args()
    path = build(args.jobs, args.isa)
    print(path or "no llama-server")
    sys.exit(0 if path else 1)
