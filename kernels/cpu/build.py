"""Building a C++ extension on first use without ever hanging a start: the build cache, its lock and the builder
process.

The library is cached as `<root>/tokenweir/<name>-<key>.so`, where root is TORCH_EXTENSIONS_DIR or torch's own
default (the user's cache dir, XDG_CACHE_HOME respected) and key digests what decides the binary: the sources' and
headers' content, the flags, torch, Python and the CPU (`-march=native`). No path is in the key, so moving or copying
the checkout reuses the build.

A build runs in a separate process (this file run as a script) in its own session, so a start that is stopped
(Ctrl-C, SIGTERM, SIGKILL) does not stop it: it compiles in a private temporary directory and renames the library
into the cache, one atomic step, so the cache never holds half a library. The builder holds an flock on
`<name>-<key>.lock` while it works; the kernel drops that lock when the builder dies however it dies, so a lock whose
owner is gone is simply free. A lock held for longer than STALE_LOCK_S is ignored (two builds are safe, the second
rename just replaces the first). A start waits at most TOKENWEIR_KERNEL_BUILD_TIMEOUT_S for the library, logging its
progress, then goes on without it (the caller's torch paths) while the build finishes in the background for the next
start.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from types import ModuleType

try:
    import fcntl
except ImportError:  # not POSIX: no lock, concurrent builds stay safe through the atomic rename
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("tokenweir.engine")

TIMEOUT_ENV = "TOKENWEIR_KERNEL_BUILD_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
PROGRESS_EVERY_S = 15.0
STALE_LOCK_S = 1800.0  # a live builder holding the lock this long is taken to be stuck
_POLL_S = 0.25


@dataclass(frozen=True)
class CachePaths:
    """Where one build of an extension lives: the library, the builders' lock and their scratch directory."""

    name: str
    key: str
    root: str

    @property
    def library(self) -> str:
        return os.path.join(self.root, f"{self.name}-{self.key}.so")

    @property
    def lock(self) -> str:
        return os.path.join(self.root, f"{self.name}-{self.key}.lock")


