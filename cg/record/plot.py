"""``cg-estimate --plot FILE``: cumulative cost direct vs via cg over each session's requests.

Needs matplotlib, the ``plot`` extra (``pip install 'cg[plot]'``): the base install stays light.
"""

from __future__ import annotations

import importlib.util
from typing import Any

HOW = "the plot extra"
MAX_PANELS = 12  # the sessions drawn one by one (the costliest); the rest are in the total


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def draw(report: dict[str, Any], path: str) -> None:
    """Draw ``report`` (cg-estimate's JSON) to ``path``: .png or .svg."""
    if not path.lower().endswith((".png", ".svg")):
        raise ValueError("the file name must end in .png or .svg")
    import matplotlib  # type: ignore[import-not-found,unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]

    sessions = sorted(report["sessions"], key=lambda s: -s["cost_direct"])[:MAX_PANELS]
    panels = len(sessions) + (1 if len(report["sessions"]) > 1 else 0)
    columns = min(3, panels)
    rows = (panels + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.6 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    if len(report["sessions"]) > 1:
        _total(flat[0], report)
        flat = flat[1:]
    for ax, s in zip(flat, sessions):
        turns = range(1, len(s["cumulative_direct"]) + 1)
        ax.plot(turns, s["cumulative_direct"], label="direct", color="#c0392b", linewidth=2)
        ax.plot(turns, s["cumulative_cg"], label="via cg", color="#2471a3", linewidth=2)
        ax.fill_between(turns, s["cumulative_cg"], s["cumulative_direct"], color="#a9cce3", alpha=0.4)
        ratio = "-" if s["ratio"] is None else f"{s['ratio']:.2f}"
        ax.set_title(f"{s['client']} {s['session'][:8]}: via cg {ratio} of direct", fontsize=10)
        ax.set_xlabel("request")
        ax.set_ylabel("cumulative cost (USD)")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    for ax in flat[len(sessions):]:
        ax.axis("off")
    t = report["total"]
    # "\\$": a bare $ starts matplotlib's math mode
    figure.suptitle(f"cg-estimate: {t['sessions']} session(s), {t['requests']:,} requests, "
                    f"\\${t['cost_direct']:,.2f} direct, \\${t['cost_cg']:,.2f} via cg", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _total(ax: Any, report: dict[str, Any]) -> None:
    """Every session's requests one after the other, in order of their start."""
    direct, via, d, c = [], [], 0.0, 0.0
    for s in sorted(report["sessions"], key=lambda s: s["started"] or 0):
        last_d = last_c = 0.0
        for cd, cc in zip(s["cumulative_direct"], s["cumulative_cg"]):
            d += cd - last_d
            c += cc - last_c
            last_d, last_c = cd, cc
            direct.append(d)
            via.append(c)
    turns = range(1, len(direct) + 1)
    ax.plot(turns, direct, label="direct", color="#c0392b", linewidth=2)
    ax.plot(turns, via, label="via cg", color="#2471a3", linewidth=2)
    ax.fill_between(turns, via, direct, color="#a9cce3", alpha=0.4)
    ratio = report["total"]["ratio"]
    ax.set_title(f"all sessions: via cg {'-' if ratio is None else f'{ratio:.2f}'} of direct", fontsize=10)
    ax.set_xlabel("request (sessions in order)")
    ax.set_ylabel("cumulative cost (USD)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
