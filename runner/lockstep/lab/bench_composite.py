"""The recompute section's composite-key run: what a two-column parent key costs beside one column.

Two jobs of the same size side by side in the bench's database: ``kc_one`` keyed by ``kc_parent1(id)``
(bigint) and ``kc_two`` keyed by ``kc_parent2(tenant_id, id)`` (a composite type ``kc_key``), the same
parents (``tenant_id = 1 + id % 16``), the same rows (one per parent) and the same compute. For 1 % and
100 % of parents changed, each job runs as the runner would: its recompute, then ``lockstep.run()`` until
the parents it handed to the queue are written (each batch its own transaction). Rounds alternate which
job goes first; the ratio is the median of the composite's times over the median of the one column's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg

LEVELS = (1, 100)  # % of parents changed
ROUNDS = 3
JOBS = ("kc_one", "kc_two")
SETUP_SQL = """
create table public.kc_parent1 (id bigint primary key, tenant_id int not null, body text not null);
create table public.kc_parent2 (tenant_id int not null, id bigint not null, body text not null,
                                primary key (tenant_id, id));
create type public.kc_key as (tenant_id int, id bigint);
create table public.kc_one (parent_id bigint primary key references public.kc_parent1 on delete cascade,
                            tenant_id int not null, band text not null, len integer not null);
create table public.kc_two (tenant_id int not null, parent_id bigint not null, band text not null,
                            len integer not null, primary key (tenant_id, parent_id),
                            foreign key (tenant_id, parent_id) references public.kc_parent2
                                on delete cascade);
create function public.kc_one_compute(keys bigint[])
returns table (parent_id bigint, tenant_id int, band text, len integer)
language sql stable as $$
    select p.id, p.tenant_id, case when length(p.body) < 40 then 'short' else 'long' end, length(p.body)
    from public.kc_parent1 p where keys is null or p.id = any(keys)
$$;
create function public.kc_two_compute(keys public.kc_key[])
returns table (tenant_id int, parent_id bigint, band text, len integer)
language sql stable as $$
    select p.tenant_id, p.id, case when length(p.body) < 40 then 'short' else 'long' end, length(p.body)
    from public.kc_parent2 p where keys is null
    union all
    select p.tenant_id, p.id, case when length(p.body) < 40 then 'short' else 'long' end, length(p.body)
    from unnest(keys) k join public.kc_parent2 p on p.tenant_id = k.tenant_id and p.id = k.id
$$;
insert into public.kc_parent1 select g, 1 + g % 16, md5(g::text) from generate_series(1, %(n)s) g;
insert into public.kc_parent2 select 1 + g % 16, g, md5(g::text) from generate_series(1, %(n)s) g;
analyze public.kc_parent1, public.kc_parent2;
select lockstep.define_derived('kc_one', 'public.kc_one', 'public.kc_one_compute(bigint[])',
                               parent => 'public.kc_parent1', every => '1 day');
select lockstep.define_derived('kc_two', 'public.kc_two', 'public.kc_two_compute(public.kc_key[])',
                               parent => 'public.kc_parent2', every => '1 day');
"""
PARENT = {"kc_one": "public.kc_parent1", "kc_two": "public.kc_parent2"}
CHANGE_SQL = "update {} set body = body || 'x' where id %% %s = 0"
RESTORE_SQL = "update {} set body = md5(id::text) where length(body) > 32"
RECOMPUTE_SQL = "select outcome, error from lockstep.recompute(%s)"
RUN_SQL = "select outcome, error from lockstep.run(%s)"
QUEUED_SQL = "select exists (select from lockstep.queue where job = %s)"
DUE_LATER_SQL = "update lockstep.job_state set next_run_at = now() + interval '1 day' where job = %s"
CLEAR_SQL = "delete from lockstep.queue where job = %s"
DIFFER_SQL = (
    "select count(*) from ((table public.{0} except select * from public.{0}_compute(null))"
    " union all (select * from public.{0}_compute(null) except table public.{0})) d"
)

Progress = Callable[[str], None]


def _converge(conn: psycopg.Connection, job: str) -> tuple[float, int]:
    """The job's recompute, then run() until its hand-off is written: wall ms and transactions."""
    t0 = time.perf_counter()
    outcome, error = conn.execute(RECOMPUTE_SQL, [job]).fetchone()
    if outcome not in ("done", "idle"):
        raise RuntimeError(f"{job}: recompute {outcome} {error}")
    txns = 1
    for _ in range(100000):
        if not conn.execute(QUEUED_SQL, [job]).fetchone()[0]:
            break
        outcome, error = conn.execute(RUN_SQL, [job]).fetchone()
        if outcome not in ("done", "idle"):
            raise RuntimeError(f"{job}: run {outcome} {error}")
        txns += 1
    else:
        raise RuntimeError(f"{job}: the hand-off was not written in 100000 runs")
    ms = (time.perf_counter() - t0) * 1000
    conn.execute(DUE_LATER_SQL, [job])
    return ms, txns


