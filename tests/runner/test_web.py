"""``lockstep web``: the page's data against a real database, its HTTP surface, least privilege.

The browser test (real headless Chromium) is tests/runner/test_web_browser.py.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import psycopg
import pytest
from history_fixtures import as_role, make_roles_fixture, setup_workload  # noqa: F401  (make_roles)
from util import snapshot

from lockstep import web


@pytest.fixture
def server() -> Iterator[Callable[..., str]]:
    """``server(dsn, **options) -> "127.0.0.1:port"``: lockstep web in a thread, stopped at teardown."""
    started: list = []

    def _start(dsn: str, **kw) -> str:
        srv = web.make_server(web.Options(dsn=dsn, port=0, **kw), web.Sampler(min_gap=0))
        t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        t.start()
        started.append((srv, t))
        host, port = srv.server_address[:2]
        return f"{host}:{port}"

    yield _start
    for srv, t in started:
        srv.shutdown()
        srv.server_close()
        t.join()


def request(
    addr: str, method: str = "GET", path: str = "/", headers: dict | None = None
) -> tuple[int, dict, str]:
    c = http.client.HTTPConnection(addr, timeout=30)
    try:
        c.request(method, path, headers=headers or {})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    finally:
        c.close()


def test_page_data_matches_the_database(ex):
    setup_workload(ex)
    data = web.collect(ex, web.Sampler())
    jobs = {j["job"]: j for j in data["jobs"]}
    assert sorted(jobs) == ["boom", "exam_keys", "ok"]
    boom, ek, ok = jobs["boom"], jobs["exam_keys"], jobs["ok"]
    assert (boom["kind"], boom["lock_group"], boom["schedule"]) == ("job", "alarms", "call every 10 min")
    assert (boom["last_outcome"], boom["consecutive_failures"], boom["last_error"]) == (
        "failed",
        1,
        "boom: the disk is on fire",
    )
    assert ek["schedule"] == "recompute every 1 day; worker on the queue"
    assert (ek["last_outcome"], ek["last_action"]) == ("done", "work")
    queued = ex.execute("select count(*) from lockstep.queue").fetchone()[0]
    # 30 new keys, key 13 waiting for its retry, parked key 42's entry
    assert ek["queue_depth"] == queued == 32
    assert (ek["parked_keys"], ek["failing_keys"]) == (1, 1)
    # next run: what lockstep.due() says (the worker has ready keys: now), else next_run_at
    due = dict(ex.execute("select job, due_at from lockstep.due()").fetchall())
    assert (boom["next_run"], ok["next_run"]) == (due["boom"], due["ok"])
    assert ek["next_run"] == data["generated_at"]  # due now: the transaction's now()
    assert ok["next_run"] > data["generated_at"]  # every 1 hour, just ran
    assert data["totals"] == {
        "jobs": 3,
        "failing_jobs": 1,
        "queue_depth": 32,
        "parked_keys": 1,
        "failing_keys": 1,
    }
    assert [(k["key"], k["parked"]) for k in data["keys"]] == [("42", True), ("13", False)]
    assert data["keys"][0]["last_error"] == "exam 42: title is not valid text" and data["keys_total"] == 2
    runs = ex.execute("select id, job, outcome from lockstep.run_log order by id desc").fetchall()
    assert [(r["id"], r["job"], r["outcome"]) for r in data["runs"]] == runs
    assert [r[1] for r in runs] == ["exam_keys", "boom", "ok", "exam_keys"]  # the template's recompute too
    assert data["errors"] == {} and data["role"] == "root"
    assert ek["recompute_progress"] is None
    assert data["capture"] is None  # nothing watched through the WAL: no capture section
    assert 'id="capture"' not in web.render(data, 5)


def test_page_serves_it_and_changes_nothing(ex, example_dsn, server):
    setup_workload(ex)
    before = snapshot(ex, "lockstep.run_log")
    addr = server(example_dsn, refresh=7)
    status, headers, body = request(addr)
    assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
    assert "script-src" not in headers["content-security-policy"]  # default-src 'none': no script at all
    assert "<script" not in body
    assert '<meta http-equiv="refresh" content="7">' in body
    for job in ("boom", "exam_keys", "ok"):
        assert f'<tr data-job="{job}"' in body
    assert '<td class="num queue-depth">32</td>' in body
    assert '<td class="last-error">boom: the disk is on fire</td>' in body
    assert 'data-key="42"' in body and 'data-key="13"' in body
    assert body.count('<svg class="chart"') == 2  # run durations, rows written
    assert "collecting samples" in body  # the queue trend needs a second sample
    body = request(addr)[2]
    assert body.count('<svg class="chart"') == 3 and "collecting samples" not in body
    assert 'id="queue-total">32<' in body
    status, headers, body = request(addr, path="/data.json")
    assert status == 200 and json.loads(body)["totals"]["queue_depth"] == 32
    assert snapshot(ex, "lockstep.run_log") == before


def test_queue_depth_trend_is_sampled_at_each_request(ex):
    setup_workload(ex)
    sampler = web.Sampler(min_gap=0)
    web.collect(ex, sampler)
    ex.execute("select lockstep.enqueue('exam_keys', array[200, 201, 202]::bigint[])")
    data = web.collect(ex, sampler)
    assert [s["total"] for s in data["queue_trend"]] == [32, 35]
    assert [s["jobs"]["exam_keys"] for s in data["queue_trend"]] == [32, 35]
    html = web.render(data, 5)
    assert 'aria-label="queue depth over time"' in html and 'aria-label="queue depth trend"' in html


def test_samples_closer_than_min_gap_replace_the_last_one(ex):
    sampler = web.Sampler(min_gap=3600)
    web.collect(ex, sampler)
    ex.execute("select lockstep.enqueue('exam_keys', array[1, 2]::bigint[])")
    data = web.collect(ex, sampler)
    assert [s["total"] for s in data["queue_trend"]] == [2]


def test_recompute_progress_shows_while_a_recompute_is_spread_over_batches(ex):
    setup_workload(ex)
    assert "recompute-progress" not in web.render(web.collect(ex, web.Sampler()), 5)  # none in progress
    # a recompute of 50 changed parents with batch_parents 10: one batch written, 40 handed to the queue
    ex.execute(
        "create schema wb;"
        " create table wb.acc (id int primary key, bal int not null);"
        " create table wb.band (id int primary key references wb.acc on delete cascade, band text not null);"
        " create function wb.bands(keys int[]) returns table (id int, band text) language sql stable"
        " as $$ select a.id, case when a.bal < 0 then 'neg' else 'pos' end from wb.acc a"
        "       where keys is null or a.id = any(keys) $$;"
        " insert into wb.acc select g, g - 25 from generate_series(1, 50) g;"
        " select lockstep.define_derived('bands', 'wb.band', 'wb.bands(int[])', 'wb.acc', every => '1 day');"
        " select lockstep.set_batch_parents('bands', 10);"
        " select lockstep.recompute('bands');"
    )
    data = web.collect(ex, web.Sampler())
    assert {j["job"]: j["recompute_progress"] for j in data["jobs"]} == {
        "bands": {"done": 10, "total": 50, "rate": None, "eta_s": None},  # one sample: no rate yet
        "boom": None,
        "exam_keys": None,
        "ok": None,
    }
    html = web.render(data, 5)
    assert html.count('class="recompute-progress"') == 1
    assert '<progress max="50" value="10"></progress> <span class="recompute-progress">10 / 50' in html
    # a later page, after a worker pass of the hand-off: the rate and the time left, from the two samples
    sampler = web.Sampler()
    web.collect(ex, sampler)
    ex.execute("select lockstep.work('bands')")
    later = web.collect(ex, sampler)
    prog = next(j["recompute_progress"] for j in later["jobs"] if j["job"] == "bands")
    assert prog["done"] == 20 and prog["rate"] > 0 and prog["eta_s"] > 0
    assert 'class="recompute-rate"' in web.render(later, 5)


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "BREW"])
def test_no_method_but_get_and_head(ex, example_dsn, server, method):
    setup_workload(ex)
    before = snapshot(ex, "lockstep.run_log")
    addr = server(example_dsn)
    status, headers, body = request(addr, method, "/data.json")
    assert (status, headers["allow"]) == (405, "GET, HEAD"), body
    assert snapshot(ex, "lockstep.run_log") == before


def test_head_unknown_paths_and_foreign_host_headers(example_dsn, server):
    addr = server(example_dsn)
    status, headers, body = request(addr, "HEAD")
    assert status == 200 and body == "" and int(headers["content-length"]) > 1000
    assert request(addr, path="/admin")[0] == 404
    assert request(addr, path="/?x=1")[0] == 200
    # a name that resolves to 127.0.0.1 through someone else's DNS (rebinding) gets nothing
    assert request(addr, headers={"Host": "attacker.example:8765"})[0] == 400
    assert request(addr, headers={"Host": f"localhost:{addr.rsplit(':', 1)[1]}"})[0] == 200


def test_default_options_bind_to_localhost():
    assert (web.Options().host, web.Options().port) == ("127.0.0.1", 8765)


def test_ipv6_loopback(example_dsn, server):
    try:
        addr = server(example_dsn, host="::1")
    except OSError as exc:  # no IPv6 on this machine
        pytest.skip(f"cannot bind ::1: {exc}")
    host, port = addr.rsplit(":", 1)
    assert request(f"[{host}]:{port}")[0] == 200


def test_a_malformed_dsn_is_refused_at_start():
    p = subprocess.run(
        [sys.executable, "-m", "lockstep", "web", "--dsn", "nonsense", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 2 and "Invalid value for '--dsn'" in p.stderr, p.stderr


def test_an_unreachable_database_gives_a_503_page_that_keeps_refreshing(server, example_dsn):
    addr = server(example_dsn + "_missing")
    status, _, body = request(addr)
    assert status == 503 and 'id="error"' in body and "does not exist" in body
    assert '<meta http-equiv="refresh"' in body
    status, _, body = request(addr, path="/data.json")
    assert status == 503 and "does not exist" in json.loads(body)["error"]


def test_a_pool_of_bounded_size_answers_503_when_every_connection_is_busy(example_dsn):
    """Each request opened a connection of its own: 25 concurrent requests opened 18 backends."""
    srv = web.make_server(
        web.Options(dsn=example_dsn, port=0, connections=2, pool_wait=0.2), web.Sampler(min_gap=0)
    )
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    addr = "{}:{}".format(*srv.server_address[:2])
    try:
        assert request(addr, path="/data.json")[0] == 200
        held = [srv.pool.getconn(timeout=30) for _ in range(2)]  # every connection the pool may open
        status, _, body = request(addr, path="/data.json")
        assert status == 503 and "busy" in json.loads(body)["error"]
        status, _, body = request(addr)
        assert status == 503 and 'id="error"' in body
        assert srv.pool.get_stats()["pool_size"] == 2
        for c in held:
            srv.pool.putconn(c)
        assert request(addr, path="/data.json")[0] == 200
    finally:
        srv.shutdown()
        srv.server_close()
        t.join()


def test_user_data_is_escaped(ex):
    ex.execute(
        "create function public.x() returns void language plpgsql"
        " as $$ begin raise exception '<script>alert(1)</script>'; end $$;"
        " select lockstep.define_job('<img src=x onerror=alert(1)>', 'public.x()');"
        " select lockstep.run('<img src=x onerror=alert(1)>');"
    )
    html = web.render(web.collect(ex, web.Sampler()), 5)
    assert "<script" not in html and "<img" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert 'data-job="&lt;img src=x onerror=alert(1)&gt;"' in html


# least privilege --------------------------------------------------------------------------------------


def test_a_role_that_may_read_only_the_history_sees_its_own_runs(ex, example_dsn, make_roles, server):
    """Views the role may not read become one line each; rows of other owners are absent; no error."""
    setup_workload(ex)
    owner = make_roles(example_dsn, "owner")
    viewer = make_roles(
        example_dsn,
        "viewer",
        "grant usage on schema lockstep to {role}",
        "grant select on lockstep.run_log to {role}",
        member_of=(owner,),
    )
    ex.execute("update lockstep.run_log set owner = %s where job = 'ok'", [owner])
    addr = server(as_role(example_dsn, viewer))
    status, _, body = request(addr)
    assert status == 200
    assert f'<b id="role">{viewer}</b>' in body
    assert 'data-section="status"' in body and "permission denied for view status" in body
    assert 'data-section="keys"' in body and "permission denied for view failing_keys" in body
    assert "no jobs visible to this role" in body
    data = json.loads(request(addr, path="/data.json")[2])
    assert [r["job"] for r in data["runs"]] == ["ok"]
    assert sorted(data["errors"]) == ["capture", "due", "keys", "status"]


def test_a_role_with_no_privilege_at_all_still_gets_the_page(example_dsn, make_roles, server):
    nobody = make_roles(example_dsn, "nobody")
    addr = server(as_role(example_dsn, nobody))
    status, _, body = request(addr)
    assert status == 200, body
    assert "permission denied for schema lockstep" in body
    data = json.loads(request(addr, path="/data.json")[2])
    assert sorted(data["errors"]) == ["capture", "due", "keys", "runs", "status"]
    assert data["jobs"] == [] and data["runs"] == []


VIEWER = [  # the viewer recipe of docs/web.md
    "grant usage on schema lockstep to {role}",
    "grant select on lockstep.status, lockstep.parked_keys, lockstep.failing_keys, lockstep.run_log"
    " to {role}",
    "grant select on lockstep.job, lockstep.job_state, lockstep.queue, lockstep.key_failure,"
    " lockstep.recompute_flag, lockstep.viewer to {role}",
    "grant select on lockstep.capture_status, lockstep.capture_state, lockstep.wal_watch, lockstep.setting"
    " to {role}",
]


def test_the_documented_viewer_role_reads_every_section(ex, example_dsn, make_roles, server):
    setup_workload(ex)
    owner = make_roles(example_dsn, "owner")
    viewer = make_roles(example_dsn, "viewer", *VIEWER)
    ex.execute("insert into lockstep.viewer values (%s, %s)", [viewer, owner])  # the jobs it may read
    ex.execute("update lockstep.job set owner = %s", [owner])  # with row security on status too: all its
    ex.execute("update lockstep.run_log set owner = %s where job = 'boom'", [owner])  # one job's runs
    data = json.loads(request(server(as_role(example_dsn, viewer)), path="/data.json")[2])
    assert data["errors"] == {}
    assert data["totals"]["queue_depth"] == 32 and data["keys_total"] == 2
    assert [r["job"] for r in data["runs"]] == ["boom"]  # row security: its owner role's runs only
    # and it reads only: the recipe granted the owner role before, which is the owner's rights and
    # SET ROLE to it (the "viewer" deleted derived rows and dropped tables)
    with psycopg.connect(as_role(example_dsn, viewer), autocommit=True) as v:
        for stmt in (
            "delete from example.exam_key",
            f"set role {owner}",
            "select lockstep.set_max_attempts('exam_keys', 1)",
            "delete from lockstep.queue",
            "insert into lockstep.viewer values (current_user, 'root')",
        ):
            try:
                v.execute(stmt)
            except psycopg.Error as exc:
                assert exc.sqlstate in ("42501", "22023"), (stmt, exc)
            else:
                raise AssertionError(f"the viewer could run {stmt!r}")
    assert ex.execute("select count(*) from lockstep.queue").fetchone()[0] > 0


def test_a_paused_job_and_a_chain_show_on_the_page(ex):
    """lockstep.pause: paused since, by whom (its due_at is infinity); a job that watches another job's
    target: the jobs it runs after."""
    ex.execute(
        "create table public.exam_count (n bigint not null,"
        " exam_id bigint primary key references example.exam on delete cascade);"
        " create function public.exam_counts(ids bigint[]) returns table (exam_id bigint, n bigint)"
        " language sql as $$ select k.exam_id, count(*) from example.exam_key k"
        " where ids is null or k.exam_id = any(ids) group by 1 $$;"
        " select lockstep.define_derived('counts', 'public.exam_count', 'public.exam_counts(bigint[])',"
        " 'example.exam', every => '1 day');"
        " select lockstep.watch('counts', 'example.exam_key', 'exam_id');"
        " select lockstep.pause('exam_keys');"
    )
    html = web.render(web.collect(ex, web.Sampler()), 5)
    assert html.count('class="flag paused"') == 1 and "paused since" in html
    assert '<div class="depends-on muted">after exam_keys</div>' in html
