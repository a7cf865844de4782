"""The application side of the lab tools: client threads that write the example app like a real one.

One ``AppClient`` per connection (autocommit, explicit transactions), used by ``lockstep demo`` and
the storm (``tests/lab/storm.py``). A ``Workload`` says which transactions a client runs and how:

- ``delete`` / ``delete_one``: delete one parent; ``delete_any``: several in one ``= any(...)`` statement;
  ``delete_each``: several, one statement each, in one transaction (random key order);
- ``merge``: move the exam_item rows of A to B, then delete A, in one transaction;
- ``edit``: rewrite the body of one or more parents or of one of their items;
- ``insert``: new parents with items;
- ``enqueue``: an explicit ``lockstep.enqueue`` of a few keys.

Each client owns the exam ids ``id % n == index``: two clients never wait for each other, so every lock
wait an application transaction meets involves a job. What the clients saw goes to a ``Stats`` (shared by
the clients of a demo phase, one per client in a storm).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from lockstep.lab import example

DELETE_ONE_SQL = "delete from example.exam where id = %s"
DELETE_ANY_SQL = "delete from example.exam where id = any(%s)"
MERGE_MOVE_SQL = "update example.exam_item set exam_id = %s where exam_id = %s"
EDIT_SQL = "update example.exam set body = example.words(8, %s), updated_at = now() where id = %s"
EDIT_ITEM_SQL = (
    "update example.exam_item set body = example.words(2, %s)"
    " where id = (select min(id) from example.exam_item where exam_id = %s)"
)
INSERT_SQL = (
    "insert into example.exam (id, title, body) values (%s, example.words(2, %s), example.words(8, %s))"
)
INSERT_ITEMS_SQL = (
    "insert into example.exam_item (exam_id, body) select %s, example.words(2, %s * 7 + i)"
    " from generate_series(1, %s) i"
)
ENQUEUE_SQL = "select lockstep.enqueue(%s, %s::bigint[])"
OWN_IDS_SQL = "select id from example.exam where id %% %s = %s"

CONNECTION_SQLSTATES = {"57P01", "57P02", "57P03"}


def is_disconnect(exc: BaseException, conn: psycopg.Connection | None = None) -> bool:
    """A lost connection or a server going down/coming up: not an application error."""
    state = getattr(exc, "sqlstate", None)
    if state and (state.startswith("08") or state in CONNECTION_SQLSTATES):
        return True
    if conn is not None and (conn.broken or conn.closed):
        return True
    return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)) and not state


def sqlstate(exc: BaseException) -> str:
    return getattr(exc, "sqlstate", None) or type(exc).__name__


@dataclass(frozen=True)
class Workload:
    """Which transactions a client runs (``ops``: (name, weight)) and how big they are."""

    ops: tuple[tuple[str, int], ...]
    application_name: str = "lockstep lab app"
    insert_parents: tuple[int, int] = (1, 1)  # parents per insert transaction (min, max)
    insert_items: tuple[int, int] = (2, 2)  # items per new parent
    edit_parents: tuple[int, int] = (1, 1)
    delete_parents: tuple[int, int] = (2, 5)  # delete_any / delete_each
    enqueue_keys: tuple[int, int] = (1, 5)
    balance: bool = False  # keep the number of live parents near where it started
    reconnect: bool = False  # on a lost connection: reconnect and go on (else the client stops)
    pause: float = 0.01  # think time between transactions, seconds
    random_pause: bool = False  # uniform(0, pause) instead of pause


DEMO = Workload(
    ops=(("delete", 15), ("merge", 10), ("insert", 25), ("edit", 35), ("enqueue", 15)),
    application_name="lockstep demo app",
)
STORM = Workload(
    ops=(
        ("delete_one", 12),
        ("delete_any", 8),
        ("delete_each", 8),
        ("merge", 12),
        ("edit", 30),
        ("insert", 30),
    ),
    application_name="lockstep storm app",
    insert_parents=(1, 4),
    insert_items=(1, 3),
    edit_parents=(1, 3),
    balance=True,
    reconnect=True,
    pause=0.002,
    random_pause=True,
)


class Stats:
    """What application clients saw (thread-safe; shared by several clients or one per client)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attempts: Counter[str] = Counter()  # every transaction tried, by op
        self.ok: Counter[str] = Counter()  # committed, by op
        self.errors: Counter[str] = Counter()  # by SQLSTATE (connection losses are disconnects)
        self.error_samples: list[str] = []
        self.tx_ms: list[float] = []  # every transaction tried
        self.latencies_ms: list[float] = []  # committed transactions
        self.delete_ms: list[float] = []  # every single-parent delete tried
        self.disconnects = 0
        self.deleted = 0
        self.inserted = 0

    def add(self, op: str, ms: float, error: psycopg.Error | None = None) -> None:
        with self.lock:
            self.attempts[op] += 1
            self.tx_ms.append(ms)
            if op in ("delete", "delete_one"):
                self.delete_ms.append(ms)
            if error is None:
                self.ok[op] += 1
                self.latencies_ms.append(ms)
                return
            state = sqlstate(error)
            self.errors[state] += 1
            if len(self.error_samples) < 5:
                self.error_samples.append(f"{op}: [{state}] {str(error).strip().splitlines()[0]}")

    def count(self, **fields: int) -> None:
        with self.lock:
            for name, n in fields.items():
                setattr(self, name, getattr(self, name) + n)


