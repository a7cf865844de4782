"""``lockstep bench --sections oltp``: lockstep's cost on a real OLTP write load, driven by pgbench.

In a scratch database ``lockstep_oltp_<pid>`` (dropped at the end): ``pgbench -i -s SCALE --foreign-keys``,
then the built-in tpcb-like script (``-M prepared``, CLIENTS clients, THREADS threads, SECONDS seconds),
alternating ROUNDS times (default 2: base, trigger, lockstep, sync, then the same the other way round; a
shared machine's speed drifts by more than the difference measured, so the scenarios of one round are
compared with each other, and the order turns round from one round to the next so that none is always first
or last):

- ``base``: nothing derived (lockstep unwatched, no runner);
- ``lockstep``: ``account_band(aid -> pgbench_accounts, band text, balance int)`` kept current by
  ``watch('account_band', 'pgbench_accounts', 'aid')`` and RUNNERS ``lockstep run`` processes (watched again
  and converged by a recompute first, which is set-up, not measured; unwatched after);
- ``trigger``: lockstep's triggers alone: watched, no runner: what the write path costs apart from the
  worker, into an ever-growing queue (~200,000 entries a minute; under ``lockstep`` it holds ~1,000 and
  reuses freed space). Each watched run starts on an empty queue file (set-up);
- ``wal``: as ``lockstep``, watched through the WAL (``watch(..., via => 'wal')``: no trigger; the runners'
  ``lockstep.capture()`` reads a logical slot). Only on a server with ``wal_level = logical``; there, after
  the rounds, the capture's server CPU per change (one capture of a few seconds' changes, no runner), and
  a fixed-rate run (``pgbench -R`` at half of base's tps) of base, lockstep and wal with p50 / p99 latency;
- ``wal_now`` (only when named in ``--scenarios``): as ``wal``, the runners with ``--batch-wait 0``: a
  worker pass right after each capture that queued keys, with no gathering window: the lag's floor;
- ``decode`` (only when named in ``--scenarios``, logical servers): no lockstep at all: a pgoutput slot of a
  publication of pgbench_accounts, peeked up to the flushed WAL and advanced every CAPTURE_EVERY seconds on
  one long-lived connection (the capture's schedule and reads, no queue row written): the tps and CPU floor
  of reading the WAL through SQL;
- ``sync``: a reference, not lockstep: the same table kept current by a row trigger that rewrites the
  account's row in the application's own transaction (``update account_band set band = ..., balance =
  new.abalance where aid = new.aid``, the band computed inline): a minimal way to keep it current, with
  none of lockstep's guarantees (the writer waits on, and deadlocks with, any other writer of account_band).
  What it costs the load is about what keeping this table current costs at all, before any queue.

Reported for each: tps, average latency, the ``UPDATE pgbench_accounts`` latency (``pgbench -r``), WAL per
transaction (``pg_current_wal_lsn()`` difference / transactions; for lockstep until the queue drained, so
it includes the worker's writes); for lockstep also: tps as % of base, the added ms per UPDATE, the
server time the trigger adds to one single-row UPDATE (against an unwatched twin table, in one DO block), the
worker's ms per queued key (its passes' time from the runners' JSON logs / keys enqueued), the queue's lag
(oldest entry, sampled every 0.5 s), its size, how long it took to drain after the load, and convergence
(account_band equals its compute); for sync: tps as % of base, added ms per UPDATE, WAL, convergence, and
lockstep's tps as % of sync's; for trigger: tps as % of base, added ms per UPDATE and WAL. The machine may
be shared: compare the rows of one run.

The summary ratios (tps % of base, added ms per UPDATE, WAL) pool the rounds: the sum of lockstep's (or
trigger's, sync's) over the sum of base's. Sizes come from the environment (LOCKSTEP_OLTP_SECONDS, _SCALE,
_CLIENTS, _THREADS, _RUNNERS, _ROUNDS) or
``python -m lockstep.lab.bench_oltp --seconds 3 --scale 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from lockstep.db import APP_NAME
from lockstep.lab import scratch
from lockstep.migrate import migrate

JOB = "account_band"
DERIVED_SQL = """
create table public.account_band (
    aid     integer primary key references public.pgbench_accounts (aid) on delete cascade,
    band    text not null,
    balance integer not null
) with (fillfactor = 90);  -- rows rewritten in place: room on each page for HOT updates (docs/operations.md)
create function public.account_band_compute(keys integer[])
returns table (aid integer, band text, balance integer)
language sql stable
as $$
    select a.aid,
           case when a.abalance < -5000 then 'deep' when a.abalance < 0 then 'negative'
                when a.abalance < 5000 then 'low' else 'high' end,
           a.abalance
    from public.pgbench_accounts a
    where keys is null or a.aid = any(keys)
$$;
select lockstep.define_derived('account_band', 'public.account_band',
                               'public.account_band_compute(integer[])',
                               parent => 'public.pgbench_accounts', every => '1 day');
select lockstep.watch('account_band', 'public.pgbench_accounts', 'aid');
"""
# the sync reference (see the module's docstring): a row trigger on the UPDATE, nothing else; the band
# computed inline (account_band_compute's expression), so its one statement is a single index probe with a
# cached generic plan (through the compute function, planned at every call, it kept 67 % of base, not 90)
SYNC_FUNCTION_SQL = """
create function public.account_band_sync() returns trigger
language plpgsql
as $$
begin
    update public.account_band
    set band = case when new.abalance < -5000 then 'deep' when new.abalance < 0 then 'negative'
                    when new.abalance < 5000 then 'low' else 'high' end,
        balance = new.abalance
    where aid = new.aid;
    return null;
