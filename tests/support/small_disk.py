"""A small filesystem of a test's own, to fill for real: a tmpfs mounted for the test (the tests run as root here), so
a full disk is the kernel's ENOSPC and its short writes, not a mock. Skips where a tmpfs cannot be mounted.

    with small_disk(tmp_path) as disk:      # 256 KiB, unmounted at the end (lazily, should a process still hold it)
        filler = fill(disk)                 # no byte left (a file's last page may still take a few: as on tmpfs)
        filler.unlink()                     # room again
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(parent: Path, size_kib: int = 256) -> Iterator[Path]:
    where = Path(parent) / "small-disk"
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(where)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)  # a process still holds a file there


def fill(disk: Path, name: str = "filler") -> Path:
    """Take every free byte of `disk` with one file; returns it (unlink it to give the room back)."""
    filler = disk / name
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for chunk in (b"\0" * 65536, b"\0" * 4096, b"\0"):
            try:
                while True:
                    os.write(fd, chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    return filler
