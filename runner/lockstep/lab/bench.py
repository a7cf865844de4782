"""``lockstep bench``: measure lockstep against the naive patterns on the example application.

Creates its own database ``lockstep_bench_<pid>`` on the admin DSN's server (dropped at the end), installs
lockstep and the example, fills ``example.exam_key`` once, then runs the sections:

- ``recompute``: for 0 %, 1 % and 100 % of parents changed, each method (naive, seed, lockstep, matview)
  starts from the same data and the same diff, while two application threads delete exams one at a time
  (autocommit, no lock_timeout) and record each DELETE's latency: one deletes reserved exams no method
  rewrites (``app_delete``), the other changed exams the method is rewriting (``app_delete_rewritten``).
  lockstep runs until converged: its recompute, then the worker passes over the parents it handed to the
  queue (more than ``batch_parents`` changed), each its own transaction; ``max_lock_ms`` is the longest
  row-lock time (write phase) of any one of them. ``bare_compute_ms`` is ``count(*)`` of the compute
  function alone, measured beside the methods.
  The section ends with a composite-key run (``lockstep.lab.bench_composite``): two jobs of the same size,
  keyed by one column and by ``(tenant_id, id)``, recomputed side by side, and the ratio of their times.
- ``scaling``: the recompute section again at a quarter of the parents (its own database), so that the
  waits of the two sizes can be compared.
- ``queue``: enqueue throughput, worker throughput, cost of a no-op pass and of a pass over unchanged keys;
  worker cost per key for passes of 50, 200 and 500 keys (unchanged and edited parents) for two jobs, the
  example (about 14 rows per parent) and ``exam_band`` (one row per parent and a trivial compute, like
  the issue's pgbench ``account_band``), beside the bare compute of the same keys; no-op WAL and catalog
  rows of a recompute and of a worker pass, right after a CHECKPOINT and repeated.
  Pass cost is the server backend's CPU time (``/proc/<pid>/schedstat``, when the server runs on this
  host), which a busy machine disturbs much less than wall time; wall time is reported beside it.

Each measured method runs in one transaction: ``EXPLAIN (ANALYZE, WAL)`` of its call gives the WAL it wrote
itself (``wal_own``), ``pg_stat_xact_user_tables`` the rows it wrote; ``wal_lsn`` is the
``pg_current_wal_insert_lsn()`` difference around the run, so it includes the application's deletes.
A CHECKPOINT precedes every measured run, so every method pays the same full-page writes.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg

from lockstep.lab import bench_composite, example, scratch
from lockstep.lab.scratch import percentile

JOB = example.JOB
LEVELS = (0, 1, 100)  # % of parents changed
# lockstep_1tx: lockstep's recompute with no batch limit (one transaction, as before batch_parents)
METHODS = ("naive", "seed", "lockstep", "lockstep_1tx", "matview")
LOCKSTEP_METHODS = ("lockstep", "lockstep_1tx")
# oltp: lockstep.lab.bench_oltp (pgbench; not run by default); scaling: the recompute at 1/4 of the parents
SECTIONS = ("recompute", "queue", "scaling", "oltp")

METHOD_CALL = {
    "naive": "select example.naive_recompute()",
    "seed": "select example.seed_recompute()",
    "lockstep": "insert into pg_temp.bench_result select * from lockstep.recompute('exam_keys')",
    "lockstep_1tx": "insert into pg_temp.bench_result select * from lockstep.recompute('exam_keys')",
    "matview": "select public.bench_refresh()",
}
METHOD_TARGET = {
    "naive": "example.exam_key",
    "seed": "example.exam_key",
    "lockstep": "example.exam_key",
    "lockstep_1tx": "example.exam_key",
    "matview": "public.bench_mv",
}
EXPLAIN_WAL = "explain (analyze, wal, timing off, costs off, format json) "
RESULT_TABLE_SQL = "create temp table if not exists bench_result of lockstep.result"
CLEAR_RESULT_SQL = "delete from pg_temp.bench_result"
READ_RESULT_SQL = (
    "select outcome, inserted, updated, deleted, skipped, compute_ms, write_ms from pg_temp.bench_result"
)
MATVIEW_SQL = """
create materialized view public.bench_mv as select * from example.exam_key_compute(null);
create unique index bench_mv_key on public.bench_mv (exam_id, key);
create function public.bench_refresh() returns void language plpgsql as $f$
begin
    refresh materialized view concurrently public.bench_mv;
