"""Building the CPU kernels never hangs a start: a start killed in the middle of the compile leaves nothing that
blocks the next one, a lock whose owner died is taken over, a live build is waited for at most the bound, and a moved
checkout loads the cached library without compiling.

Each start is a real Python process calling kernels.cpu.ops.load(), with the kernel sources swapped for a one-function
C++ module (plain Python C API: it compiles in about a second, where the real kernels take minutes) in a fresh
TORCH_EXTENSIONS_DIR; the build itself is the real one (torch's cpp_extension, ninja, the compiler).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokenweir.kernels.cpu import build as cpu_build
from tokenweir.kernels.cpu import ops as cpu_ops

REPO = Path(__file__).resolve().parents[3]

# SPIN_ITERATIONS x 100000 steps of constant evaluation: a compile of a few seconds, so a test can stop it midway.
TINY_SOURCE = """#include <Python.h>
#define TW_CAT2(a, b) a##b
#define TW_CAT(a, b) TW_CAT2(a, b)
#define TW_STR2(a) #a
#define TW_STR(a) TW_STR2(a)
constexpr long spin() {
    long s = 0;
    for (long i = 0; i < SPIN_ITERATIONS; ++i)
        for (long j = 0; j < 100000; ++j) s += (i ^ j) & 1;
    return s;
}
static_assert(spin() >= 0);
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, TW_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC TW_CAT(PyInit_, TORCH_EXTENSION_NAME)() { return PyModule_Create(&module_def); }
"""

# One start: the kernels' load() on the tiny source, its log and a last line "LOADED <answer or None> <seconds> <file>".
LOADER = """
import logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from tokenweir.kernels.cpu import ops as cpu_ops
cpu_ops.SOURCES = [sys.argv[1]]
cpu_ops.HEADERS = []
started = time.monotonic()
module = cpu_ops.load()
answer = None if module is None else module.answer()
print("LOADED", answer, f"{time.monotonic() - started:.3f}", cpu_ops.__file__, flush=True)
"""


def write_source(directory: Path, spin_iterations: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tiny.cpp"
    path.write_text(TINY_SOURCE.replace("SPIN_ITERATIONS", str(spin_iterations)))
    return path


def start_loader(package_root: Path, source: Path, ext_dir: Path, timeout_s: float, log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": str(package_root),
        "TORCH_EXTENSIONS_DIR": str(ext_dir),
        cpu_build.TIMEOUT_ENV: str(timeout_s),
    }
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-c", LOADER, str(source)], cwd=package_root, env=env, stdout=out, stderr=subprocess.STDOUT
        )


def finish(proc: subprocess.Popen, log: Path, within_s: float) -> tuple[str, str, float]:
    """(answer, log text, seconds load() took) of a start that must end within within_s."""
    try:
        proc.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the start still waits after {within_s:.0f} s:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.startswith("LOADED ")]
    assert proc.returncode == 0 and lines, text
    _, answer, seconds, _ = lines[-1].split(" ", 3)
    return answer, text, float(seconds)


def run_loader(package_root: Path, source: Path, ext_dir: Path, timeout_s: float) -> tuple[str, str, float]:
    log = ext_dir.parent / f"start-{time.monotonic_ns()}.log"
    return finish(start_loader(package_root, source, ext_dir, timeout_s, log), log, within_s=timeout_s + 60)


def processes_under(directory: Path) -> list[int]:
    """This machine's processes working in directory or naming it on their command line: the builds of a test."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if cwd.startswith(str(directory)) or str(directory) in cmdline:
            found.append(int(entry))
    return found


def command_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


