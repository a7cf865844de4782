"""``lockstep diff``, ``pause``, ``resume`` and ``backfill`` as real processes (docs/controls.md)."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import threading

from runner_procs import wait_for

from lockstep.lab.example import JOB, divergence


def cli(dsn: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lockstep", *args, "--dsn", dsn],
        capture_output=True,
        text=True,
        timeout=120,
    )


def change_exams(conn, ids: range) -> None:
    conn.execute(
        "update example.exam set body = body || ' zebrafish' || id::text where id = any(%s)", [list(ids)]
    )


def test_diff_shows_the_changed_parents_with_totals_and_writes_nothing(ex, example_dsn):
    change_exams(ex, range(1, 51))
    before = ex.execute("select count(*), sum(weight) from example.exam_key").fetchone()
    p = cli(example_dsn, "diff", JOB, "--json", "--limit", "3")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["job"] == JOB and out["parents"] == 50
    assert out["actions"]["insert"]["parents"] == 50
    assert len(out["actions"]["insert"]["examples"]) == 3
    assert ex.execute("select count(*), sum(weight) from example.exam_key").fetchone() == before
    text = cli(example_dsn, "diff", JOB)
    assert text.returncode == 0, text.stderr
    assert "50 parent(s) would change" in text.stdout and "insert:" in text.stdout
    keys = cli(example_dsn, "diff", JOB, "--keys", "3,60", "--keys", "61", "--json")
    assert json.loads(keys.stdout)["parents"] == 1, keys.stderr
    bad = cli(example_dsn, "diff", "nope")
    assert bad.returncode != 0 and "LSJ01" in bad.stderr + bad.stdout


def test_pause_keeps_status_healthy_while_the_queue_waits_then_resume(ex, example_dsn):
    p = cli(example_dsn, "pause", JOB)
    assert p.returncode == 0 and "paused since" in p.stdout, p.stderr
    change_exams(ex, range(1, 11))
    ex.execute("update lockstep.queue set enqueued_at = now() - interval '1 hour'")  # an old lag
    st = subprocess.run(
        [sys.executable, "-m", "lockstep", "status", "--dsn", example_dsn, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert st.returncode == 0, st.stderr  # paused: its lag is shown, not alarmed
    row = next(r for r in json.loads(st.stdout) if r["job"] == JOB)
    assert row["paused_at"] is not None and row["paused_by"] == ex.info.user and row["queue_depth"] > 0
    once = subprocess.run(
        [sys.executable, "-m", "lockstep", "run", "--once", "--dsn", example_dsn],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert once.returncode == 0, once.stderr
    assert divergence(ex) != (0, 0)  # the runner skipped the paused job
    r = cli(example_dsn, "resume", JOB)
    assert r.returncode == 0 and "resumed" in r.stdout, r.stderr
    assert json.loads(cli(example_dsn, "resume", JOB, "--json").stdout) == {"job": JOB, "resumed": False}
    b = cli(example_dsn, "backfill", JOB)
    assert b.returncode == 0, b.stderr
    assert divergence(ex) == (0, 0)


def test_backfill_shows_progress_lines_and_converges(ex, example_dsn):
    ex.execute("select lockstep.set_batch_parents(%s, 20)", [JOB])
    change_exams(ex, range(1, 201))
    ex.execute("delete from lockstep.queue")
    p = cli(example_dsn, "backfill", JOB)
    assert p.returncode == 0, p.stderr
    lines = [x for x in p.stdout.splitlines() if x.startswith(f"backfill {JOB}:")]
    assert lines and "parents done" in lines[-1] and "to do" in lines[-1] and "ETA" in lines[-1]
    assert lines[-1].startswith(f"backfill {JOB}: 200/200 parents done, 0 to do")
    assert re.fullmatch(rf"{JOB}: backfill done: 200 parents in \d+ passes", p.stdout.splitlines()[-1])
    assert divergence(ex) == (0, 0)
    assert ex.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
    j = cli(example_dsn, "backfill", JOB, "--json")  # the progress goes to stderr then
    assert j.returncode == 0 and json.loads(j.stdout)["state"] == "done", j.stderr


def test_backfill_stops_cleanly_between_batches_on_sigint(ex, example_dsn):
    """Each pass takes at least 50 ms (a slow compute) and there are 100: the SIGINT sent after the first
    progress line lands before the end, and the backfill stops after the batch it is writing."""
    ex.execute(
        "create function example.slow_keys(ids bigint[])"
        " returns table (exam_id bigint, key text, weight integer) language sql"
        " as $$ select k.* from (select pg_sleep(0.05)) s, example.exam_key_compute(ids) k $$"
    )
    ex.execute("update lockstep.job set compute = 'example.slow_keys(bigint[])', batch_parents = 2")
    change_exams(ex, range(1, 201))
    ex.execute("delete from lockstep.queue")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockstep", "backfill", JOB, "--dsn", example_dsn],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first.startswith(f"backfill {JOB}:"), first
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert "backfill interrupted" in out and "stays queued for the runner" in out
    assert "Traceback" not in err
    left = ex.execute("select count(distinct key) from lockstep.queue").fetchone()[0]
    assert 0 < left < 200
    # what it wrote is whole: the parents still queued are the only ones that differ
    ex.execute("update lockstep.job set compute = 'example.exam_key_compute(bigint[])'")
    wrong = ex.execute(
        "select count(distinct exam_id) from (select exam_id, key, weight from example.exam_key_compute(null)"
        " except all select exam_id, key, weight from example.exam_key) s"
        " where exam_id::text not in (select key from lockstep.queue)"
    ).fetchone()[0]
    assert wrong == 0


def test_backfill_on_a_terminal_draws_a_progress_bar(ex, example_dsn):
    ex.execute("select lockstep.set_batch_parents(%s, 50)", [JOB])
    change_exams(ex, range(1, 201))
    ex.execute("delete from lockstep.queue")
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def read_screen() -> None:  # read as it is written: a full terminal buffer would stop the process
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal's other end is closed: all read
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read_screen)
    reader.start()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lockstep", "backfill", JOB, "--dsn", example_dsn],
            stdout=slave,
            stderr=subprocess.PIPE,
            text=True,
        )
        os.close(slave)
        _, err = proc.communicate(timeout=120)
        reader.join(timeout=30)
    finally:
        os.close(master)
    text = b"".join(chunks).decode("utf-8", "replace")
    assert proc.returncode == 0, text + err
    assert "backfill exam_keys" in text and "200/200" in text and "\u2501" in text  # rich's bar
    assert "parents done" not in text  # the plain lines are for non-terminals
    assert "backfill done: 200 parents" in text
    assert divergence(ex) == (0, 0)


CHAIN_SQL = """
create table public.exam_count (n bigint not null,
    exam_id bigint primary key references example.exam on delete cascade);
