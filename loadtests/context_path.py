"""Where one request's context goes: the gateway modules whose functions receive an admitted request's
RequestContext, and how many calls each makes with it, for one chat request (non-stream and stream) through a gateway
in front of the fake upstream; with --compare REF, the same for REF's gateway code (a `git worktree`, imported as
bench_gateway.py imports it) beside the current one.

    .venv/bin/python loadtests/context_path.py
    .venv/bin/python loadtests/context_path.py --compare HEAD~5

How it counts: a profiler on the gateway's server thread sees every Python function call; a call counts for its
module when one of its locals at entry (its arguments, `self` included) is the request's context. What a function
reaches through another object (`end.ctx`) is not counted. Fewer modules and calls: fewer places that read or write
the whole context.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: make `loadtests` and `tests` importable

from loadtests.bench_gateway_runner import build, checkout_ref, inside, remove_checkout  # noqa: E402


def measure(code_root: str, stream: bool) -> dict[str, int]:
    """Calls per gateway module (path under gateway/) that held the context of one chat request."""
    import httpx

    from loadtests.fake_upstream import FakeUpstream, free_port
    from tests.support.serve_thread import ServerThread

    counts: collections.Counter[str] = collections.Counter()
    seen: list[object] = []  # the first context met: the request's

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        path = frame.f_code.co_filename
        if event != "call" or "/gateway/" not in path or not inside(path, code_root):
            return
        if frame.f_code.co_name == "__setattr__":  # the context guarding its own fields: every write, not a stage
            return
        for value in frame.f_locals.values():
            if type(value).__name__ in ("RequestContext", "SealedRequestContext"):  # sealed at admission
                seen.append(value) if not seen else None
                if value is seen[0]:
                    counts[path.split("/gateway/", 1)[1]] += 1
                return

    with ServerThread(FakeUpstream(model="fake-model")) as upstream:
        args = types.SimpleNamespace(
            code_root=code_root, upstream=upstream.url, port=free_port(), workdir=tempfile.mkdtemp(), label="path",
            state_url=None, redis_prefix=None, shadow_upstream=None, shadow_fraction=0.05, member_cap=None,
        )  # fmt: skip
        served, info = build(args)
        assert inside(info["gateway_file"], code_root), info
        app = served.config.app if hasattr(served, "config") else served  # serve's own server, or the app
        threading.setprofile(profile)
        try:
            with ServerThread(app) as gateway:
                body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
                headers = {"authorization": f"Bearer {info['key']}"}
                r = httpx.post(gateway.url + "/v1/chat/completions", json=body | {"max_tokens": 8}, headers=headers)
                assert r.status_code == 200, r.text
        finally:
            threading.setprofile(None)
    return dict(counts)


def side(code_root: str, python_path: list[str]) -> dict[str, dict[str, int]]:
    """Both requests' counts for the gateway code at `code_root`, measured in a process of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(python_path)} if python_path else dict(os.environ)
    command = [sys.executable, __file__, "--measure", code_root]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def table(sides: dict[str, dict[str, dict[str, int]]]) -> None:
    for kind in ("non-stream", "stream"):
        modules = sorted({m for counts in sides.values() for m in counts[kind]})
        print(f"\n{kind}: calls holding the request's context, per module")
        print(f"{'module':32} | " + " | ".join(f"{name:>10}" for name in sides))
        for module in sorted(modules, key=lambda m: -max(c[kind].get(m, 0) for c in sides.values())):
            print(f"{module:32} | " + " | ".join(f"{c[kind].get(module, 0):>10}" for c in sides.values()))
        print(f"{'modules':32} | " + " | ".join(f"{len(c[kind]):>10}" for c in sides.values()))
        print(f"{'calls':32} | " + " | ".join(f"{sum(c[kind].values()):>10}" for c in sides.values()))
        outside = {name: sum(n for m, n in c[kind].items() if m != "request/context.py") for name, c in sides.items()}
        print(f"{'calls outside request/context.py':32} | " + " | ".join(f"{n:>10}" for n in outside.values()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", metavar="REF", help="a git commit-ish whose gateway is measured beside the current one")
    p.add_argument("--measure", metavar="CODE_ROOT", help=argparse.SUPPRESS)  # one side, in its own process
    args = p.parse_args()
    if args.measure:
        print(json.dumps({"non-stream": measure(args.measure, False), "stream": measure(args.measure, True)}))
        return
    sides = {"current": side(str(ROOT), [])}
    if args.compare:
        with tempfile.TemporaryDirectory() as tmp:
            sha, tree, python_path = checkout_ref(ROOT, args.compare, Path(tmp) / "ref")
            try:
                sides[sha[:10]] = side(str(tree), python_path)
            finally:
                remove_checkout(ROOT, tree)
    table(sides)


if __name__ == "__main__":
    main()