end;
$$;
"""
SYNC_ON_SQL = (
    "create trigger account_band_sync after update on public.pgbench_accounts"
    " for each row execute function public.account_band_sync()"
)
SYNC_OFF_SQL = "drop trigger account_band_sync on public.pgbench_accounts"
# set-up of a sync run, not measured: account_band equal to its compute (a base run left it behind)
REFRESH_SQL = """
update public.account_band b set band = c.band, balance = c.balance
from public.account_band_compute(null) c
where b.aid = c.aid and (b.band, b.balance) is distinct from (c.band, c.balance)
"""
DIVERGENCE_SQL = (
    "select count(*) from ((select * from public.account_band except all"
    " select * from public.account_band_compute(null)) union all"
    " (select * from public.account_band_compute(null) except all select * from public.account_band)) s"
)
LAG_SQL = (
    "select coalesce(extract(epoch from clock_timestamp() - min(enqueued_at)), 0)::float8, count(*),"
    " pg_total_relation_size('lockstep.queue') from lockstep.queue"
)
# server time one watched UPDATE pays for the trigger: single-row updates of pgbench_accounts (watched)
# against an unwatched twin, alternating in chunks of 1,000, the min of 10 chunks each
TWIN_SQL = """
create table public.accounts_twin as select * from public.pgbench_accounts where aid <= 20000;
alter table public.accounts_twin add primary key (aid);
analyze public.accounts_twin;
create temp table trigger_us (us float8);
"""
TRIGGER_US_DO = """
do $$
declare t0 timestamptz; i int; c int; k int; a float8 := 1e9; b float8 := 1e9;
begin
    for c in 1..10 loop
        t0 := clock_timestamp();
        for i in 1..1000 loop
            k := 1 + (c * 1000 + i) * 7919 % 20000;
            update public.accounts_twin set abalance = abalance + 1 where aid = k;
        end loop;
        a := least(a, extract(epoch from clock_timestamp() - t0) * 1e3);
        t0 := clock_timestamp();
        for i in 1..1000 loop
            k := 1 + (c * 1000 + i) * 7919 % 20000;
            update public.pgbench_accounts set abalance = abalance + 1 where aid = k;
        end loop;
        b := least(b, extract(epoch from clock_timestamp() - t0) * 1e3);
    end loop;
    insert into trigger_us values (b - a);
end $$;
"""
TRIGGER_US_SQL = TWIN_SQL + TRIGGER_US_DO
SEQ_SQL = "select coalesce(pg_sequence_last_value(pg_get_serial_sequence('lockstep.queue', 'id')), 0)"
RUNNER_BACKENDS_SQL = (
    "select pid from pg_stat_activity where application_name = %s and datname = current_database()"
)

Progress = Callable[[str], None]
SCENARIOS = (
    "base",
    "trigger",
    "lockstep",
    "wal",
    "wal_now",
    "decode",
    "sync",
)  # a round's order, every other
# the other way round; the floors' scenarios (wal_now, decode) run only when named
DEFAULT_SCENARIOS = ("base", "trigger", "lockstep", "wal", "sync")
LOGICAL_ONLY = ("wal", "wal_now", "decode")
CAPTURE_EVERY = 0.2  # the runner's default --capture-every: the decode scenario's schedule
DECODE_PUBLICATION = "lockstep_floor"
# one read of the decode scenario's slot, as lockstep._capture_read peeks it (up to the flushed WAL, at most
# 20,000 messages): messages, changes of pgbench_accounts, the last commit's LSN
DECODE_SQL = (
    "select count(*), count(*) filter (where get_byte(data, 0) in (73, 85, 68)),"
    " coalesce((max(lsn) filter (where get_byte(data, 0) = 67) - '0/0'::pg_lsn)::bigint, 0)"
    " from pg_logical_slot_peek_binary_changes(%s, '0/0'::pg_lsn + %s::numeric, 20000, 'proto_version', '1',"
    " 'publication_names', 'lockstep_floor')"
)
# the flushed WAL, the slot's confirmed position and its restart point, as numbers
DECODE_POS_SQL = (
    "select (pg_current_wal_flush_lsn() - '0/0'::pg_lsn)::bigint,"
    " (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint,"
    " (restart_lsn - '0/0'::pg_lsn)::bigint from pg_replication_slots where slot_name = %s"
)
# the server time of the capture and of its read (track_functions = pl in the scratch database)
FUNCTION_TIMES_SQL = (
    "select funcname, calls, total_time from pg_stat_user_functions"
    " where schemaname = 'lockstep' and funcname in ('capture', '_capture_read', 'run')"
)
# the trigger micro-measure again (the twin is TRIGGER_US_SQL's) with pgbench_accounts watched via the WAL
TRIGGER_US_AGAIN_SQL = "truncate trigger_us;" + TRIGGER_US_DO
PEEK_SQL = (
    "select count(*) from pg_logical_slot_peek_binary_changes((select slot from lockstep.capture_state),"
    " null, null, 'proto_version', '1', 'publication_names', 'lockstep_capture')"
)
CAPTURE_LAG_SQL = (
    "select coalesce((pg_current_wal_lsn() - queued_lsn)::bigint, 0) from lockstep.capture_status"
)


def _stderr(msg: str) -> None:
    print(f"oltp: {msg}", file=sys.stderr, flush=True)


def pg_bindir() -> Path:
    """PostgreSQL's binaries: $LOCKSTEP_PG_BIN, else ``pg_config --bindir``."""
    env = os.environ.get("LOCKSTEP_PG_BIN")
    if env:
        return Path(env)
    pg_config = shutil.which("pg_config")
    if pg_config:
        return Path(subprocess.run([pg_config, "--bindir"], capture_output=True, text=True).stdout.strip())
    return Path("/usr/lib/postgresql/15/bin")


def parse_pgbench(out: str) -> dict[str, Any]:
    """tps, latency and the UPDATE pgbench_accounts latency from ``pgbench -r`` output."""

    def num(pattern: str) -> float | None:
        m = re.search(pattern, out)
        return float(m.group(1)) if m else None

    upd = re.search(r"^\s*([\d.]+)\s+\d+\s+UPDATE pgbench_accounts", out, re.M) or re.search(
        r"^\s*([\d.]+)\s+UPDATE pgbench_accounts", out, re.M
    )
    return {
        "tps": num(r"tps = ([\d.]+) \(without initial connection time\)") or num(r"tps = ([\d.]+)"),
        "latency_ms": num(r"latency average = ([\d.]+) ms"),
        "transactions": int(num(r"number of transactions actually processed: (\d+)") or 0),
        "failed": int(num(r"number of failed transactions: (\d+)") or 0),
        "update_accounts_ms": float(upd.group(1)) if upd else None,
    }