def cache_root() -> str:
    """TORCH_EXTENSIONS_DIR, else torch's default extensions root (XDG_CACHE_HOME/torch_extensions), + tokenweir."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    return os.path.join(root, "tokenweir")


def cache_paths(name: str, sources: list[str], headers: list[str], cflags: list[str], ldflags: list[str]) -> CachePaths:
    return CachePaths(name, cache_key(sources, headers, cflags, ldflags), cache_root())


def cache_key(sources: list[str], headers: list[str], cflags: list[str], ldflags: list[str]) -> str:
    import torch

    digest = hashlib.sha256()
    for path in sorted(sources) + sorted(headers):
        with open(path, "rb") as f:
            # the file name, not its directory: renaming a source changes the build, moving the checkout does not
            digest.update(os.path.basename(path).encode() + b"\0" + f.read() + b"\0")
    facts = [
        cflags,
        ldflags,
        torch.__version__,
        torch.version.git_version,
        sysconfig.get_config_var("EXT_SUFFIX"),
        platform.machine(),
        os.environ.get("CXX", "c++"),
        _cpu_flags(),  # -march=native: a library built on another CPU may not run here
    ]
    digest.update(json.dumps(facts).encode())
    return digest.hexdigest()[:20]


def build_timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        return max(0.0, float(raw))
    except ValueError:
        log.warning("%s=%r is not a number of seconds; using %.0f", TIMEOUT_ENV, raw, DEFAULT_TIMEOUT_S)
        return DEFAULT_TIMEOUT_S


def load_extension(
    name: str,
    sources: list[str],
    headers: list[str],
    cflags: list[str],
    ldflags: list[str],
    label: str,
    timeout_s: float | None = None,
) -> ModuleType | None:
    """The extension from the cache, built first if it is not there; None where it cannot be had within timeout_s
    (default: TOKENWEIR_KERNEL_BUILD_TIMEOUT_S) or the build fails, with a warning saying why."""
    timeout_s = build_timeout_s() if timeout_s is None else timeout_s
    started = time.monotonic()
    try:
        paths = cache_paths(name, sources, headers, cflags, ldflags)
        os.makedirs(paths.root, exist_ok=True)
    except OSError as exc:
        log.warning("%s unavailable: no build cache (%s)", label, exc)
        return None
    if os.path.exists(paths.library):
        return _import(paths, label, started)
    spec = {"name": name, "sources": sources, "cflags": cflags, "ldflags": ldflags, "root": paths.root}
    waiter = _Wait(label, started, timeout_s)
    builder: subprocess.Popen | None = None
    try:
        while not os.path.exists(paths.library):
            if builder is None:
                builder = _start_or_join(paths, spec, label, waiter)
            elif builder.poll() is not None:
                if os.path.exists(paths.library):
                    break
                log.warning("%s unavailable: the build failed: %s", label, _failure(builder))
                return None
            if waiter.expired():
                _give_up(builder, label, timeout_s)
                return None
            waiter.progress(builder)
            time.sleep(_POLL_S)
    except OSError as exc:  # the cache is not writable, or no process can be started
        log.warning("%s unavailable: %s", label, exc)
        return None
    return _import(paths, label, started)


class _Wait:
    """The bounded wait of one start: its deadline, and a progress line every PROGRESS_EVERY_S."""

    def __init__(self, label: str, started: float, timeout_s: float) -> None:
        self.label, self.started, self.timeout_s = label, started, timeout_s
        self.next_line = started + PROGRESS_EVERY_S
        self.holder = ""  # whom this start waits for, when another process builds

    def expired(self) -> bool:
        return time.monotonic() - self.started >= self.timeout_s

    def progress(self, builder: subprocess.Popen | None) -> None:
        now = time.monotonic()
        if now < self.next_line:
            return
        self.next_line = now + PROGRESS_EVERY_S
        doing = "compiling" if builder is not None else f"waiting for {self.holder}"
        log.info(
            "%s: %s, %.0f s so far (goes on without them at %.0f s, %s)",
            self.label,
            doing,
            now - self.started,
            self.timeout_s,
            TIMEOUT_ENV,
        )


def _start_or_join(paths: CachePaths, spec: dict, label: str, waiter: _Wait) -> subprocess.Popen | None:
    """A builder this start launched, or None while another live process holds the lock (this start then waits)."""
    fd = _try_lock(paths.lock)
    if fd is None:
        holder = _read_lock(paths.lock)
        age = time.time() - float(holder.get("started", time.time()))
        if age < STALE_LOCK_S:
            if not waiter.holder:
                waiter.holder = f"the build by pid {holder.get('pid', '?')} (started {age:.0f} s ago)"
                log.info("%s: waiting for %s", label, waiter.holder)
            return None
        log.warning("%s: the build lock %s is %.0f s old; building anyway", label, paths.lock, age)
    elif os.path.exists(paths.library):  # a builder finished between the caller's look and this lock
        os.close(fd)
        return None
    try:
        _clean_abandoned(paths)
        log.info(
            "%s: compiling into %s (first use of these sources on this machine: 1-4 min on 2 cores)",
            label,
            paths.library,
        )
        return _spawn(paths, spec, fd)
    finally:
        if fd is not None:
            os.close(fd)  # the builder holds the lock from here on, through its inherited descriptor


def _spawn(paths: CachePaths, spec: dict, lock_fd: int | None) -> subprocess.Popen:
    log_fd, log_path = tempfile.mkstemp(prefix=f".{paths.name}-{paths.key}-", suffix=".log", dir=paths.root)
    spec = {**spec, "library": paths.library, "log": log_path, "lock_fd": lock_fd}
    with os.fdopen(log_fd, "w") as out:
        proc = subprocess.Popen(
            # -P: this file's directory (kernels/cpu/) must not shadow top-level modules in the builder
            [sys.executable, "-P", os.path.abspath(__file__), json.dumps(spec)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            pass_fds=() if lock_fd is None else (lock_fd,),
            start_new_session=True,  # Ctrl-C on the engine's terminal leaves the build to finish for the next start
        )
    proc.log_path = log_path  # type: ignore[attr-defined]
    return proc


def _give_up(builder: subprocess.Popen | None, label: str, timeout_s: float) -> None:
    where = f"in the background (pid {builder.pid})" if builder is not None else "in another process"
    log.warning(
        "%s not ready after %.0f s (%s): starting on the torch reference paths, slower; the build goes on %s and "
        "the next start uses it",
        label,
        timeout_s,
        TIMEOUT_ENV,
        where,
    )
    if builder is not None:
        threading.Thread(target=_reap, args=(builder, label), name="kernel-build", daemon=True).start()


def _reap(builder: subprocess.Popen, label: str) -> None:
    code = builder.wait()
    if code == 0:
        log.info("%s: the background build finished; the next start uses it", label)
    else:
        log.warning("%s: the background build failed: %s", label, _failure(builder))


def _failure(builder: subprocess.Popen) -> str:
    path = builder.log_path  # type: ignore[attr-defined]
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        lines = []
    marker = "tokenweir build error: "
    reason = next((line[len(marker) :] for line in reversed(lines) if line.startswith(marker)), "")
    return f"{reason or f'exit {builder.returncode}'}; its log: {path}"


def _import(paths: CachePaths, label: str, started: float) -> ModuleType | None:
    try:
        spec = importlib.util.spec_from_file_location(paths.name, paths.library)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (OSError, ImportError) as exc:
        log.warning("%s unavailable: %s (delete %s to rebuild)", label, exc, paths.library)
        return None
    log.info("%s ready in %.1fs (%s)", label, time.monotonic() - started, paths.library)
    return module


def _try_lock(path: str) -> int | None:
    """An open descriptor holding the exclusive flock on path, or None while a live process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    if fcntl is None:
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:  # a file system without flock: build unlocked, the atomic rename keeps that safe
        return fd
    _write_lock(fd)
    return fd