end;
$f$;
"""
REFRESH_MATVIEW_SQL = "refresh materialized view public.bench_mv"
RECOMPUTE_SQL = "select outcome, error from lockstep.recompute('exam_keys')"
RUN_INTO_SQL = "insert into pg_temp.bench_result select * from lockstep.run('exam_keys')"
# entries of the recompute's hand-off still queued (what lockstep.status counts, without the count)
HANDED_OFF_SQL = (
    "select exists (select from lockstep.job_state s join lockstep.queue q on q.job = s.job"
    " and q.id between s.recompute_queue_from and s.recompute_queue_to where s.job = 'exam_keys')"
)
UNBOUNDED_SQL = "update lockstep.job set batch_parents = 1000000 where job = 'exam_keys'"
DEFAULT_BATCH_SQL = "update lockstep.job set batch_parents = default where job = 'exam_keys'"
BARE_COMPUTE_SQL = "select count(*) from example.exam_key_compute(null)"
# the floor of any exact whole-table difference: compute's rows and the target's matched on the primary key
# and compared, nothing written (what lockstep._diff_all cannot do with less)
DIFF_FLOOR_SQL = (
    "select count(*) from example.exam_key_compute(null) d full join example.exam_key t"
    " on t.exam_id = d.exam_id and t.key = d.key"
    " where t.exam_id is null or d.exam_id is null or d.weight is distinct from t.weight"
)
RESEED_SQL = (
    "insert into example.exam (id, title, body)"
    " select g, example.words(2, g), example.words(8, -g) from unnest(%(ids)s::bigint[]) g",
    "insert into example.exam_item (exam_id, body)"
    " select g, example.words(2, g * 7 + i) from unnest(%(ids)s::bigint[]) g, generate_series(1, 2) i",
)
SCATTER_SQL = "select id from unnest(%s::bigint[]) id order by hashint8(id * 7919), id"
SEED_SQL = "select example.seed(%s, %s)"
PICK_SQL = "select id from example.exam where id <= %s order by hashint8(id), id limit %s"
DROP_VICTIMS_SQL = "delete from example.exam where id > %s"
CHANGE_SQL = "update example.exam set body = example.words(8, 1000000 + id) where id = any(%s)"
RESTORE_SQL = "update example.exam set body = example.words(8, -id) where id = any(%s)"
EDIT_SQL = "update example.exam set body = body || ' edit' || id where id = any(%s)"
CLEAR_QUEUE_SQL = "delete from lockstep.queue where job = 'exam_keys'"
VACUUM_SQL = "vacuum (analyze) example.exam, example.exam_key, lockstep.queue"
CHECKPOINT_SQL = "checkpoint"
LSN_SQL = "select pg_current_wal_insert_lsn()"
LSN_DIFF_SQL = "select pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)::bigint"
XACT_ROWS_SQL = (
    "select coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint"
    " from pg_stat_xact_user_tables where relid = %s::regclass"
)
FLUSH_STATS_SQL = "select pg_stat_force_next_flush()"
DEADLOCKS_SQL = (
    "select pg_stat_clear_snapshot();"
    " select deadlocks from pg_stat_database where datname = current_database()"
)
APP_DELETE_SQL = "delete from example.exam where id = %s"
ENQUEUE_SQL = "select lockstep.enqueue('exam_keys', %s::bigint[])"
WORK_SQL = "select outcome from lockstep.work('exam_keys', %s)"
BAND_JOB = "exam_band"
BAND_SQL = """
create table public.exam_band (
    exam_id bigint primary key references example.exam (id) on delete cascade,
    band text not null,
    body_len integer not null
);
create function public.exam_band_compute(ids bigint[])
returns table (exam_id bigint, band text, body_len integer)
language sql stable
as $$
    select e.id,
           case when length(e.body) < 60 then 'short' when length(e.body) < 90 then 'medium' else 'long' end,
           length(e.body)
    from example.exam e where ids is null or e.id = any(ids)
$$;
select lockstep.define_derived('exam_band', 'public.exam_band', 'public.exam_band_compute(bigint[])',
                               parent => 'example.exam', parent_column => 'exam_id', every => '1 day');