def _process_cpu_ms(pid: int) -> float | None:
    """User + system CPU of a process of this host so far (ms), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) * 1000.0 / os.sysconf("SC_CLK_TCK")


class Oltp:
    def __init__(self, dsn: str, opts: dict[str, int], progress: Progress) -> None:
        self.dsn, self.opts, self.progress = dsn, opts, progress
        self.pgbench = str(pg_bindir() / "pgbench")
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.trigger_us: float | None = None  # measured once, in round 1
        self.logical = self.has_wal()
        self.unwatched_us: float | None = None  # the micro-measure with nothing watched (logical servers)

    def _pgbench(self, *args: str, timeout: float) -> str:
        p = subprocess.run(
            [self.pgbench, *args, self.dsn],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if p.returncode != 0:
            raise RuntimeError(f"pgbench {' '.join(args)} exited {p.returncode}: {p.stderr[-2000:]}")
        return p.stdout + p.stderr

    def _lsn(self) -> int:
        return int(self.conn.execute("select pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()[0])

    def load(self, rate: float | None = None) -> dict[str, Any]:
        """One pgbench run: its parsed output; at a fixed ``rate`` (tps, -R), also the p50 and p99 of its
        transactions' latency (ms, from pgbench's per-transaction log)."""
        o = self.opts
        logdir = Path(tempfile.mkdtemp(prefix="lockstep-oltp-rate-"))
        fixed = ["-R", f"{rate:.0f}", "-l", "--log-prefix", str(logdir / "tx")] if rate else []
        try:
            out = self._pgbench(
                "-M", "prepared", "-c", str(o["clients"]), "-j", str(o["threads"]), "-T", str(o["seconds"]),
                "-r", *fixed, timeout=o["seconds"] * 3 + 120,
            )  # fmt: skip
            r = parse_pgbench(out)
            if rate:
                lat = sorted(
                    int(line.split()[2]) / 1000.0
                    for f in logdir.glob("tx*")
                    for line in f.read_text().splitlines()
                )
                r.update(
                    rate=rate,
                    latency_p50_ms=scratch.percentile(lat, 0.5),
                    latency_p99_ms=scratch.percentile(lat, 0.99),
                )
            return r
        finally:
            shutil.rmtree(logdir, ignore_errors=True)

    def has_wal(self) -> bool:
        """The server can watch through the WAL (wal_level = logical)."""
        return self.conn.execute("show wal_level").fetchone()[0] == "logical"

    def _watch(self, via: str) -> None:
        self.conn.execute(
            "select lockstep.watch(%s, 'public.pgbench_accounts', 'aid', via => %s)", [JOB, via]
        )
        if via == "wal":
            self.conn.execute("select lockstep.capture()")  # the slot, made before the changes to read

    def wal(self, round_: int = 1, rate: float | None = None) -> dict[str, Any]:
        return self.lockstep(round_, via="wal", rate=rate)

    def capture_cost(self) -> dict[str, Any]:
        """Server CPU of the capture per change: pgbench for a few seconds with pgbench_accounts watched
        through the WAL and no runner, then one lockstep.capture() of all of it in a session of its own
        (its backend's CPU), after a bare pg_logical_slot_peek_binary_changes of the same changes (the
        decoding alone)."""
        self.progress("capture cost: watch via wal, pgbench 5 s with no runner, one capture")
        self._empty_queue()
        self._watch("wal")
        try:
            seconds = self.opts["seconds"]
            self.opts["seconds"] = 5
            try:
                txns = self.load()["transactions"]
            finally:
                self.opts["seconds"] = seconds
            with psycopg.connect(self.dsn, autocommit=True) as c:
                pid = c.info.backend_pid
                cpu0 = scratch.backend_cpu_ms(pid)
                c.execute(PEEK_SQL)
                cpu1 = scratch.backend_cpu_ms(pid)
                changes = c.execute("select changes from lockstep.capture(100000000)").fetchone()[0]
                cpu2 = scratch.backend_cpu_ms(pid)
        finally:
            self.conn.execute("select lockstep.unwatch(%s, 'public.pgbench_accounts')", [JOB])
            self._empty_queue()
        ok = None not in (cpu0, cpu1, cpu2) and changes
        return {
            "transactions": txns,
            "changes": changes,
            "decode_us_per_change": (cpu1 - cpu0) * 1000 / changes if ok else None,
            "capture_us_per_change": (cpu2 - cpu1) * 1000 / changes if ok else None,
        }

    def setup(self) -> None:
        """pgbench's tables, lockstep installed, account_band defined (unwatched) and filled."""
        self.progress(f"pgbench -i -s {self.opts['scale']} --foreign-keys")
        self._pgbench("-i", "-q", "-s", str(self.opts["scale"]), "--foreign-keys", timeout=1800)
        self.progress("lockstep: install, define account_band, measure the trigger")
        migrate(self.dsn)
        try:  # the capture's server time per call, for the lag's parts (sessions started from now on)
            self.conn.execute(f"alter database {self.conn.info.dbname} set track_functions = 'pl'")
        except psycopg.errors.InsufficientPrivilege:
            self.progress("track_functions not set (not a superuser): no capture times")
        self.conn.execute(DERIVED_SQL)
        self.conn.execute(TRIGGER_US_SQL)
        self.trigger_us = self.conn.execute("select us from trigger_us").fetchone()[0]
        self.conn.execute("select lockstep.unwatch(%s, 'public.pgbench_accounts')", [JOB])
        if self.logical:  # the same micro-measure unwatched: what a WAL-watched UPDATE is compared with
            self.conn.execute(TRIGGER_US_AGAIN_SQL)
            self.unwatched_us = self.conn.execute("select us from trigger_us").fetchone()[0]
        self.conn.execute("insert into public.account_band select * from public.account_band_compute(null)")
        self._empty_queue()
        self.conn.execute(SYNC_FUNCTION_SQL)

    def _measured_load(self) -> dict[str, Any]:
        """A checkpoint, then one pgbench run, with its WAL per transaction and the keys it enqueued (0 where
        nothing is watched)."""
        self.conn.execute("checkpoint")
        seq0 = self.conn.execute(SEQ_SQL).fetchone()[0]
        wal0 = self._lsn()
        r = self.load()
        r["wal_per_txn"] = (self._lsn() - wal0) / max(r["transactions"], 1)
        r["keys_enqueued"] = self.conn.execute(SEQ_SQL).fetchone()[0] - seq0
        return r

    def base(self, round_: int = 1) -> dict[str, Any]:
        self.progress(f"base {round_}: {self.opts['seconds']} s")
        return self._measured_load()

    def sync(self, round_: int = 1) -> dict[str, Any]:
        self.progress(f"sync {round_}: refresh account_band, then {self.opts['seconds']} s")
        self.conn.execute(REFRESH_SQL)
        self.conn.execute("vacuum analyze public.account_band")
        self.conn.execute(SYNC_ON_SQL)
        try:
            r = self._measured_load()
        finally:
            self.conn.execute(SYNC_OFF_SQL)
        r["divergence"] = self.conn.execute(DIVERGENCE_SQL).fetchone()[0]
        r["converged"] = r["divergence"] == 0
        return r

    def trigger(self, round_: int = 1) -> dict[str, Any]:
        self.progress(f"trigger {round_}: watch, no runner, {self.opts['seconds']} s")
        self._empty_queue()
        self.conn.execute("select lockstep.watch(%s, 'public.pgbench_accounts', 'aid')", [JOB])
        try:
            bytes0 = self._queue_bytes()
            r = self._measured_load()
            r["queue_bytes_start"] = bytes0
        finally:
            self.conn.execute("select lockstep.unwatch(%s, 'public.pgbench_accounts')", [JOB])
        return r

    def _empty_queue(self) -> None:
        """Set-up, not measured: every watched run starts on an empty queue file. VACUUM never shrinks it
        (vacuum_truncate = false), VACUUM FULL keeps what the oldest open transaction of the server may
        see, and the trigger run's ~200,000 entries had grown it to 38 MB, over which the next lockstep run
        inserted. TRUNCATE keeps the identity sequence (SEQ_SQL's counts)."""
        self.conn.execute("truncate lockstep.queue")

    def _queue_bytes(self) -> int:
        return int(self.conn.execute("select pg_relation_size('lockstep.queue')").fetchone()[0])

    def wal_now(self, round_: int = 1, rate: float | None = None) -> dict[str, Any]:
        """wal with the runners at --batch-wait 0: a worker pass as soon as a capture queued keys."""
        return self.lockstep(round_, via="wal", rate=rate, batch_wait=0.0)

    def lockstep(
        self,
        round_: int = 1,
        via: str = "trigger",
        rate: float | None = None,
        batch_wait: float | None = None,
    ) -> dict[str, Any]:
        name = "lockstep" if via == "trigger" else via if batch_wait is None else f"{via}_now"
        self.progress(f"{name} {round_}: watch, recompute")
        self._watch(via)
        trigger_us = self.trigger_us
        if via == "wal":  # what a WAL-watched UPDATE pays: the same micro-measure
            self.conn.execute(TRIGGER_US_AGAIN_SQL)
            trigger_us = self.conn.execute("select us from trigger_us").fetchone()[0]
            # its 20,000 updates read now (the recompute below covers them), not by the measured runners
            self.conn.execute("select lockstep.capture(100000000)")
        self._empty_queue()
        # the initial fill is set-up, not measured: in one transaction, so no hand-off is left for the runners
        self.conn.execute("select lockstep.set_batch_parents(%s, 1000000)", [JOB])
        self.conn.execute("select lockstep.recompute(%s)", [JOB])
        self.conn.execute("select lockstep.set_batch_parents(%s, 500)", [JOB])
        self.conn.execute("vacuum analyze public.account_band")
        self.conn.execute("checkpoint")
        bytes0 = self._queue_bytes()
        logdir = Path(tempfile.mkdtemp(prefix="lockstep-oltp-"))
        runners: list[tuple[subprocess.Popen, Any]] = []
        samples: list[tuple[float, int, int, float, int]] = []
        stop = threading.Event()
        try:
            for i in range(self.opts["runners"]):
                f = open(logdir / f"runner{i}.log", "w")  # noqa: SIM115 - closed below
                cmd = [sys.executable, "-m", "lockstep", "run", "--dsn", self.dsn, "--log-format", "json"]
                cmd += [] if batch_wait is None else ["--batch-wait", str(batch_wait)]
                runners.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f), f))
            seq0 = self.conn.execute(SEQ_SQL).fetchone()[0]
            wal0 = self._lsn()
            times0 = self._function_times()
            sampler = threading.Thread(target=self._sample, args=(samples, stop), daemon=True)
            sampler.start()
            self.progress(f"{name} {round_}: {self.opts['seconds']} s with {self.opts['runners']} runners")
            # CPU counted from when every runner is connected (its imports and start-up are not the worker's)
            deadline = time.monotonic() + 30
            while len(self._runner_backends_cpu()) < len(runners) and time.monotonic() < deadline:
                time.sleep(0.05)
            backends0 = self._runner_backends_cpu()
            runners0 = [_process_cpu_ms(p.pid) for p, _ in runners]
            r = self.load(rate)
            r["queue_bytes_start"] = bytes0
            stop.set()
            sampler.join()
            t0 = time.monotonic()
            depth = None
            end = self._lsn()
            while time.monotonic() - t0 < 120:
                # captured first: a capture that commits between the two reads adds keys after depth was read
                captured = via != "wal" or self._captured(end)
                depth = self.conn.execute("select count(*) from lockstep.queue").fetchone()[0]
                if depth == 0 and captured:
                    break
                time.sleep(0.05)
            r["drain_s"] = time.monotonic() - t0
            r["runner_cpu_ms"] = _cpu_delta(runners0, [_process_cpu_ms(p.pid) for p, _ in runners])
            backends1 = self._runner_backends_cpu()
            r["runner_backend_cpu_ms"] = _cpu_delta(
                [backends0.get(pid) for pid in backends1], list(backends1.values())
            )
            r["queue_left"] = depth
            r["wal_per_txn"] = (self._lsn() - wal0) / max(r["transactions"], 1)
            keys = self.conn.execute(SEQ_SQL).fetchone()[0] - seq0
        finally:
            for p, _ in runners:
                p.terminate()
            for p, f in runners:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                f.close()
        times = self._function_times_after(times0)
        work_ms, passes, pass_ms = 0.0, 0, []
        for log in logdir.glob("runner*.log"):
            for line in log.read_text().splitlines():
                if line.startswith("{"):
                    rec = json.loads(line)
                    fields = rec.get("fields", rec)
                    if fields.get("action") == "work" and fields.get("outcome") == "done":
                        work_ms += float(fields.get("ms") or 0)
                        pass_ms.append(float(fields.get("ms") or 0))
                        passes += 1
        shutil.rmtree(logdir, ignore_errors=True)
        lags = sorted(s[0] for s in samples)
        cpu = None
        if r["runner_cpu_ms"] is not None and r["runner_backend_cpu_ms"] is not None:
            cpu = r["runner_cpu_ms"] + r["runner_backend_cpu_ms"]
        r.update(
            unwatched_us_per_update=self.unwatched_us,
            worker_cpu_ms_per_key=cpu / keys if cpu is not None and keys else None,
            worker_backend_cpu_ms_per_key=r["runner_backend_cpu_ms"] / keys
            if r["runner_backend_cpu_ms"] is not None and keys
            else None,
            trigger_us_per_update=trigger_us,
            keys_enqueued=keys,
            worker_passes=passes,
            worker_ms=work_ms,
            worker_ms_per_key=work_ms / keys if keys else None,
            pass_ms_mean=work_ms / passes if passes else None,
            pass_ms_p50=scratch.percentile(sorted(pass_ms), 0.5) if pass_ms else None,
            pass_ms_max=max(pass_ms, default=None),
            **times,
            queue_lag_max_s=lags[-1] if lags else None,
            queue_lag_p50_s=scratch.percentile(lags, 0.5),
            queue_depth_max=max((s[1] for s in samples), default=None),
            queue_bytes_max=max((s[2] for s in samples), default=None),
            # [seconds into the load, oldest entry's age s, depth]: lockstep bench --plot draws it
            queue_series=[[round(s[3], 2), round(s[0], 3), s[1]] for s in samples],
            capture_lag_bytes_max=max((s[4] for s in samples), default=None) if via == "wal" else None,
            divergence=self.conn.execute(DIVERGENCE_SQL).fetchone()[0],
        )
        r["converged"] = r["queue_left"] == 0 and r["divergence"] == 0
        self.conn.execute("select lockstep.unwatch(%s, 'public.pgbench_accounts')", [JOB])
        return r

    def _function_times(self) -> dict[str, tuple[int, float]]:
        """funcname -> (calls, total ms) of lockstep.capture, _capture_read and run so far."""
        self.conn.execute("select pg_stat_clear_snapshot()")
        return {r[0]: (r[1], r[2]) for r in self.conn.execute(FUNCTION_TIMES_SQL).fetchall()}

    def _function_times_after(self, before: dict[str, tuple[int, float]]) -> dict[str, Any]:
        """The capture's calls and mean server ms per call (all calls, and those that read the slot) since
        ``before``, once the runners' backends are gone (a backend reports its counts when it exits)."""
        deadline = time.monotonic() + 10
        while self._runner_backends_cpu() and time.monotonic() < deadline:
            time.sleep(0.05)
        after = self._function_times()
        out: dict[str, Any] = {}
        for name, label in (("capture", "capture"), ("_capture_read", "capture_read"), ("run", "run")):
            calls = after.get(name, (0, 0.0))[0] - before.get(name, (0, 0.0))[0]
            ms = after.get(name, (0, 0.0))[1] - before.get(name, (0, 0.0))[1]
            out[f"{label}_calls"] = calls
            out[f"{label}_ms_mean"] = ms / calls if calls else None
        return out

    def decode(self, round_: int = 1) -> dict[str, Any]:
        """The decoding alone: a pgoutput slot of a publication of pgbench_accounts, read as the capture reads
        it on CAPTURE_EVERY's schedule by one long-lived session, which writes nothing; its backend's CPU per
        change, and the WAL each read decodes (from the slot's restart point) against the WAL new since."""
        self.progress(
            f"decode {round_}: a slot peeked and advanced every {CAPTURE_EVERY} s, {self.opts['seconds']} s"
        )
        slot = f"lockstep_floor_{os.getpid()}"
        self.conn.execute(f"create publication {DECODE_PUBLICATION} for table public.pgbench_accounts")
        self.conn.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", [slot])
        out: dict[str, Any] = {"calls": 0, "changes": 0, "decoded_bytes": 0, "new_bytes": 0}
        stop, ready = threading.Event(), threading.Event()
        reader = threading.Thread(target=self._drain_slot, args=(slot, out, stop, ready), daemon=True)
        try:
            reader.start()
            ready.wait(30)
            r = self._measured_load()
            stop.set()
            reader.join()
        finally:
            stop.set()
            self.conn.execute("select pg_drop_replication_slot(%s)", [slot])
            self.conn.execute(f"drop publication {DECODE_PUBLICATION}")
        calls, changes = out["calls"], out["changes"]
        r.update(
            decode_calls=calls,
            decode_changes=changes,
            decode_cpu_ms=out.get("cpu_ms"),
            decode_cpu_ms_per_change=out["cpu_ms"] / changes
            if out.get("cpu_ms") is not None and changes
            else None,
            decode_mb_per_call=out["decoded_bytes"] / calls / 1e6 if calls else None,
            decode_new_mb_per_call=out["new_bytes"] / calls / 1e6 if calls else None,
            decode_ms_mean=out.get("wall_ms", 0.0) / calls if calls else None,
        )
        return r

    def _drain_slot(
        self, slot: str, out: dict[str, Any], stop: threading.Event, ready: threading.Event
    ) -> None:
        """decode's reader: every CAPTURE_EVERY s, advance the slot to what the last read covered, then peek
        up to the flushed WAL (at most 20,000 messages; then up to the last commit read), as capture does."""
        with psycopg.connect(self.dsn, autocommit=True) as c:
            pid = c.info.backend_pid
            cpu0 = scratch.backend_cpu_ms(pid)
            ready.set()
            upto_prev, done = None, None
            while not stop.is_set():
                t0 = time.monotonic()
                flushed, confirmed, restart = c.execute(DECODE_POS_SQL, [slot]).fetchone()
                if done is not None and done > confirmed:
                    c.execute(
                        "select pg_replication_slot_advance(%s, '0/0'::pg_lsn + %s::numeric)", [slot, done]
                    )
                    confirmed = done
                if flushed > confirmed:
                    messages, changes, last_commit = c.execute(DECODE_SQL, [slot, flushed]).fetchone()
                    done = flushed if messages < 20000 else last_commit
                    if changes == 0:  # as the capture: nothing watched up to there, the slot moves at once
                        c.execute(
                            "select pg_replication_slot_advance(%s, '0/0'::pg_lsn + %s::numeric)",
                            [slot, done],
                        )
                    out["calls"] += 1
                    out["changes"] += changes
                    out["decoded_bytes"] += flushed - restart
                    out["new_bytes"] += flushed - (upto_prev if upto_prev is not None else confirmed)
                    out["wall_ms"] = out.get("wall_ms", 0.0) + (time.monotonic() - t0) * 1000
                    upto_prev = flushed
                stop.wait(max(0.0, CAPTURE_EVERY - (time.monotonic() - t0)))
            cpu1 = scratch.backend_cpu_ms(pid)
            out["cpu_ms"] = None if cpu0 is None or cpu1 is None else cpu1 - cpu0

    def _captured(self, lsn: int) -> bool:
        """The capture has queued the changes up to ``lsn``."""
        row = self.conn.execute(
            "select queued_lsn - '0/0'::pg_lsn >= %s from lockstep.capture_state", [lsn]
        ).fetchone()
        return bool(row and row[0])

    def _runner_backends_cpu(self) -> dict[int, float | None]:
        """pid -> CPU ms so far of the runners' server backends (application_name lockstep's)."""
        rows = self.conn.execute(RUNNER_BACKENDS_SQL, [APP_NAME]).fetchall()
        return {r[0]: scratch.backend_cpu_ms(r[0]) for r in rows}

    def _sample(self, samples: list[tuple[float, int, int, float, int]], stop: threading.Event) -> None:
        """Every 0.5 s: (oldest entry's age s, depth, queue bytes, seconds since the sampling began, WAL bytes
        since the LSN the capture queued up to (0 where the server cannot watch through the WAL))."""
        t0 = time.monotonic()
        with psycopg.connect(self.dsn, autocommit=True) as c:
            while not stop.wait(0.5):
                lag, depth, size = c.execute(LAG_SQL).fetchone()
                behind = c.execute(CAPTURE_LAG_SQL).fetchone() if self.logical else None
                samples.append((lag, depth, size, time.monotonic() - t0, behind[0] if behind else 0))

    def close(self) -> None:
        self.conn.close()