create function public.exam_counts(ids bigint[]) returns table (exam_id bigint, n bigint) language sql
    as $$ select k.exam_id, count(*) from example.exam_key k
          where ids is null or k.exam_id = any(ids) group by 1 $$;
select lockstep.define_derived('counts', 'public.exam_count', 'public.exam_counts(bigint[])', 'example.exam',
                               every => '1 day');
select lockstep.watch('counts', 'example.exam_key', 'exam_id');
select lockstep.recompute('counts');
"""


def chain_wrong(conn) -> int:
    """Rows of the second table (counts of exam_key per exam) that differ from what it should hold."""
    return (
        conn.execute(
            "select count(*) from (select exam_id, n from public.exam_counts(null)"
            " except all select exam_id, n from public.exam_count) s"
        ).fetchone()[0]
        + conn.execute(
            "select count(*) from (select exam_id, n from public.exam_count"
            " except all select exam_id, n from public.exam_counts(null)) s"
        ).fetchone()[0]
    )


def test_a_chain_of_two_jobs_converges_under_application_writes_with_two_runners(
    ex, exconnect, example_dsn, runners
):
    ex.execute(CHAIN_SQL)
    ex.execute("delete from lockstep.queue")
    a = runners(example_dsn, "--batch-wait", "0")
    b = runners(example_dsn, "--batch-wait", "0")
    app = exconnect()
    for i in range(60):  # the application's writes while both runners work the chain
        app.execute(
            "update example.exam set body = body || ' w' || %s where id = any(%s)",
            [str(i), [(i * 7 + k) % 200 + 1 for k in range(5)]],
        )
        if i % 10 == 0:
            app.execute(
                "insert into example.exam_item (exam_id, body) values (%s, 'extra words here')", [i + 1]
            )
    app.execute("delete from example.exam where id in (190, 191)")
    try:
        wait_for(lambda: divergence(ex) == (0, 0) and chain_wrong(ex) == 0, timeout=120, what="convergence")
    except AssertionError as exc:  # say where it stands, and what the runners said
        state = ex.execute(
            "select job, queue_depth, last_outcome, last_error from lockstep.status"
        ).fetchall()
        raise AssertionError(
            f"{exc}: divergence {divergence(ex)}, chain {chain_wrong(ex)}, status {state}\n"
            + "\n".join(r.stderr[-3000:] for r in (a, b))
        ) from exc
    for r in (a, b):
        r.signal(signal.SIGTERM)
        assert r.wait() == 0
        assert "Traceback" not in r.stderr and "40P01" not in r.stderr and " ERROR " not in r.stderr, r.stderr


def test_backfill_of_a_difference_that_fits_in_one_batch_says_so(ex, example_dsn):
    change_exams(ex, range(1, 4))
    p = cli(example_dsn, "backfill", JOB)
    assert p.returncode == 0, p.stderr
    assert f"backfill {JOB}: the whole difference in one pass:" in p.stdout
    assert divergence(ex) == (0, 0)
    # it ended with "backfill done: 0 parents in 2 passes", after "... one pass: 9 rows written (1 passes)"
    assert re.fullmatch(
        rf"{JOB}: backfill done: [1-9]\d* rows written in (1 pass|\d+ passes)", p.stdout.splitlines()[-1]
    )
    assert "1 passes" not in p.stdout, p.stdout


def test_resume_says_a_recompute_is_due_only_for_a_derived_job(ex, example_dsn):
    """A generic job has no recompute: `lockstep resume` of one said "its full recompute is due"."""
    ex.execute("create function public.tidy() returns void language sql as 'select'")
    ex.execute("select lockstep.define_job('tidy', 'public.tidy()')")
    for job, said in (("tidy", "tidy: resumed"), (JOB, f"{JOB}: resumed; its full recompute is due")):
        assert cli(example_dsn, "pause", job).returncode == 0
        r = cli(example_dsn, "resume", job)
        assert (r.returncode, r.stdout.strip()) == (0, said), r.stderr


def test_diff_keys_of_a_job_without_a_parent_says_to_leave_the_keys_out(ex, example_dsn):
    """diff --keys of a job without a parent said the job "has no queue" and to use lockstep.recompute(),
    which writes: such a job's difference is previewed whole, by diff without --keys."""
    ex.execute(
        "create table public.exam_count (one int primary key, n bigint not null);"
        " create function public.exam_count_of(keys int[]) returns table (one int, n bigint)"
        " language sql stable as $$ select 1, count(*) from example.exam $$;"
        " select lockstep.define_derived('exam_count', 'public.exam_count', 'public.exam_count_of(int[])')"
    )
    p = cli(example_dsn, "diff", "exam_count", "--keys", "1")
    assert p.returncode == 1, p.stderr
    assert "LSJ02" in p.stderr and "preview it whole" in p.stderr and "without --keys" in p.stderr, p.stderr
    assert "recompute" not in p.stderr and "queue" not in p.stderr, p.stderr
    whole = cli(example_dsn, "diff", "exam_count", "--json")
    assert whole.returncode == 0 and json.loads(whole.stdout)["parents"] == 1, whole.stderr
