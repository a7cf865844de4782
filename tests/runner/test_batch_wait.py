"""``lockstep run --batch-wait``: after a worker pass that left less than a full batch ready, keys gather
for one larger pass instead of one pass each (a steady write load then costs fewer, cheaper passes). A
backlog (a pass that took a full batch and left another full batch ready) is drained at once, and
``--once`` never waits.

The runner loop runs in this process against a real database; only its clock and its sleep are the test's
(``time.monotonic`` is advanced by hand, ``_sleep`` records how long the loop asked to wait), so the
schedule is deterministic and nothing here sleeps.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from lockstep import loop

SCHEMA_SQL = """
create schema shop;
create table shop.item (id integer primary key, price integer not null);
create table shop.item_band (
    item_id integer primary key references shop.item (id) on delete cascade,
    band    text not null
);
create function shop.item_band_compute(ids integer[])
returns table (item_id integer, band text)
language sql stable
as $$
    select i.id, case when i.price < 100 then 'cheap' else 'dear' end
    from shop.item i where ids is null or i.id = any(ids)
$$;
insert into shop.item select g, 50 from generate_series(1, 20) g;
select lockstep.define_derived('item_band', 'shop.item_band', 'shop.item_band_compute(integer[])',
                               parent => 'shop.item', every => '1 day');
select lockstep.watch('item_band', 'shop.item', 'id');
select lockstep.recompute('item_band');
"""


class Clock:
    """The runner's monotonic clock, advanced by hand. The window is also kept in the database (the job's
    last pass, read by lockstep.due(jobs, gather), so that every runner sees it): advancing the clock moves
    that pass back as far, as if that much time had gone by."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.conn: psycopg.Connection | None = None

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
        assert self.conn is not None
        self.conn.execute(
            "update lockstep.job_state set last_finished_at = last_finished_at - make_interval(secs => %s)",
            [seconds],
        )


@pytest.fixture
def shop(connect, dsn: str) -> psycopg.Connection:
    conn = connect(dsn, autocommit=True)
    conn.execute(SCHEMA_SQL)
    return conn


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch, shop: psycopg.Connection) -> Clock:
    c = Clock()
    c.conn = shop
    monkeypatch.setattr(loop.time, "monotonic", c)
    return c


def _runner(dsn: str, batch_wait: float, sleeps: list[tuple[float, bool]], **options: Any) -> loop.Runner:
    r = loop.Runner(loop.Options(dsn=dsn, batch_wait=batch_wait, tick=30.0, **options))
    r._sleep = lambda seconds, wake=False: sleeps.append((seconds, wake)) or False  # type: ignore[method-assign]
    r._connect()
    return r


def _dear(conn: psycopg.Connection, *ids: int) -> None:
    for i in ids:  # one application transaction each
        conn.execute("update shop.item set price = 500 where id = %s", [i])


def _bands(conn: psycopg.Connection) -> dict[int, str]:
    return dict(conn.execute("select item_id, band from shop.item_band").fetchall())


def _queued(conn: psycopg.Connection) -> int:
    return conn.execute("select count(*) from lockstep.queue where job = 'item_band'").fetchone()[0]


def test_keys_arriving_after_a_pass_gather_for_one_pass(shop, dsn, clock):
    sleeps: list[tuple[float, bool]] = []
    r = _runner(dsn, 5.0, sleeps)
    try:
        _dear(shop, 1)
        assert r._tick(sleep=True) is True  # the first key after a quiet spell: a pass at once
        assert _bands(shop)[1] == "dear" and _queued(shop) == 0

        clock.advance(1.0)
        _dear(shop, 2, 3)
        assert r._tick(sleep=True) is False  # 1 s after the pass: the keys gather
        assert _queued(shop) == 2 and _bands(shop)[2] == "cheap"
        seconds, wake = sleeps[-1]
        assert 3.5 < seconds <= 4.0 and wake is False  # until the window ends, not at the next key

        clock.advance(1.0)
        _dear(shop, 4)
        assert r._tick(sleep=True) is False
        assert 2.5 < sleeps[-1][0] <= 3.0

        clock.advance(3.0)  # the window is over: one pass takes all three keys
        assert r._tick(sleep=True) is True
        assert _queued(shop) == 0
        assert [_bands(shop)[i] for i in (2, 3, 4)] == ["dear"] * 3
        last = shop.execute("select last_updated from lockstep.job_state where job = 'item_band'").fetchone()[
            0
        ]
        assert last == 3
    finally:
        r._close()


def test_the_window_is_the_jobs_whichever_runner_made_the_pass(shop, dsn, clock):
    # each runner kept its own window: the second runner took the keys at once after the first one's pass,
    # so two runners made about twice as many passes, of half the keys, as one (bench oltp: ~10 a second)
    sleeps_a: list[tuple[float, bool]] = []
    sleeps_b: list[tuple[float, bool]] = []
    a, b = _runner(dsn, 5.0, sleeps_a), _runner(dsn, 5.0, sleeps_b)
    try:
        _dear(shop, 1)
        assert a._tick(sleep=True) is True  # runner a's pass
        clock.advance(1.0)
        _dear(shop, 2, 3)
        assert b._tick(sleep=True) is False  # runner b made no pass: the job's window is open
        assert _queued(shop) == 2 and 3.5 < sleeps_b[-1][0] <= 4.0
        clock.advance(4.0)
        assert b._tick(sleep=True) is True  # the window is over: one pass for both keys
        assert _queued(shop) == 0 and [_bands(shop)[i] for i in (2, 3)] == ["dear"] * 2
        _dear(shop, 4)
        assert a._tick(sleep=True) is False  # and now runner a waits for runner b's window
        assert 4.5 < sleeps_a[-1][0] <= 5.0
    finally:
        a._close()
        b._close()


