"""``lockstep run``: real processes against real PostgreSQL."""

from __future__ import annotations

import logging
import random
import signal
import subprocess
import sys
import threading
import time

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from runner_procs import SLOW_FN, in_slow_call, runner_backends, wait_for

from lockstep.lab.example import JOB, divergence

TICK_FN = """
create table public.ticks (id bigserial primary key, at timestamptz not null default clock_timestamp());
create function public.tick_fn() returns void language sql as $$ insert into public.ticks default values $$;
select lockstep.define_job('t', 'public.tick_fn()', every => '1 second');
"""


def once(dsn: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lockstep", "run", "--dsn", dsn, "--once", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def ticks(conn) -> int:
    return conn.execute("select count(*) from public.ticks").fetchone()[0]


def assert_clean(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert " ERROR " not in stderr and " WARNING " not in stderr, stderr


def test_once_converges_the_example_and_exits_0(ex, example_dsn):
    ex.execute("update example.exam_item set body = body || ' zebra' where exam_id % 3 = 0")
    ex.execute("delete from example.exam where id % 7 = 0")
    assert ex.execute("select queue_depth from lockstep.status where job = %s", [JOB]).fetchone()[0] > 50
    assert divergence(ex) != (0, 0)
    p = once(example_dsn)
    assert p.returncode == 0, p.stderr
    assert divergence(ex) == (0, 0)
    assert ex.execute("select queue_depth from lockstep.status where job = %s", [JOB]).fetchone()[0] == 0
    assert "exam_keys work done" in p.stderr or "exam_keys recompute done" in p.stderr, p.stderr
    assert_clean(p.stderr)


def test_an_infinite_next_run_does_not_stop_the_runner(ex, example_dsn):
    # an owner may set a job's next_run_at = 'infinity' (never again): the runner's due() computed
    # due_at - now() for it, 22008 "cannot subtract infinite timestamps", and every other job stopped too
    # (exit 1 with --once, retried with backoff for ever in a loop)
    ex.execute("update lockstep.job_state set next_run_at = 'infinity' where job = %s", [JOB])
    ex.execute("update example.exam_item set body = body || ' zebra' where exam_id % 3 = 0")
    p = once(example_dsn)
    assert p.returncode == 0, p.stderr
    assert divergence(ex) == (0, 0)
    assert_clean(p.stderr)
    ex.execute("update lockstep.job_state set next_run_at = '-infinity' where job = %s", [JOB])
    p = once(example_dsn)
    assert p.returncode == 0 and "exam_keys recompute done" in p.stderr, p.stderr


def test_once_exits_1_when_a_run_fails(conn, dsn):
    conn.execute(
        "create function public.boom() returns void language plpgsql"
        " as $$ begin raise exception 'boom'; end $$;"
        " select lockstep.define_job('b', 'public.boom()', every => '1 second')"
    )
    p = once(dsn, "--log-format", "json")
    assert p.returncode == 1, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("{")]
    assert any('"outcome": "failed"' in ln and '"error": "boom"' in ln for ln in lines), p.stderr
    # nothing due any more (backoff): a second --once runs nothing and succeeds
    p = once(dsn)
    assert p.returncode == 0, p.stderr


def test_the_servers_warnings_reach_the_runners_log_once_in_a_while(conn, dsn):
    """A run's server WARNING (a run it may not log, say) went only to the server log: the runner dropped
    it. It is logged, each text at most once per WARN_EVERY."""
    conn.execute(
        "create function public.warns() returns void language plpgsql"
        " as $$ begin raise warning 'disk nearly full' using hint = 'add a disk'; end $$;"
        " select lockstep.define_job('w', 'public.warns()', every => '1 second')"
    )
    p = once(dsn)
    assert p.returncode == 0, p.stderr
    assert "server: disk nearly full (hint: add a disk)" in p.stderr, p.stderr

    from lockstep import loop

    class Diag:
        severity_nonlocalized, message_primary, message_hint, sqlstate = (
            "WARNING",
            "run not logged",
            None,
            "01000",
        )

    runner = loop.Runner(loop.Options(dsn=dsn))
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    loop.log.addHandler(handler)
    try:
        runner._server_warning(Diag())
        runner._server_warning(Diag())  # the same text again at once: not logged again
        Diag.severity_nonlocalized = "NOTICE"
        runner._server_warning(Diag())
    finally:
        loop.log.removeHandler(handler)
    assert logged == ["server: run not logged"]


def test_loop_runs_a_job_repeatedly_and_sigterm_exits_0(conn, dsn, runners):
    conn.execute(TICK_FN)
    # --tick 600: the runner must wake for the job's due time (every 1 second), not for its tick; a runner
    # that slept a whole tick would run once in the test's lifetime
    r = runners(dsn, "--tick", "600")
    wait_for(lambda: ticks(conn) >= 3, timeout=30, what="3 runs (the runner wakes when the job is due)")
    r.signal(signal.SIGTERM)
    assert r.wait() == 0
    assert_clean(r.stderr)
    assert r.stderr.count("t call done") >= 3
    gaps = [
        g
        for (g,) in conn.execute(
            "select extract(epoch from at - lag(at) over (order by id)) from public.ticks offset 1"
        )
    ]
    assert all(g >= 0.95 for g in gaps), gaps  # never before it is due (each run schedules the next at +1 s)


def test_two_runners_keep_the_recompute_on_schedule_under_a_stream_of_enqueues(
    ex, exconnect, example_dsn, runners
):
    ex.execute(
        "select lockstep.define_derived('exam_keys', 'example.exam_key',"
        " 'example.exam_key_compute(bigint[])',"
        " parent => 'example.exam', parent_column => 'exam_id', every => '2 seconds')"
    )
    ex.execute("update lockstep.job_state set next_run_at = now() where job = 'exam_keys'")
    a = runners(example_dsn, "--log-format", "json")
    b = runners(example_dsn, "--log-format", "json")
    wait_for(lambda: len(runner_backends(ex)) == 2, what="two runners connected")

    stop = threading.Event()
    writes = [0]

    def stream():
        w = exconnect()
        rng = random.Random(5)
        while not stop.is_set():
            ids = rng.sample(range(1, 201), 3)
            w.execute(
                "update example.exam_item set body = body || ' w' || %s where exam_id = any(%s)",
                [rng.randint(1, 50), ids],
            )
            writes[0] += 1
            time.sleep(0.01)

    def recomputes_done() -> int:
        return sum(
            1
            for x in a.json_lines() + b.json_lines()
            if x.get("action") == "recompute" and x.get("outcome") == "done"
        )

    t = threading.Thread(target=stream)
    t.start()
    # events, not a wall-clock window: the periodic recompute keeps happening while the stream writes
    # (a starved recompute never reaches the count), and the stream wrote between the first and the last
    try:
        wait_for(lambda: recomputes_done() >= 1, timeout=60, what="a first recompute during the stream")
        writes_at_first = writes[0]
        wait_for(lambda: recomputes_done() >= 4, timeout=60, what="3 more recomputes during the stream")
        writes_at_last = writes[0]
        assert t.is_alive()
    finally:
        stop.set()
        t.join()
    assert writes_at_last > writes_at_first, (writes_at_first, writes_at_last)
    wait_for(
        lambda: (
            ex.execute("select queue_depth from lockstep.status where job = 'exam_keys'").fetchone()[0] == 0
        ),
        timeout=10,
        what="queue drained",
    )
    assert divergence(ex) == (0, 0)
    for r in (a, b):
        r.signal()
    assert a.wait() == 0 and b.wait() == 0
    lines = a.json_lines() + b.json_lines()
    recomputes = [x for x in lines if x.get("action") == "recompute" and x.get("outcome") == "done"]
    works = [x for x in lines if x.get("action") == "work" and x.get("outcome") == "done"]
    assert len(recomputes) >= 4, len(recomputes)
    assert works, "the queue was worked, not only recomputed"
    assert not [x for x in lines if x["level"] in ("warning", "error")], lines


@pytest.mark.parametrize("check_interval", [None, "100ms"])
def test_kill_9_inside_a_slow_job_frees_the_group_for_another_runner(conn, dsn, runners, check_interval):
    """Without client_connection_check_interval PostgreSQL notices the dead client only when the statement
    ends (pg_sleep does not write to the socket), so the orphaned backend keeps the group lock until it is
    terminated; with it (PGOPTIONS), the backend ends by itself within the interval."""
    conn.execute(SLOW_FN)
    env = {"PGOPTIONS": f"-c client_connection_check_interval={check_interval}"} if check_interval else None
    a = runners(dsn, "--tick", "0.2", env=env)
    pid = wait_for(lambda: in_slow_call(conn), what="runner A inside slow_fn")
    b = runners(dsn, "--tick", "0.2")
    wait_for(lambda: len(runner_backends(conn)) == 2, what="runner B connected")
    a.proc.kill()
    a.proc.wait()

    def backend_alive() -> bool:
        return bool(conn.execute("select 1 from pg_stat_activity where pid = %s", [pid]).fetchone())

    if check_interval is None:
        time.sleep(0.5)  # give the server a chance to notice (it does not: documented behaviour)
        assert backend_alive(), "PostgreSQL ended the orphaned backend by itself"
        assert ticks(conn) == 0  # still locked: B only gets busy
        conn.execute("select pg_terminate_backend(%s)", [pid])
    wait_for(lambda: not backend_alive(), timeout=5, what="orphaned backend gone")
    assert (
        conn.execute(
            "select count(*) from pg_locks where locktype = 'advisory' and pid = %s", [pid]
        ).fetchone()[0]
        == 0
    )
    wait_for(lambda: ticks(conn) == 1, timeout=3, what="runner B ran the job")
    b.signal()
    assert b.wait() == 0
    assert "slow call done" in b.stderr


def test_reconnects_after_its_backend_is_terminated(conn, dsn, runners):
    conn.execute(TICK_FN)
    r = runners(dsn, "--tick", "0.2")
    wait_for(lambda: ticks(conn) >= 1, what="first run")
    (pid,) = runner_backends(conn)
    conn.execute("select pg_terminate_backend(%s)", [pid])
    new = wait_for(lambda: [p for p in runner_backends(conn) if p != pid], what="new backend")
    assert len(new) == 1
    n = ticks(conn)
    wait_for(lambda: ticks(conn) >= n + 2, timeout=5, what="runs after reconnect")
    r.signal()
    assert r.wait() == 0
    err = r.stderr
    assert "Traceback" not in err, err
    warnings = [ln for ln in err.splitlines() if " WARNING " in ln or " ERROR " in ln]
    assert len(warnings) == 1 and "retrying with backoff" in warnings[0], err
    assert len([ln for ln in err.splitlines() if "recovered after" in ln]) == 1, err


def _sleeping(conn) -> bool:
    """The only runner backend is idle after polling the queue's sequence: the runner is in its wait."""
    rows = conn.execute(
        "select state = 'idle' and query like '%%pg_sequence_last_value%%'"
        " from pg_stat_activity where application_name = 'lockstep-runner' and datname = current_database()"
    ).fetchall()
    return len(rows) == 1 and rows[0][0]


def test_new_keys_wake_a_sleeping_runner_before_its_tick(ex, example_dsn, runners):
    ex.execute(
        "update lockstep.job_state set next_run_at = now() + interval '1 hour' where job = 'exam_keys'"
    )
    # --tick 600 and nothing due for an hour: only the queue sequence's move can wake the runner in time
    r = runners(example_dsn, "--tick", "600")
    wait_for(lambda: _sleeping(ex), what="runner asleep")
    ex.execute("update example.exam_item set body = body || ' notify' where exam_id in (1, 2, 3)")
    wait_for(
        lambda: (
            ex.execute("select queue_depth from lockstep.status where job = 'exam_keys'").fetchone()[0] == 0
        ),
        timeout=30,
        what="queue worked (the sequence poll woke the runner; its next tick is 600 s away)",
    )
    assert divergence(ex) == (0, 0)
    r.signal()
    assert r.wait() == 0
    assert_clean(r.stderr)


def test_sigterm_finishes_the_current_call_and_a_second_signal_cancels_it(conn, dsn, runners):
    conn.execute("create table public.cfg (secs float8); insert into public.cfg values (2)")
    conn.execute(SLOW_FN.replace("pg_sleep(30)", "pg_sleep((select secs from public.cfg))"))
    r = runners(dsn, "--tick", "0.2")
    pid = wait_for(lambda: in_slow_call(conn), what="runner inside slow_fn")
    r.signal(signal.SIGTERM)
    time.sleep(0.3)  # the runner must not exit while its call runs (not a lock check: the process is polled)
    assert r.proc.poll() is None
    assert in_slow_call(conn) == pid
    assert r.wait(timeout=10) == 0  # the call finished (2 s), then the runner exited
    assert ticks(conn) == 1
    assert_clean(r.stderr)

    # a slow first call again, and two signals: the call is cancelled, exit 1, nothing recorded
    conn.execute("update public.cfg set secs = 30")
    conn.execute("select setval('public.calls', 1, false)")
    conn.execute("update lockstep.job_state set next_run_at = now() where job = 'slow'")
    runs = conn.execute("select runs from lockstep.job_state where job = 'slow'").fetchone()[0]
    r = runners(dsn, "--tick", "0.2")
    pid = wait_for(lambda: in_slow_call(conn), what="runner inside slow_fn again")
    r.signal(signal.SIGTERM)
    r.signal(signal.SIGINT)
    assert r.wait(timeout=10) == 1
    wait_for(lambda: in_slow_call(conn) is None, timeout=5, what="slow call cancelled")
    locks = conn.execute("select count(*) from pg_locks where locktype = 'advisory' and pid = %s", [pid])
    assert locks.fetchone()[0] == 0
    assert conn.execute("select runs from lockstep.job_state where job = 'slow'").fetchone()[0] == runs
    assert ticks(conn) == 1
    assert "cancelling backend" in r.stderr


def test_metrics_endpoint_counts_runs(conn, dsn, runners):
    pytest.importorskip("prometheus_client")
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conn.execute(TICK_FN)
    r = runners(dsn, "--tick", "0.2", "--metrics-port", str(port))
    wait_for(lambda: ticks(conn) >= 1, what="first run")

    def scrape() -> str:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        except OSError:
            return ""

    text = wait_for(
        lambda: 'lockstep_runs_total{job="t",outcome="done"}' in (t := scrape()) and t, what="metrics"
    )
    assert "lockstep_run_seconds_bucket" in text and "lockstep_runner_retries_total 0.0" in text
    text = wait_for(lambda: 'lockstep_parked_keys{job="t"} 0.0' in (t := scrape()) and t, what="gauges")
    assert 'lockstep_queue_depth{job="t"} 0.0' in text

    # the liveness gauge moves at every tick, idle or not (lockstep_runs_total does not)
    def last_tick() -> float:
        line = next(
            (x for x in scrape().splitlines() if x.startswith("lockstep_runner_last_tick_seconds ")), ""
        )
        return float(line.split()[1]) if line else 0.0

    first = wait_for(last_tick, what="last tick")
    wait_for(lambda: last_tick() > first, what="a later tick")
    r.signal()
    assert r.wait() == 0


def test_backoff_is_full_jitter_exponential_capped():
    import random as _random

    from lockstep.errors import Backoff

    b = Backoff(base=0.1, cap=10.0, rng=_random.Random(1))
    ceilings = [min(10.0, 0.1 * 2**i) for i in range(12)]
    pauses = [b.next() for _ in ceilings]
    assert all(0 <= p <= c for p, c in zip(pauses, ceilings, strict=True))
    assert max(pauses) > 1.0  # grows
    b.reset()
    assert b.next() <= 0.1


def test_once_with_an_unknown_job_exits_4_before_running_any(conn, dsn):
    """A typo in --job is permanent: exit 4 at start, naming it and the jobs there are; nothing runs."""
    conn.execute(TICK_FN)
    p = once(dsn, "--job", "nope", "--job", "t")
    assert p.returncode == 4
    errors = [ln for ln in p.stderr.splitlines() if " ERROR " in ln]
    assert len(errors) == 1 and "no job nope" in errors[0], p.stderr
    assert "t call done" not in p.stderr and ticks(conn) == 0


def test_connect_options(dsn):
    from lockstep import db

    assert db.looks_like_pooler("host=pgb port=6432 dbname=x")
    assert db.looks_like_pooler("postgresql://u@pgb:6432/x")
    assert not db.looks_like_pooler(dsn) and not db.looks_like_pooler(None)
    with db.connect(dsn) as c:
        assert c.autocommit and c.prepare_threshold is not None
        assert c.execute("show application_name").fetchone()[0] == "lockstep-runner"
    with db.connect(dsn, prepare=False) as c:
        assert c.prepare_threshold is None


def test_an_application_name_of_the_operators_own_is_kept(dsn, monkeypatch):
    """The DSN's application_name (or $PGAPPNAME) names the runner's sessions: it was replaced by
    lockstep-runner while the start-up line showed the DSN's."""
    from lockstep import db

    with db.connect(make_conninfo(dsn, application_name="billing-worker")) as c:
        assert c.execute("show application_name").fetchone()[0] == "billing-worker"
    monkeypatch.setenv("PGAPPNAME", "ops-runner-2")
    with db.connect(dsn) as c:
        assert c.execute("show application_name").fetchone()[0] == "ops-runner-2"


def test_waits_for_a_database_that_refuses_connections_then_runs(conn, dsn, admin_dsn, runners):
    """Like a server down or restarting at start: retry with backoff, one warning, one recovery line."""
    conn.execute(TICK_FN)
    dbname = conn.info.dbname
    conn.close()
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(f'alter database "{dbname}" allow_connections false')
        r = runners(dsn, "--tick", "0.2")
        wait_for(lambda: "retrying with backoff" in r.stderr, what="a retry warning")
        time.sleep(1.0)  # several retries (backoff), still one warning line
        assert r.proc.poll() is None
        admin.execute(f'alter database "{dbname}" allow_connections true')
    with psycopg.connect(dsn, autocommit=True) as c:
        wait_for(lambda: ticks(c) >= 1, what="a run once the database accepts connections")
    wait_for(lambda: "recovered after" in r.stderr, timeout=3, what="recovery line")
    r.signal()
    assert r.wait() == 0
    warnings = [ln for ln in r.stderr.splitlines() if " WARNING " in ln or " ERROR " in ln]
    assert len(warnings) == 1 and "not currently accepting connections" in warnings[0], r.stderr
    assert "Traceback" not in r.stderr


def test_connection_losses_between_good_runs_do_not_stretch_the_backoff(conn, dsn, runners):
    """The backoff grew with every error until a whole tick succeeded; a tick that drains a backlog never
    ended between two connection losses, so the pauses grew to seconds although every reconnect worked
    Here the job's compute ends its own
    backend at every other pass: each loss follows a good run, so each is a first retry."""
    conn.execute(
        """
        create table public.kp (id int primary key);
        create table public.kd (id int primary key references public.kp on delete cascade);
        create sequence public.kill_seq;
        create function public.kf(ids int[]) returns table (id int) language plpgsql as $$
        begin
            if nextval('public.kill_seq') % 2 = 0 and currval('public.kill_seq') <= 16 then
                perform pg_terminate_backend(pg_backend_pid());
            end if;
            return query select p.id from public.kp p where ids is null or p.id = any(ids);
        end $$;
        insert into public.kp select generate_series(1, 20);
        select lockstep.define_derived('k', 'public.kd', 'public.kf(int[])', 'public.kp', every => '1 day');
        select lockstep.set_batch_parents('k', 2);
        update lockstep.job_state set next_run_at = now() + interval '1 day' where job = 'k';
        select lockstep.enqueue('k', array(select generate_series(1, 20)));
        """
    )
    r = runners(dsn, "--tick", "0.2")
    wait_for(
        lambda: conn.execute("select count(*) from public.kd").fetchone()[0] == 20, timeout=30, what="drained"
    )
    r.signal()
    assert r.wait() == 0
    err = r.stderr
    assert "Traceback" not in err, err
    recovered = [ln for ln in err.splitlines() if "recovered after" in ln]
    assert len(recovered) >= 6, err  # before: one, at the end
    assert all("after 1 retry" in ln for ln in recovered), recovered


def test_a_jobs_plain_set_does_not_outlive_its_call_on_the_runners_connection(conn, dsn):
    """A generic job whose code ran `set statement_timeout = '100ms'` (meant for itself) changed the
    runner's session: every job after it on that connection ran with it, failed, and parked healthy keys;
    at '1' ms the runner never recovered; its SET ROLE stayed, its DateStyle crashed the
    runner. The runner resets every setting to the session's start values after each call, in
    the same transaction; its own (here from the startup packet) and its application_name stay."""
    from lockstep import db

    conn.execute(
        "create function leaky() returns void language plpgsql as $$ begin"
        " set statement_timeout = '1'; set lock_timeout = '1'; set idle_session_timeout = '1';"
        " set default_transaction_read_only = on; set application_name = 'mine';"
        " set datestyle = 'SQL, DMY'; set search_path = nowhere; set role none; end $$;"
        " select lockstep.define_job('leaky', 'leaky()')"
    )
    settings = (
        "select current_setting('statement_timeout'), current_setting('lock_timeout'),"
        " current_setting('idle_session_timeout'), current_setting('default_transaction_read_only'),"
        " current_setting('client_connection_check_interval'), current_setting('datestyle'),"
        " current_setting('search_path'), current_setting('application_name')"
    )
    with db.connect(dsn, check_interval="2s") as c:
        before = c.execute(settings).fetchone()
        assert db.run_job(c, "leaky").outcome == "done"
        assert c.execute(settings).fetchone() == before and before[4] == "2s"
        assert c.execute("select now()").fetchone()[0] is not None  # parses: DateStyle ISO again
        conn.execute("update lockstep.job_state set next_run_at = now() where job = 'leaky'")
        assert db.run_job(c, "leaky").outcome == "done"  # it ran at all: not read-only, no 1 ms timeout


def test_a_job_that_changes_client_encoding_does_not_crash_the_runner(conn, dsn):
    """A job's `set client_encoding = 'LATIN1'` sent the call's result row in LATIN1, and the reset in the
    same message put UTF8 back before the server said so: psycopg decoded LATIN1 as UTF8 and the runner
    died with a UnicodeDecodeError, a traceback and exit 1. The call is a job error now
    (the runner backs that job off and goes on), and the connection is UTF8 again."""
    from lockstep import db

    conn.execute(
        "create function enc() returns void language plpgsql"
        " as $$ begin set client_encoding = 'LATIN1'; end $$;"
        " select lockstep.define_job('été', 'enc()')"
    )
    with db.connect(dsn) as c:
        with pytest.raises(psycopg.DataError, match="does its code SET client_encoding"):
            db.run_job(c, "été")
        assert c.execute("select current_setting('client_encoding'), 'été'").fetchone() == ("UTF8", "été")
