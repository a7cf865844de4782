"""``lockstep bench --plot DIR``: the bench's figures as PNG charts, drawn from the same result as its tables.

- ``locks.png`` (from the ``recompute`` section): for each method against the share of parents changed, the
  longest row-lock time of one transaction and the longest wait of an application DELETE;
- ``oltp_tps.png`` (``oltp`` section): each scenario's tps as % of base, every round and the rounds pooled;
- ``queue_age.png`` (``oltp`` section): the age of the queue's oldest entry, and its depth, over each
  lockstep run.

matplotlib is the optional extra ``plot`` (``pip install 'pg-lockstep[plot]'``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# the methods drawn, in the order of the legend, with a fixed colour each
METHODS = {
    "lockstep": ("lockstep", "#1b7837"),
    "naive": ("naive jobs", "#b2182b"),
    "seed": ("naive + advisory lock (seed)", "#ef8a62"),
    "matview": ("REFRESH MATERIALIZED VIEW CONCURRENTLY", "#2166ac"),
}
SCENARIOS = {"trigger": "lockstep's triggers alone", "lockstep": "lockstep", "sync": "sync row trigger"}
DPI = 100


def require() -> None:
    """Raise ImportError with the install hint when matplotlib is missing (before a long bench runs)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError("lockstep bench --plot needs matplotlib: pip install 'pg-lockstep[plot]'") from exc


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _longest_lock(m: dict[str, Any]) -> tuple[float | None, bool]:
    """(ms, measured): lockstep and naive measure their longest row-lock time; seed and matview run one
    transaction, so their row locks last at most its duration (drawn dashed)."""
    if m.get("max_lock_ms") is not None:
        return float(m["max_lock_ms"]), True
    return (float(m["total_ms"]), False) if m.get("total_ms") is not None else (None, False)


def _longest_wait(m: dict[str, Any]) -> float | None:
    """The longest wait of any application DELETE during the method's run, untouched or rewritten exam."""
    waits = [(m.get(k) or {}).get("max_ms") for k in ("app_delete", "app_delete_rewritten")]
    waits = [w for w in waits if w is not None]
    return max(waits) if waits else None


def locks_chart(result: dict[str, Any], path: Path) -> Path:
    """Longest lock per transaction and longest application wait against the change size, per method."""
    plt = _pyplot()
    rec = result["recompute"]
    levels = [lv for lv in ("0%", "1%", "100%") if lv in rec]
    x = list(range(len(levels)))
    labels = [f"{lv}\n({rec[lv]['changed_parents']:,} parents)" for lv in levels]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.8), dpi=DPI)
    for method, (name, colour) in METHODS.items():
        locks = [_longest_lock(rec[lv][method]) for lv in levels]
        waits = [_longest_wait(rec[lv][method]) for lv in levels]
        measured = all(ok for _, ok in locks)
        style = "-" if measured else "--"
        label = name if measured else f"{name} (one transaction: its duration)"
        axes[0].plot(x, [v for v, _ in locks], style, marker="o", color=colour, label=label)
        axes[1].plot(x, waits, "-", marker="o", color=colour, label=name)
        for ax, values in ((axes[0], [v for v, _ in locks]), (axes[1], waits)):
            for xi, lv in zip(x, levels, strict=True):
                if rec[lv][method].get("deadlocks") and values[xi] is not None:
                    ax.plot(xi, values[xi], "X", color=colour, markersize=11)
    n = f"{result.get('parents', 0):,} parents"
    axes[0].set_title(f"Longest row lock held by one transaction ({n})", fontsize=10)
    axes[1].set_title("Longest wait of an application DELETE", fontsize=10)
    for ax in axes:
        ax.set_yscale("symlog", linthresh=1)
        ax.set_ylabel("ms (log scale)")
        ax.set_xticks(x, labels)
        ax.set_xlabel("parents changed")
        ax.grid(True, which="major", alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    handles.append(axes[0].plot([], [], "X", color="black", markersize=9, linestyle="none")[0])
    names.append("X: the run had a deadlock (40P01)")
    fig.legend(handles, names, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return path


def oltp_chart(oltp: dict[str, Any], path: Path) -> Path:
    """tps as % of base for each OLTP scenario: one bar for the rounds pooled, a dot per round."""
    plt = _pyplot()
    pooled = {"trigger": oltp["trigger"]["tps_pct_of_base"], "lockstep": oltp["tps_pct_of_base"]}
    pooled["sync"] = oltp["sync"]["tps_pct_of_base"]
    keys = {"trigger": "trigger_pct", "lockstep": "tps_pct_of_base", "sync": "sync_pct"}
    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=DPI)
    x = list(range(len(SCENARIOS)))
    ax.bar(x, [pooled[s] or 0 for s in SCENARIOS], color=["#7fbf7b", "#1b7837", "#999999"], width=0.6)
    for xi, s in enumerate(SCENARIOS):
        rounds = [rd.get(keys[s]) for rd in oltp["rounds"] if rd.get(keys[s]) is not None]
        ax.plot([xi + 0.15] * len(rounds), rounds, "o", color="black", markersize=4)
        if pooled[s] is not None:
            ax.annotate(f"{pooled[s]:.1f} %", (xi, pooled[s] / 2), ha="center", color="white", fontsize=11)
    ax.axhline(100, color="black", linewidth=0.8)
    ax.set_xticks(x, list(SCENARIOS.values()))
    shown = [v for v in pooled.values() if v is not None]
    shown += [rd.get(k) for rd in oltp["rounds"] for k in keys.values() if rd.get(k) is not None]
    ax.set_ylim(0, max([110.0, *(v + 10 for v in shown)]))  # a shared machine can put a round above base
    ax.set_ylabel("tps, % of base (no trigger)")
    o = oltp["options"]
    ax.set_title(
        f"pgbench tpcb-like, scale {o['scale']}, {o['clients']} clients, {o['seconds']} s x "
        f"{o['rounds']} rounds (dots: each round)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def queue_chart(oltp: dict[str, Any], path: Path) -> Path:
    """The age of the queue's oldest entry (and its depth) over each lockstep run of the OLTP section."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=DPI)
    depth_ax = ax.twinx()
    for i, rd in enumerate(oltp["rounds"], start=1):
        series = rd["lockstep"].get("queue_series") or []
        t = [s[0] for s in series]
        colour = f"C{i - 1}"
        ax.plot(t, [s[1] for s in series], "-", color=colour, label=f"round {i}: oldest entry's age")
        depth_ax.plot(t, [s[2] for s in series], ":", color=colour, alpha=0.6)
    ax.set_xlabel("seconds since the runners started")
    ax.set_ylabel("oldest queued key's age, s")
    depth_ax.set_ylabel("queue entries (dotted)")
    ax.set_ylim(bottom=0)
    depth_ax.set_ylim(bottom=0)
    o = oltp["options"]
    ax.set_title(f"The queue under pgbench ({o['clients']} clients), {o['runners']} runners", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_charts(result: dict[str, Any], directory: str | Path) -> list[Path]:
    """Every chart the result has the sections for, as PNG files in directory (created if missing)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if "recompute" in result:
        written.append(locks_chart(result, out / "locks.png"))
    if "oltp" in result:
        written.append(oltp_chart(result["oltp"], out / "oltp_tps.png"))
        written.append(queue_chart(result["oltp"], out / "queue_age.png"))
    for p in written:
        log.info("wrote %s", p)
    return written
