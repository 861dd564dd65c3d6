"""The lab dashboard as a picture: every panel's PromQL evaluated over the last minutes by Prometheus's range API,
one subplot per panel (its PromQL as the title), the dashboard's annotations (configuration changes) as dashed
vertical lines on every panel, written as a PNG.

    python -m deploy.render_dashboard http://127.0.0.1:9090 loadtests/results/lab_dashboard.png [--minutes 5]
"""

from __future__ import annotations

import argparse
import json
import math
import textwrap
import time
from pathlib import Path

import httpx

DASHBOARD = Path(__file__).resolve().parent / "grafana" / "dashboards" / "tokenweir.json"


def query_range(prom: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    r = httpx.get(
        prom + "/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": step}, timeout=15
    )
    body = r.json()
    return body["data"]["result"] if body.get("status") == "success" else []


def render_png(prom: str, out: Path, minutes: float = 3, dashboard: Path = DASHBOARD) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dash = json.loads(dashboard.read_text())
    panels = dash["panels"]
    end = time.time()
    start, step = end - minutes * 60, 2.0
    marks = sorted(
        {
            float(t) - end
            for note in dash.get("annotations", {}).get("list", [])
            for series in query_range(prom, note["expr"], start, end, step)
            for t, v in series["values"]
            if float(v) > 0
        }
    )
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 6.5, rows * 3.6), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        exprs = [t["expr"] for t in panel["targets"]]
        n = 0
        for expr in exprs:
            for series in query_range(prom, expr, start, end, step):
                xs = [float(t) - end for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                label = ",".join(f"{k}={v}" for k, v in series["metric"].items() if k not in ("job",)) or expr[:30]
                ax.plot(xs, ys, label=label[:40], linewidth=1)
                n += 1
        for x in marks:
            ax.axvline(x, color="orange", linestyle="--", linewidth=0.8)
        title = panel["title"] + "\n" + "\n".join(textwrap.shorten(e, 110) for e in exprs)
        ax.set_title(title, fontsize=6.5, loc="left")
        ax.tick_params(labelsize=6)
        ax.set_xlabel("seconds before now", fontsize=6)
        if n:
            ax.legend(fontsize=5, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="red")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"tokenweir lab dashboard ({prom}, last {minutes:g} min)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m deploy.render_dashboard")
    p.add_argument("prometheus")
    p.add_argument("out")
    p.add_argument("--minutes", type=float, default=3)
    args = p.parse_args(argv)
    print(render_png(args.prometheus.rstrip("/"), Path(args.out), args.minutes))


if __name__ == "__main__":
    main()