def partition(live_ids: list[int], first_new: int, n: int) -> list[tuple[list[int], int]]:
    """For each of n clients: the live ids it owns (``id % n == k``) and the first new id it may use."""
    return [([i for i in live_ids if i % n == k], first_new + ((k - first_new) % n)) for k in range(n)]


class AppClient(threading.Thread):
    """One application session: random transactions of its ``workload`` on the exams it owns until
    ``stop`` is set."""

    def __init__(
        self,
        dsn: str,
        index: int,
        n: int,
        live: list[int],
        next_id: int,
        workload: Workload,
        seed: int,
        stats: Stats | None = None,
        stop: threading.Event | None = None,
        name: str = "app",
    ) -> None:
        super().__init__(daemon=True, name=f"{name}-{index}")
        self.dsn, self.index, self.n, self.w = dsn, index, n, workload
        self.live = live
        self.target = max(len(live), 4)
        self.next_id = next_id  # first id of this client's new exams; then + n
        self.rng = random.Random(seed)
        self.stats = stats if stats is not None else Stats()
        self.stop = stop if stop is not None else threading.Event()
        self.conn: psycopg.Connection | None = None
        names, weights = zip(*workload.ops, strict=True)
        self._names: tuple[str, ...] = names
        self._weights: tuple[int, ...] = weights

    # connection ------------------------------------------------------------------------------------------
    def _connect(self) -> bool:
        delay = 0.05
        while not self.stop.is_set():
            try:
                self.conn = psycopg.connect(
                    self.dsn, autocommit=True, application_name=self.w.application_name, connect_timeout=5
                )
                return True
            except psycopg.Error as exc:
                if not self.w.reconnect:
                    self.stats.add("connect", 0.0, exc)
                    return False
                self.stats.count(disconnects=1)
                self.stop.wait(delay)
                delay = min(delay * 2, 1.0)
        return False

    def _close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:  # noqa: BLE001 - a broken connection may fail to close cleanly
                pass
        self.conn = None

    # operations ------------------------------------------------------------------------------------------
    def _take(self, k: int) -> list[int]:
        return self.rng.sample(self.live, min(k, len(self.live)))

    def _forget(self, ids: list[int]) -> None:
        gone = set(ids)
        self.live = [i for i in self.live if i not in gone]
        self.stats.count(deleted=len(gone))

    def _new_id(self) -> int:
        i = self.next_id
        self.next_id += self.n
        return i

    def _pick_op(self) -> str:
        if self.w.balance and len(self.live) < max(3, self.target // 2):
            return "insert"
        if self.w.balance and len(self.live) > self.target * 2:
            return "delete_any"
        op = self.rng.choices(self._names, self._weights)[0]
        return "insert" if op != "insert" and len(self.live) < 2 else op

    def _op(self, conn: psycopg.Connection, op: str) -> Callable[[], None]:
        """Run ``op`` (one transaction); return what to do to the live set once it committed."""
        rng, w = self.rng, self.w
        if op in ("delete", "delete_one"):
            ids = self._take(1)
            conn.execute(DELETE_ONE_SQL, ids)
            return lambda: self._forget(ids)
        if op == "delete_any":
            ids = self._take(rng.randint(*w.delete_parents))
            conn.execute(DELETE_ANY_SQL, [ids])
            return lambda: self._forget(ids)
        if op == "delete_each":
            ids = self._take(rng.randint(*w.delete_parents))
            with conn.transaction():
                for i in ids:
                    conn.execute(DELETE_ONE_SQL, [i])
            return lambda: self._forget(ids)
        if op == "merge":
            a, b = self._take(2)
            with conn.transaction():
                conn.execute(MERGE_MOVE_SQL, [b, a])
                conn.execute(DELETE_ONE_SQL, [a])
            return lambda: self._forget([a])
        if op == "edit":
            edits = [
                (EDIT_SQL if rng.random() < 0.5 else EDIT_ITEM_SQL, [rng.randrange(1 << 40), i])
                for i in self._take(rng.randint(*w.edit_parents))
            ]
            if len(edits) == 1:
                conn.execute(*edits[0])
            else:
                with conn.transaction():
                    for stmt, args in edits:
                        conn.execute(stmt, args)
            return lambda: None
        if op == "enqueue":
            keys = sorted(set(self._take(rng.randint(*w.enqueue_keys))))
            conn.execute(ENQUEUE_SQL, [example.JOB, keys])
            return lambda: None
        if op != "insert":
            raise ValueError(f"unknown application op {op!r}")
        ids = [self._new_id() for _ in range(rng.randint(*w.insert_parents))]
        with conn.transaction():
            for i in ids:
                conn.execute(INSERT_SQL, [i, i, -i])
                conn.execute(INSERT_ITEMS_SQL, [i, i, rng.randint(*w.insert_items)])

        def add() -> None:
            self.live.extend(ids)
            self.stats.count(inserted=len(ids))

        return add

    def run(self) -> None:
        if not self._connect():
            return
        while not self.stop.is_set():
            op = self._pick_op()
            t0 = time.perf_counter()
            try:
                assert self.conn is not None
                commit = self._op(self.conn, op)
            except psycopg.Error as exc:
                if is_disconnect(exc, self.conn):
                    if not self.w.reconnect:
                        self.stats.add(op, (time.perf_counter() - t0) * 1000, exc)
                        break
                    self.stats.count(disconnects=1)
                    self._close()
                    if not self._connect():
                        break
                    self._resync()  # an insert or delete may or may not have committed
                    continue
                self.stats.add(op, (time.perf_counter() - t0) * 1000, exc)
            else:
                commit()
                self.stats.add(op, (time.perf_counter() - t0) * 1000)
            pause = self.rng.uniform(0, self.w.pause) if self.w.random_pause else self.w.pause
            if pause:
                self.stop.wait(pause)
        self._close()

    def _resync(self) -> None:
        """Re-read the live set after a reconnect."""
        for _ in range(20):
            if self.stop.is_set() or self.conn is None:
                return
            try:
                rows = self.conn.execute(OWN_IDS_SQL, [self.n, self.index]).fetchall()
                self.live = [r[0] for r in rows]
                top = max(self.live, default=0)
                while self.next_id <= top:
                    self.next_id += self.n
                return
            except psycopg.Error:
                self.stats.count(disconnects=1)
                self._close()
                if not self._connect():
                    return