def _write_lock(fd: int) -> None:
    """Who holds the lock, for the messages of the starts that wait on it (the flock is what counts)."""
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)


def _read_lock(path: str) -> dict:
    try:
        with open(path) as f:
            return json.loads(f.read() or "{}")
    except (OSError, ValueError):
        return {}


def _clean_abandoned(paths: CachePaths) -> None:
    """Scratch directories and logs of builders of this library that died (SIGKILL leaves them behind)."""
    for scratch in glob.glob(os.path.join(paths.root, f".build-{paths.name}-*")):
        pid = os.path.basename(scratch).split("-")[-2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(scratch, ignore_errors=True)
    for old in glob.glob(os.path.join(paths.root, f".{paths.name}-{paths.key}-*.log")):
        with contextlib.suppress(OSError):
            os.unlink(old)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _build(spec: dict) -> None:
    """The builder: torch compiles into a private directory, then the library is renamed into the cache."""
    if spec["lock_fd"] is not None:
        _write_lock(spec["lock_fd"])
    scratch = tempfile.mkdtemp(prefix=f".build-{spec['name']}-{os.getpid()}-", dir=spec["root"])
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name=spec["name"],
            sources=spec["sources"],
            extra_cflags=spec["cflags"],
            extra_ldflags=spec["ldflags"],
            build_directory=scratch,
            verbose=True,
        )
        os.replace(os.path.join(scratch, spec["name"] + ".so"), spec["library"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _main() -> int:
    spec = json.loads(sys.argv[1])
    try:
        _build(spec)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the waiting start reads it from the log
        text = str(exc).strip().splitlines()
        print(f"tokenweir build error: {type(exc).__name__}: {text[0] if text else ''}", flush=True)
        return 1
    with contextlib.suppress(OSError):
        os.unlink(spec["log"])
    return 0


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(_main())
