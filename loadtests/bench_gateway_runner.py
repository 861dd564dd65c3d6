"""One gateway process for loadtests/bench_gateway.py, and the checkout of a commit it runs.

    python loadtests/bench_gateway_runner.py --code-root DIR --upstream URL --port N --workdir DIR --info FILE

This file lives in the current checkout but is run with either side's packages first on the path: the current
code through the editable install (`tokenweir.*` -> /work/main/<folder>), a commit's code through a tree of links
(`pkgroot/tokenweir/<folder> -> <worktree>/<folder>`) or, before the namespace move, its top-level `gateway`,
`policies` packages. So it imports nothing of tokenweir at the top, finds which layout resolves INSIDE
`--code-root` (the editable install would otherwise silently serve the current code under a commit's name),
adapts to the modules that moved between commits, and refuses to start if any loaded gateway module comes from
elsewhere. BENCH_PROFILE=path: cProfile this process into `path` (dumped at SIGTERM).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

MODEL = "fake-model"


# --- the orchestrator's side: a commit's code on disk ---------------------------------------------------------
def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


def checkout_ref(repo: Path, ref: str, tmp: Path) -> tuple[str, Path, list[str]]:
    """`git worktree add` of `ref` under `tmp`: (full sha, worktree, PYTHONPATH entries that import its code).

    A commit after the namespace move gets `tmp/pkgroot/tokenweir/<name> -> worktree/<folder>` from its own
    pyproject's package-dir; an older one imports its top-level packages from the worktree itself."""
    sha = git(repo, "rev-parse", "--verify", f"{ref}^{{commit}}")
    tree = tmp / "worktree"
    tmp.mkdir(parents=True, exist_ok=True)
    git(repo, "worktree", "add", "--detach", str(tree), sha)
    setuptools = tomllib.loads((tree / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
    package_dir: dict[str, str] = setuptools.get("package-dir", {})
    links = {
        name.removeprefix("tokenweir."): folder
        for name, folder in package_dir.items()
        if name.count(".") == 1 and name.startswith("tokenweir.") and (tree / folder).is_dir()
    }
    if not links and any(name.startswith("tokenweir") for name in package_dir):
        raise SystemExit(f"{ref}: pyproject maps tokenweir in a way this benchmark does not know: {package_dir}")
    root = tmp / "pkgroot" / "tokenweir"
    for name, folder in links.items():
        root.mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(tree / folder, target_is_directory=True)
    return sha, tree, ([str(tmp / "pkgroot")] if links else []) + [str(tree)]


def remove_checkout(repo: Path, tree: Path) -> None:
    try:
        git(repo, "worktree", "remove", "--force", str(tree))
    except subprocess.CalledProcessError as e:
        print(f"bench: could not remove the worktree {tree}: {e.stderr.strip()}", file=sys.stderr)
    shutil.rmtree(tree.parent, ignore_errors=True)


# --- the gateway process ----------------------------------------------------------------------------------------
def inside(path: str, root: str) -> bool:
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real == top or real.startswith(top + os.sep)


def find_layout(code_root: str) -> str:
    """The import prefix under which `code_root`'s gateway resolves: 'tokenweir.' or '' (top-level packages)."""
    seen = []
    for prefix in ("tokenweir.", ""):
        try:
            spec = importlib.util.find_spec(prefix + "gateway")
        except ImportError:
            spec = None
        where = list(spec.submodule_search_locations or []) if spec else []
        seen.append(f"{prefix}gateway -> {where or 'nothing'}")
        if where and inside(where[0], code_root):
            return prefix
    raise SystemExit(f"bench runner: no gateway package resolves inside {code_root} ({'; '.join(seen)})")


def first_module(prefix: str, *names: str) -> ModuleType:
    """The first of `names` that imports: modules moved between commits (gateway/app.py -> gateway/server/app.py)."""
    for name in names:
        try:
            return importlib.import_module(prefix + name)
        except ModuleNotFoundError as e:
            if not e.name or not (prefix + name + ".").startswith(e.name + "."):
                raise  # a dependency is missing, not this module: say so
    raise ModuleNotFoundError(f"none of {[prefix + n for n in names]}")


def foreign_modules(prefix: str, code_root: str) -> list[str]:
    """Loaded gateway/policies/common modules whose file is outside `code_root` (two sides' code mixed)."""
    ours = ("tokenweir",) if prefix else ("gateway", "policies", "common")
    bad = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if name.split(".")[0] in ours and file and not inside(file, code_root):
            bad.append(f"{name} ({file})")
    return bad


def build(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The commit's app for a store with one fully-limited team, and what the orchestrator needs to know."""
    prefix = find_layout(args.code_root)
    config = first_module(prefix, "gateway.config")
    app_module = first_module(prefix, "gateway.server.app", "gateway.app")
    store_module = first_module(prefix, "gateway.store.store", "gateway.store")
    limits = first_module(prefix, "policies.limits")
    cli = first_module(prefix, "gateway.process.cli", "gateway.cli")

    if args.redis_prefix:
        # No config field names the key prefix: the app module's RedisState gets it, so make_state still builds
        # the state from state_url as it would; the orchestrator checks that keys appear under the prefix.
        base = vars(app_module)["RedisState"]  # KeyError: this commit builds its state elsewhere

        class PrefixedRedisState(base):  # type: ignore[misc, valid-type]
            def __init__(self, *a: Any, **kw: Any) -> None:
                super().__init__(*a, **{**kw, "prefix": args.redis_prefix})

        setattr(app_module, "RedisState", PrefixedRedisState)  # noqa: B010 (a module attribute mypy cannot see)

    store = store_module.Store.open(f"sqlite:///{args.workdir}/bench.db")
    team_limits = limits.TeamLimits(
        rpm=10_000_000,
        tpm=10_000_000_000,
        tokens_per_day=10**12,
        tokens_per_month=10**13,
        max_concurrency=10_000,
        max_prompt_tokens=4096,
        max_output_tokens=256,
    )
    team = store.create_team("bench", team_limits)
    secret, _ = store.create_key(team.id, "bench")
    member = config.UpstreamConfig(args.upstream)
    if args.member_cap:  # a commit without member caps fails here: the redis-capped cells need one that has them
        member.max_parallel_requests = args.member_cap
    pool = config.PoolConfig(model=MODEL, upstreams=[member], capacity=256, max_queued=10_000)
    pools = [pool]
    if args.shadow_upstream:  # a commit without shadow traffic fails here: the shadow cells need one that has it
        pool.shadow_pool, pool.shadow_fraction = "shadow", args.shadow_fraction
        pools.append(config.PoolConfig(model="shadow", upstreams=[config.UpstreamConfig(args.shadow_upstream)]))
    gw_config = config.GatewayConfig(
        port=args.port,
        store_url=f"sqlite:///{args.workdir}/bench.db",
        state_url=args.state_url,
        pools=pools,
        events=config.EventsConfig(path=f"{args.workdir}/events.jsonl"),
        log_level="warning",
    )
    app = app_module.create_app(gw_config, store=store)
    package = sys.modules[prefix + "gateway"]
    if bad := foreign_modules(prefix, args.code_root):
        raise SystemExit(f"bench runner [{args.label}]: modules from outside {args.code_root}: {bad}")
    # `serve`'s own server (its HTTP protocol and limits) where the commit has one: what production runs
    server = cli.gateway_server(gw_config, app) if hasattr(cli, "gateway_server") else None
    info = {
        "key": secret,
        "layout": prefix or "top-level",
        "gateway_file": os.path.realpath(package.__file__ or ""),
        "app_module": app_module.__name__,
        "server": "gateway_server" if server else "uvicorn.run",
    }
    return (server or app), info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--code-root", required=True, help="the checkout whose gateway must run (verified)")
    p.add_argument("--upstream", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--info", required=True, help="JSON written here once built: the API key, what was imported")
    p.add_argument("--label", default="gateway")
    p.add_argument("--state-url", default=None)
    p.add_argument("--redis-prefix", default=None)
    p.add_argument("--shadow-upstream", default=None, help="mirror --shadow-fraction of the requests to this one")
    p.add_argument("--shadow-fraction", type=float, default=0.05)
    p.add_argument("--member-cap", type=int, default=None, help="the upstream's max_parallel_requests")
    args = p.parse_args()
    served, info = build(args)
    where = "inside" if inside(info["gateway_file"], args.code_root) else "OUTSIDE"
    print(
        f"bench runner [{args.label}] pid {os.getpid()}: {info['layout']} gateway from {info['gateway_file']} "
        f"({where} {args.code_root}), {info['app_module']}, {info['server']}",
        file=sys.stderr,
        flush=True,
    )
    if where != "inside":
        raise SystemExit(f"bench runner [{args.label}]: refusing to run code from outside {args.code_root}")
    Path(args.info).write_text(json.dumps(info))
    # uvicorn re-raises SIGTERM after its graceful shutdown: turn it into SystemExit so `finally` runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    profile = os.environ.get("BENCH_PROFILE")
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    try:
        if info["server"] == "gateway_server":
            served.run()
        else:
            import uvicorn

            uvicorn.run(served, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    finally:
        if profiler and profile:
            profiler.disable()
            profiler.dump_stats(profile)


if __name__ == "__main__":
    main()
