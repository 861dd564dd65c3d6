"""Ruff's rules for a function's size and complexity, with a ratchet: C901 (McCabe complexity), PLR0912 (branches),
PLR0913 (arguments), PLR0915 (statements), at the thresholds of pyproject's [tool.ruff.lint.mccabe] and
[tool.ruff.lint.pylint]. They are not in ruff's `select`, because code from before the rule breaks them; here a
function that breaks one fails unless COMPLEX_FUNCTIONS lists it, with its measure then, and that list may only
shrink: a listed function may not get worse, and an entry that is back within the threshold, or gone, must be removed.

A function is named "path:qualified.name:rule", so a new function that breaks a rule in a listed file fails too.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("gateway", "engine", "kernels", "policies", "common", "migrations")
RULES = ("C901", "PLR0912", "PLR0913", "PLR0915")

# What broke a rule when it came: "path:function:rule" -> the measure then (complexity, branches, arguments or
# statements), a ceiling that may only come down.
COMPLEX_FUNCTIONS: dict[str, int] = {
    "common/text/tokenizer.py:Tokenizer.__init__:PLR0913": 11,
    "engine/api/streaming.py:stream_response:PLR0913": 9,
    "engine/model/llama.py:LlamaForCausalLM.__init__:PLR0913": 10,
    "engine/sched/sampling_params.py:SamplingParams.__post_init__:C901": 16,
    "engine/sched/sampling_params.py:SamplingParams.__post_init__:PLR0912": 15,
    "engine/sched/scheduler.py:Scheduler.schedule:C901": 16,
    "engine/sched/scheduler.py:Scheduler.schedule:PLR0912": 17,
    "engine/sched/scheduler.py:Scheduler.schedule:PLR0915": 60,
    "engine/worker/model_runner.py:ModelRunner.prepare:PLR0915": 51,
    "gateway/accounting/usage.py:UsageRecorder.add:PLR0913": 11,
    "gateway/accounting/usage.py:UsageRecorder.bill_now:PLR0913": 11,
    "gateway/app.py:RequestMiddleware.__call__:C901": 21,
    "gateway/app.py:RequestMiddleware.__call__:PLR0912": 14,
    "gateway/app.py:RequestMiddleware.__call__:PLR0915": 58,
    "gateway/app.py:create_app.lifespan:PLR0915": 56,
    "gateway/app.py:create_app:PLR0915": 76,
    "gateway/process/cli.py:main:PLR0912": 13,
    "gateway/process/supervisor.py:Supervisor.__init__:PLR0913": 9,
    "gateway/request/dispatch.py:Dispatcher.dispatch:PLR0912": 13,
    "gateway/request/settle.py:Settler.finish:PLR0912": 14,
    "gateway/request/settle.py:Settler.finish:PLR0915": 51,
    "gateway/request/shadow.py:ShadowMirror.mirror:PLR0912": 13,
    "gateway/request/stream_chunks.py:ChunkFilter.process:C901": 22,
    "gateway/request/stream_chunks.py:ChunkFilter.process:PLR0912": 21,
    "gateway/state/backend.py:StateBackend.reserve_and_acquire:PLR0913": 9,
    "gateway/state/memory.py:InMemoryState.reserve_and_acquire:PLR0913": 9,
    "gateway/state/redis.py:RedisState.__init__:PLR0913": 10,
    "gateway/state/redis.py:RedisState._reserve:PLR0913": 10,
    "gateway/state/redis.py:RedisState.reserve_and_acquire:PLR0913": 9,
    "gateway/state/redis_calls.py:PackedCalls.reserve:PLR0913": 12,
    "gateway/state/redis_replies.py:reserve_rejection:PLR0913": 9,
    "policies/snapshot.py:team_snapshot:PLR0913": 12,
}


def thresholds(root: Path) -> list[str]:
    """The rules' thresholds as `ruff --config` options, from root's pyproject.toml."""
    lint = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    options = [f"lint.mccabe.max-complexity={lint['mccabe']['max-complexity']}"]
    options += [f"lint.pylint.{name}={value}" for name, value in lint["pylint"].items()]
    return [arg for option in options for arg in ("--config", option)]


def _qualified_names(tree: ast.Module) -> dict[int, str]:
    """The line of each function's `def` -> its qualified name (Class.method, outer.inner)."""
    names: dict[int, str] = {}

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names[node.lineno] = prefix + node.name
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                walk(node.body, f"{prefix}{node.name}.")

    walk(tree.body, "")
    return names