def test_zero_batch_wait_passes_as_soon_as_keys_arrive(shop, dsn, clock):
    sleeps: list[tuple[float, bool]] = []
    r = _runner(dsn, 0.0, sleeps)
    try:
        _dear(shop, 1)
        assert r._tick(sleep=True) is True
        _dear(shop, 2)
        assert r._tick(sleep=True) is True  # no window: the next key is taken at once, same clock
        assert _queued(shop) == 0 and _bands(shop)[2] == "dear"
    finally:
        r._close()


def test_a_backlog_is_drained_without_waiting_and_its_rest_gathers(shop, dsn, clock):
    shop.execute("select lockstep.set_batch_parents('item_band', 3)")
    sleeps: list[tuple[float, bool]] = []
    r = _runner(dsn, 5.0, sleeps)
    try:
        _dear(shop, 1)
        assert r._tick(sleep=True) is True  # window opened
        clock.advance(5.0)
        shop.execute("update shop.item set price = 500 where id between 2 and 11")  # 10 keys, batch 3
        assert r._tick(sleep=True) is True  # full passes go again at once, in the same tick
        assert sleeps == []
        # while another full batch was ready; the rest, less than a batch, is the start of the next window.
        # A pass of it at once (as before) made a steady load of more keys per window than a batch cost
        # two passes a window, the second a small one paying a pass's whole fixed cost (bench oltp)
        assert _queued(shop) == 1
        assert sum(b == "dear" for i, b in _bands(shop).items() if i <= 11) == 10
        assert r._tick(sleep=True) is False
        assert 4.5 < sleeps[-1][0] <= 5.0 and sleeps[-1][1] is False  # the window, not the next key
        clock.advance(5.0)
        assert r._tick(sleep=True) is True
        assert _queued(shop) == 0 and all(b == "dear" for i, b in _bands(shop).items() if i <= 11)
    finally:
        r._close()


def test_a_backlog_goes_on_at_the_next_tick_without_waiting(shop, dsn, clock):
    # due(jobs, gather) opened the window after a full pass too: a backlog that outlasted a tick's
    # --drain-limit then waited --batch-wait at every tick
    shop.execute("select lockstep.set_batch_parents('item_band', 3)")
    sleeps: list[tuple[float, bool]] = []
    r = _runner(dsn, 5.0, sleeps, drain_limit=2)
    try:
        shop.execute("update shop.item set price = 500 where id between 1 and 10")  # 10 keys, batch 3
        assert r._tick(sleep=True) is True  # two full passes: 6 keys
        assert _queued(shop) == 4
        assert r._tick(sleep=True) is True  # the next tick goes on at once (a full batch is ready)
        assert _queued(shop) == 1 and sleeps == []  # the rest gathers (above)
    finally:
        r._close()


def test_a_periodic_recompute_due_right_after_a_pass_is_not_held_by_the_window(shop, dsn, clock):
    # the runner's own window held back every job due within --batch-wait of its pass, the periodic
    # recompute, a flag or a retry included, not only the ready keys
    sleeps: list[tuple[float, bool]] = []
    r = _runner(dsn, 5.0, sleeps)
    try:
        _dear(shop, 1)
        assert r._tick(sleep=True) is True
        shop.execute("update lockstep.job_state set next_run_at = now() where job = 'item_band'")
        assert r._tick(sleep=True) is True
        action = shop.execute("select last_action from lockstep.job_state where job = 'item_band'").fetchone()
        assert action == ("recompute",) and sleeps == []
    finally:
        r._close()


def test_once_does_not_wait(shop, dsn, clock):
    sleeps: list[tuple[float, bool]] = []
    r = _runner(dsn, 60.0, sleeps)
    try:
        _dear(shop, 1)
        assert r._tick(sleep=False) is True
        _dear(shop, 2)
        assert r._tick(sleep=False) is True  # --once drains whatever is queued
        assert _queued(shop) == 0 and sleeps == []
    finally:
        r._close()


def test_jobs_of_one_lock_group_take_turns(shop, dsn, clock):
    # a job with a long queue was called up to --drain-limit (50) times in a row while the other job of
    # its lock group waited (busy): 18 s for a sibling during a 24,000-parent hand-off
    shop.execute(
        "create table shop.item_flag (item_id integer primary key references shop.item (id)"
        " on delete cascade, dear boolean not null);"
        " create function shop.item_flag_compute(ids integer[]) returns table (item_id integer, dear boolean)"
        " language sql stable as $$ select i.id, i.price >= 100 from shop.item i"
        " where ids is null or i.id = any(ids) $$;"
        " select lockstep.define_derived('item_flag', 'shop.item_flag', 'shop.item_flag_compute(integer[])',"
        " parent => 'shop.item', lock_group => 'item_band', every => '1 day');"
        " select lockstep.recompute('item_flag');"
        " select lockstep.set_batch_parents('item_band', 1);"
        " select lockstep.set_batch_parents('item_flag', 1);"
        " select lockstep.enqueue('item_band', array(select generate_series(1, 20)));"
        " select lockstep.enqueue('item_flag', array(select generate_series(1, 20)));"
    )
    shop.execute("delete from lockstep.run_log")
    r = _runner(dsn, 0.0, [])
    try:
        assert r._tick(sleep=False) is True
    finally:
        r._close()
    order = [j for (j,) in shop.execute("select job from lockstep.run_log order by id")]
    assert len(order) >= 10 and set(order[:10]) == {"item_band", "item_flag"}, order