def run(conn: psycopg.Connection, parents: int, progress: Progress) -> dict[str, Any]:
    """Both jobs at 1 % and 100 % of parents changed, ROUNDS rounds each: medians and their ratio."""
    progress(f"recompute composite: {parents} parents keyed by id and by (tenant_id, id)")
    with conn.transaction():
        conn.execute(SETUP_SQL.replace("%(n)s", str(int(parents))))
    for job in JOBS:
        _converge(conn, job)
    out: dict[str, Any] = {"parents": parents, "rounds": ROUNDS}
    for level in LEVELS:
        times: dict[str, list[float]] = {job: [] for job in JOBS}
        txns: dict[str, int] = {}
        for r in range(ROUNDS):
            for job in JOBS if r % 2 == 0 else tuple(reversed(JOBS)):
                progress(f"recompute composite {level}%: round {r + 1}, {job}")
                conn.execute(CHANGE_SQL.format(PARENT[job]), [100 // level])
                conn.execute(CLEAR_SQL, [job])  # the change's queue entries: the recompute covers them
                conn.execute("checkpoint")
                ms, txns[job] = _converge(conn, job)
                times[job].append(ms)
                conn.execute(RESTORE_SQL.format(PARENT[job]))
                _converge(conn, job)
        per = {
            job: {"ms": statistics.median(times[job]), "runs_ms": times[job], "txns": txns[job]}
            for job in JOBS
        }
        per["ratio"] = per["kc_two"]["ms"] / per["kc_one"]["ms"] if per["kc_one"]["ms"] else None
        out[f"{level}%"] = per
    out["converged"] = all(conn.execute(DIFFER_SQL.format(job)).fetchone()[0] == 0 for job in JOBS)
    return out


def render(rec: dict[str, Any], lines: list[str]) -> None:
    lines += [
        "",
        f"recompute, composite key beside one column ({rec['parents']} parents, one row each; median of "
        f"{rec['rounds']} rounds; recompute then run() until its hand-off is written)",
        f"{'changed':>8} {'id ms':>9} {'txns':>5} {'(tenant_id, id) ms':>19} {'txns':>5} {'ratio':>6}",
    ]
    for level in LEVELS:
        per = rec[f"{level}%"]
        ratio = "-" if per["ratio"] is None else f"{per['ratio']:.2f}"
        lines.append(
            f"{level:>7}% {per['kc_one']['ms']:>9.1f} {per['kc_one']['txns']:>5}"
            f" {per['kc_two']['ms']:>19.1f} {per['kc_two']['txns']:>5} {ratio:>6}"
        )
    lines.append(f"converged: {'yes' if rec['converged'] else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    """``python -m lockstep.lab.bench_composite --parents N``: this run alone, in a scratch database."""
    import argparse
    import os
    import sys

    from lockstep.lab import scratch
    from lockstep.migrate import migrate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dsn", default=os.environ.get("LOCKSTEP_DSN", ""), help="admin DSN (a database is made)"
    )
    parser.add_argument("--parents", type=int, default=50000)
    args = parser.parse_args(argv)
    name = f"lockstep_bench_composite_{os.getpid()}"
    try:
        dsn = scratch.create_database(args.dsn, name)
        migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            rec = run(conn, args.parents, lambda m: print(m, file=sys.stderr, flush=True))
        lines: list[str] = []
        render(rec, lines)
        print("\n".join(lines).lstrip("\n"))
    finally:
        scratch.drop_database(args.dsn, name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
