"""What the run history (lockstep.run_log) costs a run, side by side in one run.

    PYTHONPATH=tests python -m lab.history_cost [--dsn ADMIN_DSN] [--runs 1000] [--rounds 3]

In a database of its own: a generic job at its run_log limit (every run inserts one row and prunes one)
next to 100,000 rows of other jobs. Each round times ``runs`` autocommit calls of ``lockstep._finish``
(the status-row update every run does, then ``_log_run``) with the history on, then with ``_log_run``
replaced by a no-op. Server-side times come from ``track_functions = all`` (pg_stat_user_functions), so the
client round trip does not hide the difference; the wall time per call is printed too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import psycopg

from lockstep.lab.scratch import create_database, drop_database
from lockstep.migrate import migrate

LOG_RUN = "lockstep._log_run(lockstep.job,text,text,timestamp with time zone,lockstep._pass,text)"
NOOP = """
create or replace function lockstep._log_run(j lockstep.job, action text, outcome text, started timestamptz,
                                             p lockstep._pass default null, error text default null)
returns void language plpgsql set search_path = pg_catalog, pg_temp as $$ begin end $$
"""
FINISH = (
    "select lockstep._finish(j, 'call', 'done', clock_timestamp()) from lockstep.job j where j.job = 'ok'"
)
STATS = (
    "select funcname, total_time / nullif(calls, 0) * 1000, self_time / nullif(calls, 0) * 1000"
    " from pg_stat_user_functions where funcname in ('_finish', '_log_run', '_prune_run_log')"
)


def _setup(c: psycopg.Connection, other_rows: int) -> str:
    c.execute("create function public.ok() returns void language sql as $$ select $$")
    c.execute("select lockstep.define_job('ok', 'public.ok()')")
    c.execute(
        "insert into lockstep.run_log (job, owner, lock_group, kind, action, outcome, started_at,"
        " finished_at, duration_ms, run_no) select 'other' || (g %% 100), 'root', 'g', 'job', 'call', 'done',"
        " now(), now(), 1, g from generate_series(1, %s) g",
        [other_rows],
    )
    c.execute("select lockstep.set_run_log_retention(max_per_job => 100)")
    c.execute("analyze")
    c.execute("set track_functions = 'all'")
    return c.execute(f"select pg_get_functiondef('{LOG_RUN}'::regprocedure)").fetchone()[0]


def _round(c: psycopg.Connection, runs: int) -> dict[str, float]:
    for _ in range(100):  # warm up: plans cached, the job at its limit
        c.execute(FINISH)
    c.execute("select pg_stat_force_next_flush()")
    c.execute("select pg_stat_reset()")
    t = time.perf_counter()
    for _ in range(runs):
        c.execute(FINISH)
    wall = (time.perf_counter() - t) / runs * 1e6
    c.execute("select pg_stat_force_next_flush()")
    got = {name: (float(total or 0), float(own or 0)) for name, total, own in c.execute(STATS)}
    return {
        "wall_us": wall,
        "finish_us": got.get("_finish", (0.0, 0.0))[0],
        "log_run_us": got.get("_log_run", (0.0, 0.0))[0],
        "prune_us": got.get("_prune_run_log", (0.0, 0.0))[0],
    }


def run(admin_dsn: str, runs: int = 1000, rounds: int = 3, other_rows: int = 100_000) -> dict:
    name = f"lockstep_history_cost_{os.getpid()}"
    dsn = create_database(admin_dsn, name)
    try:
        migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as c:
            original = _setup(c, other_rows)
            out: dict[str, list[dict[str, float]]] = {"history": [], "no history": []}
            for _ in range(rounds):
                c.execute(original)
                out["history"].append(_round(c, runs))
                c.execute(NOOP)
                out["no history"].append(_round(c, runs))
            rows = c.execute("select count(*) from lockstep.run_log where job = 'ok'").fetchone()[0]
    finally:
        drop_database(admin_dsn, name)
    med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in out.items()}
    return {"runs": runs, "rounds": rounds, "other_rows": other_rows, "rows_of_job": rows, "median": med}


def render(result: dict) -> str:
    m = result["median"]
    on, off = m["history"], m["no history"]
    lines = [
        f"{result['rounds']} rounds x {result['runs']} runs; run_log: {result['other_rows']} other rows,"
        f" the job at its limit ({result['rows_of_job']} rows); medians of the rounds, microseconds per run",
        f"{'':12s} {'_finish':>9s} {'_log_run':>9s} {'prune':>9s} {'wall':>9s}",
    ]
    for label, r in (("history", on), ("no history", off)):
        cells = [r["finish_us"], r["log_run_us"], r["prune_us"], r["wall_us"]]
        lines.append(f"{label:12s} " + " ".join(f"{v:9.1f}" for v in cells))
    ratio_finish, ratio_wall = on["finish_us"] / off["finish_us"], on["wall_us"] / off["wall_us"]
    lines.append(f"{'ratio':12s} {ratio_finish:9.2f} {'':9s} {'':9s} {ratio_wall:9.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dsn", default=os.environ.get("DATABASE_URL", "postgresql://root@127.0.0.1:5432/postgres")
    )
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(render(run(args.dsn, args.runs, args.rounds)))


if __name__ == "__main__":
    main()