def complexity_findings(root: Path) -> dict[str, int]:
    """Every function of the product folders under root that breaks one of RULES: "path:function:rule" -> measure."""
    folders = [folder for folder in FOLDERS if (root / folder).is_dir()]
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "json", "--select"]
    command += [",".join(RULES), *thresholds(root), *folders]
    result = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode in (0, 1), result.stderr  # 1: findings
    findings: dict[str, int] = {}
    trees: dict[str, dict[int, str]] = {}
    for finding in json.loads(result.stdout):
        rel = Path(finding["filename"]).resolve().relative_to(root.resolve()).as_posix()
        if rel not in trees:
            trees[rel] = _qualified_names(ast.parse((root / rel).read_text(encoding="utf-8"), rel))
        name = trees[rel][finding["location"]["row"]]
        measure = re.search(r"\((\d+) > \d+\)", finding["message"])
        assert measure, finding["message"]
        findings[f"{rel}:{name}:{finding['code']}"] = int(measure.group(1))
    return findings


def ratchet_problems(findings: dict[str, int], allowed: dict[str, int]) -> list[str]:
    problems = []
    for name, measure in sorted(findings.items()):
        if name not in allowed:
            problems.append(
                f"{name}: {measure}, over the rule's threshold. Split the function (or group its arguments); "
                f"COMPLEX_FUNCTIONS lists only what broke the rule when it came, and may only shrink."
            )
        elif measure > allowed[name]:
            problems.append(f"{name}: {measure}, worse than the {allowed[name]} COMPLEX_FUNCTIONS records.")
    problems += [
        f"{name}: within the rule's threshold now (or gone): remove its entry from COMPLEX_FUNCTIONS."
        for name in sorted(allowed.keys() - findings.keys())
    ]
    return problems


def test_product_functions_keep_within_the_complexity_rules_or_get_better():
    problems = ratchet_problems(complexity_findings(ROOT), COMPLEX_FUNCTIONS)
    assert not problems, "\n".join(problems)


def test_the_ratchet_fails_on_a_new_complex_function_a_worse_one_and_a_stale_entry(tmp_path):
    """On a fake tree: the check is not one that cannot fail."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "gateway").mkdir()
    branches = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(14))
    (tmp_path / "gateway" / "a.py").write_text(
        f"def many(x):\n{branches}    return -1\n\n\n"
        "class C:\n    def wide(self, a, b, c, d, e, f, g, h, i):\n        return a\n"
    )
    findings = complexity_findings(tmp_path)
    assert findings == {"gateway/a.py:many:PLR0912": 14, "gateway/a.py:C.wide:PLR0913": 9}
    allowed = {"gateway/a.py:many:PLR0912": 13, "gateway/a.py:gone:C901": 16}
    assert ratchet_problems(findings, allowed) == [
        "gateway/a.py:C.wide:PLR0913: 9, over the rule's threshold. Split the function (or group its arguments); "
        "COMPLEX_FUNCTIONS lists only what broke the rule when it came, and may only shrink.",
        "gateway/a.py:many:PLR0912: 14, worse than the 13 COMPLEX_FUNCTIONS records.",
        "gateway/a.py:gone:C901: within the rule's threshold now (or gone): remove its entry from COMPLEX_FUNCTIONS.",
    ]
    assert ratchet_problems(findings, findings) == []