def _cpu_delta(before: list[float | None], after: list[float | None]) -> float | None:
    """Summed CPU ms between two samples of the same processes (a backend that started meanwhile counts
    from 0); None if any is unreadable at the end."""
    if not after or any(a is None for a in after):
        return None
    return sum(a - (b or 0.0) for b, a in zip(before, after, strict=True))  # type: ignore[operator]


def options(**overrides: int | None) -> dict[str, int]:
    env = {
        k: os.environ.get(f"LOCKSTEP_OLTP_{k.upper()}")
        for k in ("seconds", "scale", "clients", "threads", "runners", "rounds")
    }
    defaults = {"seconds": 60, "scale": 10, "clients": 8, "threads": 2, "runners": 2, "rounds": 2}
    return {k: int(overrides.get(k) or env[k] or v) for k, v in defaults.items()}


def _fixed_rate(bench: Oltp, rounds: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """base, lockstep and wal at a fixed rate: half of base's mean tps (what a server that is not saturated
    sees: the application's latency, not tps)."""
    rate = sum(rd["base"]["tps"] for rd in rounds) / len(rounds) / 2
    out: dict[str, Any] = {}
    for scenario in (n for n in ("base", "lockstep", "wal") if n in names):
        bench.progress(f"fixed rate {rate:.0f} tps: {scenario}")
        out[scenario] = bench.load(rate) if scenario == "base" else getattr(bench, scenario)(0, rate=rate)
    return out


def run(
    admin_dsn: str | None, progress: Progress = _stderr, scenarios: str | None = None, **overrides: int | None
) -> dict[str, Any]:
    """The OLTP section in a scratch database of its own; the result dict. ``scenarios``: a comma list of
    SCENARIOS to run (default: all; wal only where wal_level = logical)."""
    opts = options(**overrides)
    chosen = (scenarios or os.environ.get("LOCKSTEP_OLTP_SCENARIOS") or ",".join(DEFAULT_SCENARIOS)).split(
        ","
    )
    name = f"lockstep_oltp_{os.getpid()}"
    extra: dict[str, Any] = {}
    try:
        progress(f"create database {name}")
        bench = Oltp(scratch.create_database(admin_dsn or "", name), opts, progress)
        try:
            bench.setup()
            names = [n for n in SCENARIOS if n in chosen and (n not in LOGICAL_ONLY or bench.logical)]
            extra["wal_level"] = bench.conn.execute("show wal_level").fetchone()[0]
            rounds = []
            for i in range(1, opts["rounds"] + 1):
                rd: dict[str, Any] = {}
                for scenario in names if i % 2 else names[::-1]:
                    rd[scenario] = getattr(bench, scenario)(i)
                rounds.append(rd)
            if "wal" in names:
                extra["capture"] = bench.capture_cost()
                extra["fixed_rate"] = _fixed_rate(bench, rounds, names)
        finally:
            bench.close()
    finally:
        scratch.drop_database(admin_dsn or "", name)
    for r in rounds:
        for side in ("lockstep", "trigger", "wal", "wal_now", "decode", "sync"):
            if side in r:
                r["tps_pct_of_base" if side == "lockstep" else f"{side}_pct"] = (
                    100.0 * r[side]["tps"] / r["base"]["tps"] if r["base"]["tps"] else None
                )

    def total(side: str, k: str) -> float | None:
        vals = [r[side][k] for r in rounds if side in r]
        if not vals:
            return None
        return None if any(v is None for v in vals) else sum(vals)

    def ratios(side: str) -> dict[str, float | None]:
        """side's tps as % of base, added ms per UPDATE and WAL ratio, rounds pooled"""
        tps, upd, wal = (total(side, k) for k in ("tps", "update_accounts_ms", "wal_per_txn"))
        tps_b, upd_b, wal_b = (total("base", k) for k in ("tps", "update_accounts_ms", "wal_per_txn"))
        return {
            "tps_pct_of_base": 100.0 * tps / tps_b if tps_b and tps is not None else None,
            "added_ms_per_update": None if upd_b is None or upd is None else (upd - upd_b) / len(rounds),
            "wal_ratio": wal / wal_b if wal_b and wal is not None else None,
        }

    tps_l, tps_s = total("lockstep", "tps"), total("sync", "tps")
    return {
        "options": opts,
        "base": rounds[0]["base"],
        "lockstep": rounds[0].get("lockstep"),
        "rounds": rounds,
        **ratios("lockstep"),
        "trigger": ratios("trigger"),
        "sync": ratios("sync"),
        **{side: ratios(side) for side in ("wal", "wal_now", "decode") if side in rounds[0]},
        **extra,
        "lockstep_pct_of_sync": 100.0 * tps_l / tps_s if tps_s and tps_l is not None else None,
    }


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def render(r: dict[str, Any]) -> str:
    o = r["options"]
    rounds = r.get("rounds") or [{"base": r["base"], "lockstep": r["lockstep"], "tps_pct_of_base": None}]
    lines = [
        f"oltp: pgbench tpcb-like -M prepared, scale {o['scale']}, {o['clients']} clients,"
        f" {o['threads']} threads, {o['seconds']} s, {len(rounds)} round(s) alternating;"
        f" lockstep: watch on pgbench_accounts -> account_band, {o['runners']} runners",
        f"  {'':11} {'tps':>9} {'lat ms':>7} {'UPDATE acc ms':>13} {'WAL B/txn':>10} {'txns':>8}",
    ]
    for i, rd in enumerate(rounds, 1):
        for scenario in (k for k in rd if k in SCENARIOS):  # in the order the round ran them
            label, x = f"{scenario} {i}", rd[scenario]
            lines.append(
                f"  {label:11} {_f(x['tps'], '{:,.0f}'):>9} {_f(x['latency_ms'], '{:.3f}'):>7}"
                f" {_f(x['update_accounts_ms'], '{:.3f}'):>13} {_f(x['wal_per_txn'], '{:,.0f}'):>10}"
                f" {x['transactions']:>8}"
            )
    ran = rounds[0]  # the scenarios run (--scenarios, and wal only where wal_level = logical)
    per_round = ", ".join(_f(rd.get("tps_pct_of_base"), "{:.1f} %") for rd in rounds)
    lines += (
        []
        if "lockstep" not in ran
        else [
            f"  lockstep tps: {_f(r['tps_pct_of_base'], '{:.1f}')} % of base, rounds pooled ({per_round})"
            " (target >= 75 %);"
            f" added per UPDATE: {_f(r['added_ms_per_update'], '{:.3f}')} ms (target <= 0.1);"
            f" WAL {_f(r['wal_ratio'])}x base (target <= 2)",
            f"  trigger: {_f(rounds[0]['lockstep']['trigger_us_per_update'], '{:.1f}')} µs server time per"
            " watched single-row UPDATE (target <= 20)",
        ]
    )

    def reference(side: str, label: str) -> str:
        """side's pooled figures and its rounds' tps as % of base"""
        x = r[side]
        per_round = ", ".join(_f(rd.get(f"{side}_pct"), "{:.1f} %") for rd in rounds)
        return (
            f"  {label}: {_f(x['tps_pct_of_base'], '{:.1f}')} % of base ({per_round}); added per UPDATE:"
            f" {_f(x['added_ms_per_update'], '{:.3f}')} ms; WAL {_f(x['wal_ratio'])}x base"
        )

    if "trigger" in ran:
        lines.append(
            reference(
                "trigger",
                "trigger alone (watch, no runner: the write path's cost, into an ever-growing queue)",
            )
        )
    if "sync" in ran:
        lines.append(
            reference(
                "sync",
                "sync (reference: a row trigger rewriting account_band in the application's transaction)",
            )
            + f"; converged {all(rd['sync']['converged'] for rd in rounds)}; lockstep's tps"
            f" {_f(r.get('lockstep_pct_of_sync'), '{:.1f}')} % of sync's"
        )
    for i, rd in enumerate(rounds if "lockstep" in ran else [], 1):
        ls = rd["lockstep"]
        lines += [
            f"  round {i}: worker {_f(ls['worker_ms_per_key'], '{:.3f}')} ms per queued key (wall, under the"
            " load)"
            f" ({ls['keys_enqueued']:,} keys, {ls['worker_passes']} passes,"
            f" {_f(ls['worker_ms'], '{:,.0f}')} ms); CPU {_f(ls.get('worker_cpu_ms_per_key'), '{:.3f}')} ms"
            f" per key (runner processes and their backends; backends alone"
            f" {_f(ls.get('worker_backend_cpu_ms_per_key'), '{:.3f}')})",
            f"  round {i}: queue oldest entry p50 {_f(ls['queue_lag_p50_s'])} s,"
            f" max {_f(ls['queue_lag_max_s'])} s (target <= 1 s), depth max {ls['queue_depth_max']},"
            f" size max {_f(ls['queue_bytes_max'], '{:,}')} B, drained {_f(ls['drain_s'])} s after the load",
            f"  round {i}: converged {ls['converged']} (queue left {ls['queue_left']},"
            f" divergence {ls['divergence']})",
        ]
    if "wal" in ran:
        lines += _render_wal(r, rounds, reference("wal", "wal (watched through the WAL: no trigger)"))
    if "wal_now" in ran:
        lines += _render_wal(
            r, rounds, reference("wal_now", "wal_now (wal, runners at --batch-wait 0)"), side="wal_now"
        )
    lines += _render_floors(r, rounds, ran, reference)
    return "\n".join(lines)


def _render_floors(
    r: dict[str, Any], rounds: list[dict[str, Any]], ran: dict[str, Any], reference: Callable[[str, str], str]
) -> list[str]:
    """The lag's parts per round (lockstep, wal, wal_now), the decode scenario, the floors side by side."""
    lines = []
    for i, rd in enumerate(rounds, 1):
        for side in (s for s in ("lockstep", "wal", "wal_now") if s in ran):
            x = rd[side]
            capture = (
                ""
                if side == "lockstep"
                else f"capture {x.get('capture_calls')} calls,"
                f" mean {_f(x.get('capture_ms_mean'), '{:.1f}')} ms"
                f" (reading the slot: {x.get('capture_read_calls')} calls, mean"
                f" {_f(x.get('capture_read_ms_mean'), '{:.1f}')} ms); "
            )
            lines.append(
                f"  round {i}: {side} lag parts: {capture}worker pass mean"
                f" {_f(x.get('pass_ms_mean'), '{:.1f}')}"
                f" ms, p50 {_f(x.get('pass_ms_p50'), '{:.1f}')}, max {_f(x.get('pass_ms_max'), '{:.1f}')}"
                f" ({x['worker_passes']} passes); queue oldest p50 {_f(x['queue_lag_p50_s'])} s,"
                f" max {_f(x['queue_lag_max_s'])} s (target <= 1 s)"
            )
    if "decode" in ran:
        lines.append(reference("decode", "decode alone (a slot peeked and advanced every 0.2 s, no queue)"))
        for i, rd in enumerate(rounds, 1):
            d = rd["decode"]
            lines.append(
                f"  round {i}: decode: {d['decode_calls']} reads, {d['decode_changes']:,} changes, server CPU"
                f" {_f(d['decode_cpu_ms_per_change'], '{:.4f}')} ms per change, mean"
                f" {_f(d['decode_ms_mean'], '{:.1f}')} ms per read; each read decoded"
                f" {_f(d['decode_mb_per_call'], '{:.1f}')} MB of WAL for"
                f" {_f(d['decode_new_mb_per_call'], '{:.1f}')}"
                " MB new"
            )
    if "sync" in ran and "wal" in ran:
        floor = (
            f"  floors: WAL sync {_f(r['sync']['wal_ratio'])}x base (the derived rows' own writes, no queue)"
        )
        floor += f" against wal {_f(r['wal']['wal_ratio'])}x"
        if "decode" in ran:
            floor += (
                f"; tps decode {_f(r['decode']['tps_pct_of_base'], '{:.1f}')} % of base against wal"
                f" {_f(r['wal']['tps_pct_of_base'], '{:.1f}')} %"
            )
        lines.append(floor)
    return lines


def _render_wal(
    r: dict[str, Any], rounds: list[dict[str, Any]], summary: str, side: str = "wal"
) -> list[str]:
    """The wal (or wal_now) scenario's lines: its summary, per round; for wal, the capture's cost and the
    fixed-rate runs."""
    lines = [summary + f" (server at wal_level = {r.get('wal_level')})"]
    for i, rd in enumerate(rounds, 1):
        w = rd[side]
        lines.append(
            f"  round {i}: {side}: a WAL-watched UPDATE pays {_f(w['trigger_us_per_update'], '{:.1f}')} µs,"
            f" unwatched {_f(w.get('unwatched_us_per_update'), '{:.1f}')} µs (target: within 1);"
            f" runners' CPU (capture, worker) {_f(w.get('worker_cpu_ms_per_key'), '{:.3f}')}"
            f" ms per key; queue oldest p50 {_f(w['queue_lag_p50_s'])} s, max {_f(w['queue_lag_max_s'])} s;"
            f" capture lag max {_f(w.get('capture_lag_bytes_max'), '{:,}')} B of WAL;"
            f" drained {_f(w['drain_s'])} s after; converged {w['converged']}"
        )
    c = r.get("capture") if side == "wal" else None
    if c:
        lines.append(
            f"  capture: one call read {c['changes']:,} changes ({c['transactions']:,} transactions):"
            f" {_f(c['capture_us_per_change'], '{:.1f}')} µs server CPU per change (target <= 20);"
            f" the decoding alone (a bare peek) {_f(c['decode_us_per_change'], '{:.1f}')} µs"
        )
    for scenario, x in (r.get("fixed_rate") or {}).items() if side == "wal" else ():
        lines.append(
            f"  fixed rate {_f(x['rate'], '{:,.0f}')} tps (half of base): {scenario:8} latency p50"
            f" {_f(x['latency_p50_ms'], '{:.3f}')} ms, p99 {_f(x['latency_p99_ms'], '{:.3f}')} ms,"
            f" tps {_f(x['tps'], '{:,.0f}')}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lockstep.lab.bench_oltp", description=__doc__.split("\n")[0])
    ap.add_argument("--dsn", default=os.environ.get("DATABASE_URL", ""), help="admin DSN")
    for k in ("seconds", "scale", "clients", "threads", "runners", "rounds"):
        ap.add_argument(f"--{k}", type=int, default=None)
    ap.add_argument("--scenarios", default=None, help="comma list of " + ",".join(SCENARIOS))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    r = run(
        a.dsn,
        scenarios=a.scenarios,
        seconds=a.seconds,
        scale=a.scale,
        clients=a.clients,
        threads=a.threads,
        runners=a.runners,
        rounds=a.rounds,
    )
    print(json.dumps(r, indent=2, default=str) if a.json else render(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