"""
BAND_WATCH_SQL = "select lockstep.watch('exam_band', 'example.exam', 'id')"
PASS_SIZES = (50, 200, 500)
PASS_REPS = 9
JOB_WORK_SQL = "select outcome, error from lockstep.work(%s, %s)"
JOB_ENQUEUE_SQL = "select lockstep.enqueue(%s, %s::bigint[])"
JOB_RECOMPUTE_SQL = "select outcome, error from lockstep.recompute(%s)"
CLEAR_ALL_QUEUE_SQL = "delete from lockstep.queue"
SET_BATCH_SQL = "select lockstep.set_batch_parents(%s, %s)"
PASS_EDIT_SQL = "update example.exam set body = body || ' p' || (id %% 89) where id = any(%s)"
BARE_SQL_TEMPLATE = "select count(*) from (select * from {}(%s::text[]::bigint[]) offset 0) s"
BARE_SQL = {  # compute alone, in the form lockstep calls it (text keys cast in the statement, not flattened)
    JOB: BARE_SQL_TEMPLATE.format("example.exam_key_compute"),
    BAND_JOB: BARE_SQL_TEMPLATE.format("public.exam_band_compute"),
}
PASS_VACUUM_SQL = "vacuum example.exam, example.exam_key, public.exam_band, lockstep.queue"
FREEZE_SCHEDULE_SQL = "update lockstep.job_state set next_run_at = now() + interval '1 day'"
CATALOG_WRITES_SQL = (
    "select coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint from pg_stat_xact_sys_tables"
    " where schemaname = 'pg_catalog'"
)
VERSION_SQL = "show server_version"

Progress = Callable[[str], None]


def _stderr_progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


class _Deleter(threading.Thread):
    """The application: deletes reserved exams one at a time (top id first) until stopped."""

    def __init__(self, dsn: str, ids: list[int], pause: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.conn = psycopg.connect(dsn, autocommit=True, application_name="lockstep bench app")
        self.ids, self.pause = ids, pause
        self.stop = threading.Event()
        self.latencies_ms: list[float] = []
        self.errors: Counter[str] = Counter()
        self.used = 0

    def run(self) -> None:
        while not self.stop.is_set() and self.used < len(self.ids):
            victim = self.ids[self.used]
            self.used += 1
            t0 = time.perf_counter()
            try:
                self.conn.execute(APP_DELETE_SQL, [victim], prepare=True)
            except psycopg.Error as exc:
                self.errors[exc.sqlstate or "?"] += 1
            self.latencies_ms.append((time.perf_counter() - t0) * 1000)
            self.stop.wait(self.pause)

    def finish(self) -> None:
        self.stop.set()
        self.join()
        self.conn.execute(FLUSH_STATS_SQL)
        self.conn.close()


class Bench:
    def __init__(self, dsn: str, parents: int, progress: Progress) -> None:
        self.dsn, self.parents, self.progress = dsn, parents, progress
        self.victims = min(2000, max(200, parents // 25))
        self.conn = psycopg.connect(dsn, autocommit=True, application_name="lockstep bench")

    def converge(self) -> None:
        """One unbounded recompute (not measured): the reset between measurements."""
        with self.conn.transaction():
            self.conn.execute(UNBOUNDED_SQL)
            outcome, error = self.conn.execute(RECOMPUTE_SQL).fetchone()
            self.conn.execute(DEFAULT_BATCH_SQL)
        if outcome != "done":
            raise RuntimeError(f"lockstep.recompute did not converge: {outcome} {error}")

    def setup(self) -> None:
        from lockstep.migrate import migrate

        self.progress("migrate")
        migrate(self.dsn)
        self.progress(f"install example: {self.parents} parents + {self.victims} reserved for app deletes")
        with self.conn.transaction():
            example.install(self.conn, parents=self.parents)
            self.conn.execute(SEED_SQL, [self.victims, self.parents + 1])
        self.progress("fill: lockstep.recompute")
        self.converge()
        self.conn.execute(MATVIEW_SQL)
        self.conn.execute(RESULT_TABLE_SQL)

    def _deadlocks(self) -> int:
        self.conn.execute(FLUSH_STATS_SQL)
        cur = self.conn.execute(DEADLOCKS_SQL)
        cur.nextset()
        return int(cur.fetchone()[0])

    def _measure(self, method: str, changed: list[int]) -> dict[str, Any]:
        c = self.conn
        try:
            c.execute(CHECKPOINT_SQL)
        except psycopg.Error:
            pass
        c.execute(CLEAR_RESULT_SQL)
        deadlocks0 = self._deadlocks()
        victims = list(range(self.parents + self.victims, self.parents, -1))
        app = _Deleter(self.dsn, victims)
        # changed exams, in a scattered order: some are in the batch being written when deleted
        rewritten = _Deleter(self.dsn, changed[: max(1, len(changed) // 5)], pause=0.02) if changed else None
        lsn0 = c.execute(LSN_SQL).fetchone()[0]
        c.execute(FLUSH_STATS_SQL)  # PostgreSQL 15's pg_stat_xact_* also show earlier unflushed counts
        out: dict[str, Any] = {"error": None, "wal_own": None, "rows": None}
        app.start()
        if rewritten is not None:
            rewritten.start()
        t0 = time.perf_counter()
        try:
            self._run_method(method, out)
        except psycopg.Error as exc:
            out["error"] = exc.sqlstate or "?"
        out["total_ms"] = (time.perf_counter() - t0) * 1000
        app.finish()
        if rewritten is not None:
            rewritten.finish()
        out["wal_lsn"] = int(c.execute(LSN_DIFF_SQL, [lsn0]).fetchone()[0])
        out["app_delete"] = _latencies(app)
        out["app_delete_rewritten"] = _latencies(rewritten, keep=True) if rewritten is not None else None
        if method not in LOCKSTEP_METHODS:
            out["lock_ms"] = out["max_lock_ms"] = out["total_ms"] if method == "naive" else None
        time.sleep(0.05)
        out["deadlocks"] = self._deadlocks() - deadlocks0
        # put back the reserved exams the app deleted, and the changed ones (with their unchanged bodies)
        if app.used:
            with c.transaction():
                c.execute(DROP_VICTIMS_SQL, [self.parents])
                c.execute(SEED_SQL, [self.victims, self.parents + 1])
        if rewritten is not None and rewritten.used:
            gone = [
                r[0]
                for r in c.execute(
                    "select u.v from unnest(%s::bigint[]) u(v)"
                    " where not exists (select from example.exam e where e.id = u.v)",
                    [rewritten.ids[: rewritten.used]],
                )
            ]
            with c.transaction():
                for stmt in RESEED_SQL:
                    c.execute(stmt, {"ids": gone})
        return out

    def _run_method(self, method: str, out: dict[str, Any]) -> None:
        """Run one method, each of its transactions under EXPLAIN (ANALYZE, WAL); lockstep: the recompute,
        then lockstep.run() (the runner's call) until the parents it handed to the queue are done."""
        c = self.conn
        call, txns, locks = METHOD_CALL[method], [], []
        while True:
            c.execute(CLEAR_RESULT_SQL)
            c.execute(FLUSH_STATS_SQL)  # pg_stat_xact_* would also count the previous transactions
            with c.transaction():
                if method == "lockstep_1tx":
                    c.execute(UNBOUNDED_SQL)
                plan = c.execute(EXPLAIN_WAL + call).fetchone()[0]
                rows = int(c.execute(XACT_ROWS_SQL, [METHOD_TARGET[method]]).fetchone()[0])
                if method == "lockstep_1tx":
                    c.execute(DEFAULT_BATCH_SQL)
            txns.append((plan[0]["Plan"], rows))
            if method not in LOCKSTEP_METHODS:
                break
            row = c.execute(READ_RESULT_SQL).fetchone()
            keys = ("outcome", "inserted", "updated", "deleted", "skipped", "compute_ms", "write_ms")
            if row[0] != "done":  # idle: a skipped key's retry is a second away
                txns.pop()
                time.sleep(0.01)
                continue
            if len(txns) == 1:
                out["lockstep"] = dict(zip(keys, row, strict=True))
                out["compute_ms"] = out["lock_ms"] = out["max_lock_ms"] = 0.0
            out["compute_ms"] += row[5]
            out["lock_ms"] += row[6]
            out["max_lock_ms"] = max(out["max_lock_ms"], row[6])
            locks.append(row[6])
            if not c.execute(HANDED_OFF_SQL).fetchone()[0]:
                break
            call = RUN_INTO_SQL
        out["transactions"] = len(txns)
        if locks:
            out["lock_ms_p50"] = percentile(locks, 0.5)
            out["max_lock_txn"] = locks.index(max(locks)) + 1  # 1: the recompute's own batch
        out["wal_own"] = sum(int(p.get("WAL Bytes", 0)) for p, _ in txns)
        out["wal_fpi"] = sum(int(p.get("WAL FPI", 0)) for p, _ in txns)
        out["rows"] = sum(r for _, r in txns)

    def recompute(self) -> dict[str, Any]:
        c = self.conn
        result: dict[str, Any] = {}
        for level in LEVELS:
            n = self.parents * level // 100
            ids = [r[0] for r in c.execute(PICK_SQL, [self.parents, n])] if n else []
            result[f"{level}%"] = per = {"changed_parents": len(ids)}
            scattered = [r[0] for r in c.execute(SCATTER_SQL, [ids])] if ids else []
            for method in METHODS:
                self.progress(f"recompute {level}% ({len(ids)} parents changed): reset for {method}")
                if ids:
                    c.execute(RESTORE_SQL, [ids])
                self.converge()
                if method == "matview":
                    c.execute(REFRESH_MATVIEW_SQL)
                if ids:
                    c.execute(CHANGE_SQL, [ids])
                c.execute(CLEAR_QUEUE_SQL)
                c.execute(VACUUM_SQL)
                if method == "lockstep":  # beside the two lockstep methods
                    t0 = time.perf_counter()
                    c.execute(BARE_COMPUTE_SQL)
                    per["bare_compute_ms"] = (time.perf_counter() - t0) * 1000
                    with c.transaction():  # JIT off, as in lockstep's diff
                        c.execute("set local jit = off")
                        t0 = time.perf_counter()
                        c.execute(DIFF_FLOOR_SQL)
                        per["diff_floor_ms"] = (time.perf_counter() - t0) * 1000
                self.progress(f"recompute {level}%: measure {method}")
                per[method] = self._measure(method, scattered)
                self.converge()
                if method == "lockstep" and not ids:
                    # a second no-op run without app or CHECKPOINT: its pages were already full-page-imaged
                    c.execute(CLEAR_QUEUE_SQL)
                    c.execute(FLUSH_STATS_SQL)  # PostgreSQL 15's pg_stat_xact_* also show unflushed counts
                    with c.transaction():
                        plan = c.execute(EXPLAIN_WAL + METHOD_CALL[method]).fetchone()[0]
                        rows = c.execute(XACT_ROWS_SQL, [METHOD_TARGET[method]]).fetchone()[0]
                    per[method]["wal_own_repeat"] = int(plan[0]["Plan"].get("WAL Bytes", 0))
                    per[method]["rows_repeat"] = int(rows)
            if ids:
                c.execute(RESTORE_SQL, [ids])
                self.converge()
        return result

    def queue(self) -> dict[str, Any]:
        c = self.conn
        c.execute(CLEAR_QUEUE_SQL)
        out: dict[str, Any] = self.noop_wal()  # first: before the steps below leave dead rows behind
        for size, calls in ((1, 2000), (1000, 100)):
            self.progress(f"queue: enqueue {calls} batches of {size}")
            t0 = time.perf_counter()
            for i in range(calls):
                keys = [1 + (i * size + j) % self.parents for j in range(size)]
                c.execute(ENQUEUE_SQL, [keys], prepare=True)
            out[f"enqueue_batch_{size}_keys_per_s"] = calls * size / (time.perf_counter() - t0)
            c.execute(CLEAR_QUEUE_SQL)
        n = max(1, self.parents // 10)
        ids = [r[0] for r in c.execute(PICK_SQL, [self.parents, n])]
        # every key of each parent changes (its body is rewritten): ~16 rows deleted and inserted per parent
        passes, elapsed = self._drain(CHANGE_SQL, ids, f"queue: worker over {n} rewritten parents")
        out["worker_parents"] = n
        out["worker_passes"] = passes
        out["worker_parents_per_s"] = n / elapsed
        self._drain(RESTORE_SQL, ids, "queue: restore the bodies (not measured)")
        # a typical edit: one word appended, so one key added per parent
        passes, elapsed = self._drain(EDIT_SQL, ids, f"queue: worker over {n} edited parents")
        out["worker_edit_parents_per_s"] = n / elapsed
        self.progress("queue: no-op passes")
        c.execute(VACUUM_SQL)  # the queue's dead rows would dominate an empty pass
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            c.execute(WORK_SQL, [500], prepare=True)
            times.append((time.perf_counter() - t0) * 1000)
        out["noop_pass_ms"] = statistics.median(times)
        self.progress("queue: passes over 500 unchanged keys")
        times = []
        for i in range(5):
            c.execute(ENQUEUE_SQL, [[1 + (i * 500 + j) % self.parents for j in range(500)]])
            t0 = time.perf_counter()
            c.execute(WORK_SQL, [500])
            times.append((time.perf_counter() - t0) * 1000)
            c.execute(CLEAR_QUEUE_SQL)
        out["unchanged_500_pass_ms"] = statistics.median(times)
        c.execute(RESTORE_SQL, [ids])
        c.execute(CLEAR_QUEUE_SQL)
        out.update(self.pass_costs())
        return out

    def _timed(self, sql: str, params: list[Any]) -> tuple[float, float | None, Any]:
        """(wall ms, backend CPU ms or None, first row) of one statement."""
        pid = self.conn.info.backend_pid
        cpu0, t0 = scratch.backend_cpu_ms(pid), time.perf_counter()
        # never prepared: a generic plan of compute(ids) cannot drop its "ids is null" branch (a scan of all)
        row = self.conn.execute(sql, params, prepare=False).fetchone()
        wall, cpu1 = (time.perf_counter() - t0) * 1000, scratch.backend_cpu_ms(pid)
        return wall, cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None, row

    def _wal(self, sql: str, params: list[Any], checkpoint: bool) -> tuple[int, int, int]:
        """(WAL bytes, full-page images, catalog rows written) of one statement in its own transaction.

        The WAL is this backend's own (EXPLAIN's WAL counters): a pg_current_wal_lsn() difference also counts
        every other session of the cluster, which on a shared machine is most of it.
        """
        c = self.conn
        if checkpoint:
            c.execute(CHECKPOINT_SQL)
        c.execute(FLUSH_STATS_SQL)  # PostgreSQL 15's pg_stat_xact_* also show unflushed counts
        with c.transaction():
            plan = c.execute(EXPLAIN_WAL + sql, params).fetchone()[0][0]["Plan"]
            catalog = int(c.execute(CATALOG_WRITES_SQL).fetchone()[0])
        return int(plan.get("WAL Bytes", 0)), int(plan.get("WAL FPI", 0)), catalog

    def noop_wal(self) -> dict[str, Any]:
        """WAL and catalog rows of a no-op recompute and of a worker pass over unchanged keys, right after a
        CHECKPOINT and repeated, in this session (its work tables exist: the fill recompute made them), on
        freshly vacuumed data (a run that prunes the application's dead rows writes WAL that is not its own).
        """
        c = self.conn
        out: dict[str, Any] = {}
        c.execute(CLEAR_ALL_QUEUE_SQL)
        self.progress("queue: no-op WAL and catalog rows (recompute, worker pass over unchanged keys)")
        c.execute(VACUUM_SQL)  # no dead rows for the runs to prune: the WAL is their own
        ids = list(range(1, min(50, self.parents) + 1))
        for what, sql, params in (
            ("recompute", "select * from lockstep.recompute(%s)", [JOB]),
            ("work", "select * from lockstep.work(%s, %s)", [JOB, 500]),
        ):
            for label, checkpoint in (("after_checkpoint", True), ("repeated", False)):
                if what == "work":
                    c.execute(JOB_ENQUEUE_SQL, [JOB, ids])
                wal, fpi, catalog = self._wal(sql, params, checkpoint)
                out[f"noop_{what}_wal_{label}"] = wal
                out[f"noop_{what}_fpi_{label}"] = fpi
                out[f"noop_{what}_catalog_rows_{label}"] = catalog
        c.execute(CLEAR_ALL_QUEUE_SQL)
        return out

    def pass_costs(self) -> dict[str, Any]:
        """Worker cost per key by pass size, for the example job and exam_band; no-op WAL and catalog rows."""
        c = self.conn
        c.execute(BAND_SQL)
        c.execute(FREEZE_SCHEDULE_SQL)
        # filled in one transaction (no hand-off to the queue, which the next step clears): every pass then
        # starts from a full, current exam_band, as the example job's passes do
        c.execute(SET_BATCH_SQL, [BAND_JOB, 1_000_000])
        c.execute(JOB_RECOMPUTE_SQL, [BAND_JOB])
        c.execute(SET_BATCH_SQL, [BAND_JOB, 500])
        c.execute(CLEAR_ALL_QUEUE_SQL)
        out: dict[str, Any] = {"pass_sizes": {}}
        rnd = random.Random(17)
        for job in (JOB, BAND_JOB):
            for n in (min(n, self.parents) for n in PASS_SIZES):
                for kind in ("unchanged", "edited"):
                    self.progress(f"queue: {job}, passes of {n} {kind} keys")
                    c.execute(PASS_VACUUM_SQL)  # the same start for each: no dead rows left by earlier steps
                    walls, cpus = [], []
                    for rep in range(PASS_REPS + 2):  # the first two warm the session's plans and tables
                        ids = rnd.sample(range(1, self.parents + 1), n)
                        if kind == "edited":
                            c.execute(PASS_EDIT_SQL, [ids])
                        # the queue's dead rows stay until the next group's VACUUM, as they do between
                        # the runners' VACUUMs (a VACUUM before each pass would also make each pass
                        # re-plan its queue statements, which production passes seldom do)
                        c.execute(CLEAR_ALL_QUEUE_SQL)
                        c.execute(JOB_ENQUEUE_SQL, [job, ids])
                        wall, cpu, row = self._timed(JOB_WORK_SQL, [job, n])
                        if row[0] != "done":
                            raise RuntimeError(f"work({job}, {n}) did not finish: {row}")
                        if rep >= 2:
                            walls.append(wall)
                            cpus.append(cpu)
                    keysets = [[str(k) for k in rnd.sample(range(1, self.parents + 1), n)] for _ in range(5)]
                    bare = [self._timed(BARE_SQL[job], [k]) for k in keysets]
                    out["pass_sizes"][f"{job}/{n}/{kind}"] = {
                        "job": job,
                        "keys": n,
                        "kind": kind,
                        "wall_ms_per_key": statistics.median(walls) / n,
                        "cpu_ms_per_key": statistics.median(cpus) / n if None not in cpus else None,
                        "bare_compute_cpu_ms_per_key": (
                            statistics.median(b[1] for b in bare) / n
                            if None not in [b[1] for b in bare]
                            else None
                        ),
                    }
        c.execute(CLEAR_ALL_QUEUE_SQL)
        return out

    def _drain(self, change_sql: str, ids: list[int], what: str) -> tuple[int, float]:
        """Change ids (the watch trigger enqueues them; re-enqueued as one batch), then time work() passes of
        500 until the queue is idle: (passes, seconds)."""
        c = self.conn
        c.execute(change_sql, [ids])
        c.execute(CLEAR_QUEUE_SQL)
        c.execute(ENQUEUE_SQL, [ids])
        self.progress(what)
        t0, passes = time.perf_counter(), 0
        limit = len(ids) + 100  # a pass of 500 takes at least one key, or the queue is idle
        while c.execute(WORK_SQL, [500]).fetchone()[0] != "idle":
            passes += 1
            if passes > limit:
                raise RuntimeError(f"{what}: the queue is not idle after {limit} work() passes")
        return passes, time.perf_counter() - t0

    def close(self) -> None:
        self.conn.close()


def _latencies(app: _Deleter, keep: bool = False) -> dict[str, Any]:
    lat = app.latencies_ms
    out = {
        "n": len(lat),
        "p50_ms": percentile(lat, 0.5),
        "p99_ms": percentile(lat, 0.99),
        "max_ms": max(lat) if lat else None,
        "errors": dict(app.errors),
    }
    if keep:  # in the order issued: the scaling summary compares maxes over equal counts
        out["latencies_ms"] = [round(x, 3) for x in lat]
    return out


def max_over(latencies: list[float], n: int) -> float | None:
    """The longest wait in n deletes, as the larger run gives it: the median of the maxes of its consecutive
    chunks of n. A run with 4x the deletes has 4x the chances to meet its slowest wait, so its plain max grows
    with the table's size even where no single wait does; compared by equal counts, it does not."""
    if n <= 0 or len(latencies) < n:
        return None
    return statistics.median(max(latencies[i : i + n]) for i in range(0, len(latencies) - n + 1, n))


def machine(conn: psycopg.Connection) -> dict[str, Any]:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "nproc": os.cpu_count(),
        "ram_gb": round(ram / 2**30, 1),
        "postgresql": conn.execute(VERSION_SQL).fetchone()[0],
    }


def summarize(rec: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    for level, target in (("0%", 0.5), ("1%", 2.0), ("100%", None)):
        per = rec.get(level)
        if not per:
            continue
        naive, ls = per["naive"], per["lockstep"]
        if ls.get("lock_ms") is not None and naive["total_ms"]:
            s[f"lockstep_write_vs_naive_total_{level}"] = {
                "pct": 100 * ls["lock_ms"] / naive["total_ms"],
                "target_pct": target,
                "naive_error": naive["error"],
            }
        s[f"app_delete_p99_ms_{level}"] = {m: per[m]["app_delete"]["p99_ms"] for m in METHODS}
        if per["lockstep"].get("app_delete_rewritten"):
            s[f"app_delete_rewritten_ms_{level}"] = {
                m: (per[m]["app_delete_rewritten"]["p99_ms"], per[m]["app_delete_rewritten"]["max_ms"])
                for m in METHODS
            }
        if ls.get("max_lock_ms") is not None:
            one = per.get("lockstep_1tx", {})
            s[f"lockstep_bounds_{level}"] = {
                "max_lock_ms": ls["max_lock_ms"],
                "lock_ms_p50": ls.get("lock_ms_p50"),
                "max_lock_txn": ls.get("max_lock_txn"),
                "one_txn_lock_ms": one.get("lock_ms"),
                "one_txn_total_ms": one.get("total_ms"),
                "total_vs_one_txn": ls["total_ms"] / one["total_ms"] if one.get("total_ms") else None,
                "transactions": ls.get("transactions"),
                "total_ms": ls["total_ms"],
                "bare_compute_ms": per.get("bare_compute_ms"),
                "total_vs_bare": ls["total_ms"] / per["bare_compute_ms"]
                if per.get("bare_compute_ms")
                else None,
                "diff_floor_ms": per.get("diff_floor_ms"),
                "floor_vs_bare": per["diff_floor_ms"] / per["bare_compute_ms"]
                if per.get("diff_floor_ms") and per.get("bare_compute_ms")
                else None,
            }
    if "0%" in rec:
        ls = rec["0%"]["lockstep"]
        s["lockstep_noop"] = {
            "wal_own_bytes": ls["wal_own"],
            "wal_lsn_bytes": ls["wal_lsn"],
            "wal_fpi": ls["wal_fpi"],
            "wal_own_repeat_bytes": ls.get("wal_own_repeat"),
            "rows_repeat": ls.get("rows_repeat"),
            "rows": ls["rows"],
            "target_wal_bytes": 65536,
            "target_rows": 0,
        }
    return s


def _scaling(admin_dsn: str | None, parents: int, progress: Progress) -> dict[str, Any]:
    """The recompute section at a quarter of the parents, in a database of its own."""
    small = max(100, parents // 4)
    name = f"lockstep_bench_{os.getpid()}_s"
    try:
        progress(f"scaling: create database {name} ({small} parents)")
        bench = Bench(
            scratch.create_database(admin_dsn or "", name), small, lambda m: progress(f"[{small}] {m}")
        )
        try:
            bench.setup()
            rec = bench.recompute()
        finally:
            bench.close()
        return {"parents": small, "recompute": rec, "summary": summarize(rec)}
    finally:
        scratch.drop_database(admin_dsn or "", name)


def scaling_summary(big: dict[str, Any], big_parents: int, small: dict[str, Any]) -> dict[str, Any]:
    """lockstep at 100 % changed at both sizes, and the ratios (target: within 2x of each other)."""
    out: dict[str, Any] = {}
    latencies: dict[str, list[float]] = {}  # rewritten-DELETE waits, in the order issued
    for parents, rec in ((small["parents"], small["recompute"]), (big_parents, big)):
        per = rec.get("100%")
        if per:
            ls = per["lockstep"]
            rw = ls.get("app_delete_rewritten") or {}
            latencies[str(parents)] = rw.get("latencies_ms") or []
            out[str(parents)] = {
                "max_lock_ms": ls.get("max_lock_ms"),
                "rewritten_p99_ms": rw.get("p99_ms"),
                "rewritten_max_ms": rw.get("max_ms"),
                "rewritten_n": rw.get("n"),
                "total_ms": ls["total_ms"],
                "transactions": ls.get("transactions"),
            }
    if len(out) == 2:  # the longest wait over as many deletes as the smaller run made, at both sizes
        n = min(len(lat) for lat in latencies.values())
        for size, v in out.items():
            v["rewritten_max_same_n_ms"] = max_over(latencies[size], n)
            v["same_n"] = n
    return out


def run(
    admin_dsn: str | None,
    parents: int = 50000,
    sections: tuple[str, ...] = SECTIONS,
    progress: Progress = _stderr_progress,
) -> dict[str, Any]:
    """Run the benchmark in a database of its own and return the result dict."""
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections: {', '.join(sorted(unknown))}")
    if "oltp" in sections:  # a database of its own (pgbench's tables), sized by LOCKSTEP_OLTP_* variables
        from lockstep.lab import bench_oltp

        oltp = {"oltp": bench_oltp.run(admin_dsn, progress)}
        if set(sections) == {"oltp"}:
            return oltp
    name = f"lockstep_bench_{os.getpid()}"
    try:
        progress(f"create database {name}")
        bench = Bench(scratch.create_database(admin_dsn or "", name), parents, progress)
        try:
            result: dict[str, Any] = {"machine": machine(bench.conn), "parents": parents}
            bench.setup()
            if "recompute" in sections:
                result["recompute"] = bench.recompute()
                result["summary"] = summarize(result["recompute"])
                result["recompute_composite"] = bench_composite.run(bench.conn, parents, progress)
            if "queue" in sections:
                result["queue"] = bench.queue()
        finally:
            bench.close()
        if "scaling" in sections:
            result["scaling"] = _scaling(admin_dsn, parents, progress)
            if "recompute" in result:
                result["scaling"]["sizes"] = scaling_summary(result["recompute"], parents, result["scaling"])
        progress("done")
        return {**result, **oltp} if "oltp" in sections else result
    finally:
        scratch.drop_database(admin_dsn or "", name)


def _f(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


COLS = (
    "method",
    "total ms",
    "compute ms",
    "lock ms",
    "max lock ms",
    "txns",
    "rows",
    "WAL own",
    "FPI",
    "WAL lsn",
    "app DEL n",
    "p50 ms",
    "p99 ms",
    "max ms",
    "rewritten DEL n",
    "p50 ms",
    "p99 ms",
    "max ms",
    "app errors",
    "run error",
    "deadlocks",
)


def _render_recompute(rec: dict[str, Any], lines: list[str]) -> None:
    for level, per in rec.items():
        lines += [
            "",
            f"recompute, {level} of parents changed ({per['changed_parents']} parents); "
            f"bare compute (count(*) of compute(null)): {_f(per.get('bare_compute_ms'))} ms; "
            f"exact-difference floor (compute full join target, compared, nothing written): "
            f"{_f(per.get('diff_floor_ms'))} ms",
        ]
        rows = [COLS]
        for meth in METHODS:
            x, a = per[meth], per[meth]["app_delete"]
            w = x.get("app_delete_rewritten") or {
                "n": 0,
                "p50_ms": None,
                "p99_ms": None,
                "max_ms": None,
                "errors": {},
            }
            errors = Counter(a["errors"]) + Counter(w["errors"])
            rows.append(
                (
                    meth,
                    _f(x["total_ms"]),
                    _f(x.get("compute_ms")),
                    _f(x.get("lock_ms")),
                    _f(x.get("max_lock_ms")),
                    _f(x.get("transactions"), "{}"),
                    _f(x["rows"], "{}"),
                    _f(x["wal_own"], "{:,}"),
                    _f(x.get("wal_fpi"), "{}"),
                    _f(x["wal_lsn"], "{:,}"),
                    str(a["n"]),
                    _f(a["p50_ms"], "{:.2f}"),
                    _f(a["p99_ms"], "{:.2f}"),
                    _f(a["max_ms"], "{:.2f}"),
                    str(w["n"]),
                    _f(w["p50_ms"], "{:.2f}"),
                    _f(w["p99_ms"], "{:.2f}"),
                    _f(w["max_ms"], "{:.2f}"),
                    ",".join(f"{k}x{v}" for k, v in errors.items()) or "-",
                    x["error"] or "-",
                    str(x["deadlocks"]),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(COLS))]
        lines += [
            "  ".join(
                c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in rows
        ]


def _render_summary(summary: dict[str, Any], lines: list[str]) -> None:
    lines += ["", "summary"]
    for key, v in summary.items():
        level = key.rsplit("_", 1)[1]
        if key.startswith("lockstep_write_vs"):
            tgt = f" (target <= {v['target_pct']} %)" if v["target_pct"] is not None else ""
            lines.append(
                f"  lockstep write phases / naive total, {level}: {v['pct']:.2f} %{tgt}"
                + (f" (naive was ended by {v['naive_error']})" if v["naive_error"] else "")
            )
        elif key.startswith("app_delete_p99"):
            lines.append(
                f"  app DELETE of an untouched exam, p99 ms, {level}: "
                + ", ".join(f"{k} {_f(x, '{:.2f}')}" for k, x in v.items())
            )
        elif key.startswith("app_delete_rewritten"):
            lines.append(
                f"  app DELETE of a rewritten exam, p99 / max ms, {level}: "
                + ", ".join(f"{k} {_f(p99, '{:.1f}')} / {_f(mx, '{:.1f}')}" for k, (p99, mx) in v.items())
                + (" (target for lockstep at 100 %: <= 250 / <= 500)" if level == "100%" else "")
            )
        elif key.startswith("lockstep_bounds"):
            tgt = " (target <= 250 ms)" if level == "100%" else ""
            lines.append(
                f"  lockstep, {level}: longest row-lock time of one transaction "
                f"{_f(v['max_lock_ms'])} ms{tgt} "
                f"(transaction {v.get('max_lock_txn')} of {v['transactions']}; "
                f"median {_f(v.get('lock_ms_p50'))} ms; "
                f"one unbounded transaction: {_f(v.get('one_txn_lock_ms'))} ms); "
                f"converged in {_f(v['total_ms'])} ms = {_f(v.get('total_vs_one_txn'), '{:.2f}')} x "
                f"the one-transaction recompute ({_f(v.get('one_txn_total_ms'))} ms; target <= 2) = "
                f"{_f(v['total_vs_bare'], '{:.2f}')} x the bare compute ({_f(v['bare_compute_ms'])} ms; "
                f"the exact-difference floor alone {_f(v.get('floor_vs_bare'), '{:.2f}')} x)"
            )
        else:
            lines.append(
                f"  lockstep no-op: WAL own {v['wal_own_bytes']:,} B right after a CHECKPOINT "
                f"({v['wal_fpi']} full-page images), "
                f"{_f(v['wal_own_repeat_bytes'], '{:,}')} B ({v['rows_repeat']} rows) when run again "
                f"at once (target <= 64 KB); "
                f"lsn diff incl. app deletes "
                f"{v['wal_lsn_bytes']:,} B; rows written {v['rows']} (target 0)"
            )


def render(r: dict[str, Any]) -> str:
    if "machine" not in r:  # the oltp section alone
        from lockstep.lab import bench_oltp

        return bench_oltp.render(r["oltp"])
    m = r["machine"]
    lines = [
        f"machine: {m['nproc']} CPUs, {m['ram_gb']} GB RAM, PostgreSQL {m['postgresql']}; "
        f"{r['parents']} parents"
    ]
    _render_recompute(r.get("recompute", {}), lines)
    if "recompute_composite" in r:
        bench_composite.render(r["recompute_composite"], lines)
    if "summary" in r:
        _render_summary(r["summary"], lines)
    if "scaling" in r:
        sc = r["scaling"]
        lines += ["", f"scaling: the recompute section again at {sc['parents']} parents"]
        _render_recompute(sc["recompute"], lines)
        _render_summary(sc["summary"], lines)
        sizes = sc.get("sizes") or {}
        if len(sizes) == 2:
            (n1, a), (n2, b) = sizes.items()
            lines += [
                "",
                f"scaling, lockstep at 100 % changed: {n1} parents vs {n2} parents (target: within 2x)",
            ]
            for k, label in (
                ("max_lock_ms", "longest row lock of one transaction, ms"),
                ("rewritten_p99_ms", "app DELETE of a rewritten exam, p99 ms"),
                (
                    "rewritten_max_ms",
                    "app DELETE of a rewritten exam, max ms (of all its deletes: "
                    f"{a.get('rewritten_n')} vs {b.get('rewritten_n')})",
                ),
                (
                    "rewritten_max_same_n_ms",
                    f"app DELETE of a rewritten exam, max ms in {a.get('same_n')} deletes"
                    " (median over the larger run's consecutive chunks of that many)",
                ),
                ("total_ms", "total until converged, ms"),
            ):
                ratio = b[k] / a[k] if a.get(k) and b.get(k) is not None else None
                lines.append(f"  {label}: {_f(a.get(k))} vs {_f(b.get(k))} (x {_f(ratio, '{:.2f}')})")
    if "queue" in r:
        q = r["queue"]
        lines += [
            "",
            "queue",
            f"  enqueue, batches of 1:     {q['enqueue_batch_1_keys_per_s']:,.0f} keys/s",
            f"  enqueue, batches of 1000:  {q['enqueue_batch_1000_keys_per_s']:,.0f} keys/s",
            f"  worker, bodies rewritten (every key changes): {q['worker_parents_per_s']:,.0f} parents/s "
            f"({q['worker_parents']} parents, {q['worker_passes']} passes of 500)",
            f"  worker, one word appended (one key added):    "
            f"{q['worker_edit_parents_per_s']:,.0f} parents/s",
            f"  no-op pass (empty queue), median of 200: {q['noop_pass_ms']:.3f} ms",
            f"  pass over 500 unchanged keys, median of 5: {q['unchanged_500_pass_ms']:.1f} ms",
            "  worker cost per key (median of "
            f"{PASS_REPS} passes; CPU = the server backend's, bare = compute alone for as many keys):",
        ]
        for v in q.get("pass_sizes", {}).values():
            lines.append(
                f"    {v['job']:>9}  {v['keys']:>4} keys {v['kind']:>9}: "
                f"CPU {_f(v['cpu_ms_per_key'], '{:.3f}')} ms/key, wall {v['wall_ms_per_key']:.3f} ms/key, "
                f"bare compute {_f(v['bare_compute_cpu_ms_per_key'], '{:.3f}')} ms/key (target <= 0.1)"
            )
        if "noop_recompute_wal_after_checkpoint" in q:
            lines.append("  no-op WAL (target < 64 KB) / catalog rows, after a CHECKPOINT and repeated:")
            for what in ("recompute", "work"):
                lines.append(
                    f"    {what:>9}: {q[f'noop_{what}_wal_after_checkpoint']:,} B "
                    f"({q[f'noop_{what}_fpi_after_checkpoint']} FPI) / "
                    f"{q[f'noop_{what}_catalog_rows_after_checkpoint']} rows, "
                    f"{q[f'noop_{what}_wal_repeated']:,} B ({q[f'noop_{what}_fpi_repeated']} FPI) / "
                    f"{q[f'noop_{what}_catalog_rows_repeated']} rows"
                )
    if "oltp" in r:
        from lockstep.lab import bench_oltp

        lines += ["", bench_oltp.render(r["oltp"])]
    return "\n".join(lines)


def to_json(r: dict[str, Any]) -> str:
    return json.dumps(r, indent=2, default=str)