@pytest.fixture
def ext_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fresh extensions root; every build process still working in it at the end is stopped."""
    path = tmp_path / "ext"
    path.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(path))
    yield path
    for pid in processes_under(path):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def hold_lock(paths: cpu_build.CachePaths, started: float) -> int:
    """This test process holds the build lock, as a live builder does, its record saying it started at `started`."""
    os.makedirs(paths.root, exist_ok=True)
    fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}).encode())
    return fd


def tiny_paths(source: Path) -> cpu_build.CachePaths:
    return cpu_build.cache_paths(cpu_ops.NAME, [str(source)], [], cpu_ops.CFLAGS, cpu_ops.LDFLAGS)


@pytest.mark.parametrize("victims", ["the start", "the start and its compiler"])
def test_a_start_killed_mid_compile_does_not_hang_the_next_start(tmp_path: Path, ext_dir: Path, victims: str):
    source = write_source(tmp_path / "src", spin_iterations=4)
    first_log = tmp_path / "first.log"
    first = start_loader(REPO, source, ext_dir, timeout_s=120, log=first_log)
    deadline = time.monotonic() + 90
    while not (compilers := [p for p in processes_under(ext_dir) if command_name(p) == "cc1plus"]):
        assert first.poll() is None and time.monotonic() < deadline, first_log.read_text()
        time.sleep(0.02)
    victim_pids = [first.pid] + (processes_under(ext_dir) if victims != "the start" else [])
    for pid in victim_pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    first.wait()
    assert compilers and not any(ext_dir.rglob("*.so")), "the build was not stopped midway"

    answer, text, seconds = run_loader(REPO, source, ext_dir, timeout_s=120)
    assert answer == "42", text


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path: Path, ext_dir: Path):
    source = write_source(tmp_path / "src")
    paths = tiny_paths(source)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    os.makedirs(paths.root)
    with open(paths.lock, "w") as f:
        json.dump({"pid": dead.pid, "host": socket.gethostname(), "started": time.time() - 10}, f)
    # and the lock file torch's own build cache leaves behind when a start is killed mid-compile
    (ext_dir / cpu_ops.NAME).mkdir()
    (ext_dir / cpu_ops.NAME / "lock").touch()

    answer, text, _ = run_loader(REPO, source, ext_dir, timeout_s=120)
    assert answer == "42", text
    assert "waiting for" not in text and "compiling into" in text


def test_a_start_waits_for_a_live_build_at_most_the_bound_then_goes_on_without_the_kernels(
    tmp_path: Path, ext_dir: Path
):
    source = write_source(tmp_path / "src")
    fd = hold_lock(tiny_paths(source), started=time.time())
    try:
        answer, text, seconds = run_loader(REPO, source, ext_dir, timeout_s=3)
    finally:
        os.close(fd)
    assert answer == "None", text
    assert f"waiting for the build by pid {os.getpid()}" in text
    assert "not ready after 3 s" in text and "torch reference paths" in text
    assert 3 <= seconds < 6


def test_a_lock_held_past_the_stale_bound_is_built_past(tmp_path: Path, ext_dir: Path):
    source = write_source(tmp_path / "src")
    fd = hold_lock(tiny_paths(source), started=time.time() - 2 * cpu_build.STALE_LOCK_S)
    try:
        answer, text, _ = run_loader(REPO, source, ext_dir, timeout_s=120)
    finally:
        os.close(fd)
    assert answer == "42", text
    assert "building anyway" in text


def test_a_failed_build_is_reported_with_the_compiler_error_and_the_start_goes_on_without_the_kernels(
    tmp_path: Path, ext_dir: Path
):
    source = write_source(tmp_path / "src")
    source.write_text(source.read_text() + "\nthis is not C++;\n")
    answer, text, _ = run_loader(REPO, source, ext_dir, timeout_s=120)
    assert answer == "None", text
    warning = next(line for line in text.splitlines() if "the build failed" in line)
    assert "Error building extension" in warning, warning
    log = Path(warning.rsplit("its log: ", 1)[1])
    assert "this is not C++" in log.read_text() and not any(ext_dir.rglob("*.so"))


def test_a_moved_checkout_loads_the_cached_kernels_without_compiling(tmp_path: Path, ext_dir: Path):
    # the copy is imported as tokenweir.kernels from its own folder (PYTHONPATH comes before the installed one)
    before, after = tmp_path / "checkout", tmp_path / "moved"
    kernels = Path("tokenweir") / "kernels"
    shutil.copytree(REPO / "kernels", before / kernels, ignore=shutil.ignore_patterns("__pycache__"))
    write_source(before / kernels / "tiny")
    answer, text, built_s = run_loader(before, before / kernels / "tiny" / "tiny.cpp", ext_dir, timeout_s=120)
    assert answer == "42" and str(before / kernels / "cpu" / "ops.py") in text, text

    shutil.move(before, after)
    answer, text, loaded_s = run_loader(after, after / kernels / "tiny" / "tiny.cpp", ext_dir, timeout_s=120)
    assert answer == "42" and str(after / kernels / "cpu" / "ops.py") in text, text
    assert loaded_s < 0.5, f"took {loaded_s:.2f} s after the move (the build took {built_s:.2f} s):\n{text}"
    assert "compiling" not in text
