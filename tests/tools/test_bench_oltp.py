"""``lockstep bench --sections oltp`` at a tiny size: the real pgbench binary, base, lockstep's trigger
alone, lockstep and the sync reference (a row trigger), twice, the second round in the other order
(lockstep watches, converged first, and unwatches after each of its runs); the report has every figure, no
pgbench transaction failed, and the derived table converged after each lockstep and each sync run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from lockstep.lab.bench_oltp import pg_bindir, render

pytestmark = pytest.mark.skipif(not (pg_bindir() / "pgbench").exists(), reason="no pgbench binary")


def test_oltp_section_tiny(admin_dsn):
    env = {
        **os.environ,
        "LOCKSTEP_OLTP_SECONDS": "3",
        "LOCKSTEP_OLTP_SCALE": "1",
        "LOCKSTEP_OLTP_CLIENTS": "2",
        "LOCKSTEP_OLTP_THREADS": "1",
    }
    p = subprocess.run(
        [sys.executable, "-m", "lockstep", "bench", "--dsn", admin_dsn, "--sections", "oltp", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)["oltp"]
    assert r["options"] == {"seconds": 3, "scale": 1, "clients": 2, "threads": 1, "runners": 2, "rounds": 2}
    assert len(r["rounds"]) == 2 and r["base"] == r["rounds"][0]["base"]
    for rd in r["rounds"]:
        for run in (rd["base"], rd["trigger"], rd["lockstep"], rd["sync"]):
            assert run["transactions"] > 0 and run["failed"] == 0
            assert run["tps"] > 0 and run["latency_ms"] > 0 and run["update_accounts_ms"] > 0
            assert run["wal_per_txn"] > 0
        # lockstep watches only during its own and the trigger's runs, each from an empty queue file
        assert rd["base"]["keys_enqueued"] == 0 and rd["sync"]["keys_enqueued"] == 0
        assert rd["trigger"]["keys_enqueued"] >= rd["trigger"]["transactions"]
        assert rd["trigger"]["queue_bytes_start"] == 0 and rd["lockstep"]["queue_bytes_start"] == 0
        ls = rd["lockstep"]
        assert ls["converged"] and ls["divergence"] == 0 and ls["queue_left"] == 0
        assert ls["keys_enqueued"] >= ls["transactions"]  # one key per UPDATE pgbench_accounts
        assert ls["trigger_us_per_update"] is not None
        assert ls["worker_passes"] > 0 and ls["worker_ms_per_key"] > 0
        assert ls["queue_lag_max_s"] is not None and ls["queue_depth_max"] is not None
        assert rd["sync"]["converged"] and rd["sync"]["divergence"] == 0
        for side, key in (("lockstep", "tps_pct_of_base"), ("trigger", "trigger_pct"), ("sync", "sync_pct")):
            assert rd[key] == pytest.approx(100 * rd[side]["tps"] / rd["base"]["tps"])
    assert list(r["rounds"][0])[:4] == ["base", "trigger", "lockstep", "sync"]
    assert list(r["rounds"][1])[:4] == ["sync", "lockstep", "trigger", "base"]

    # the summary pools the rounds: sums over sums, the added ms the mean of the rounds' differences
    def pooled(side: str) -> dict[str, float]:
        keys = ("tps", "update_accounts_ms", "wal_per_txn")
        tot = {k: sum(rd[side][k] for rd in r["rounds"]) for k in keys}
        base = {k: sum(rd["base"][k] for rd in r["rounds"]) for k in keys}
        added = (tot["update_accounts_ms"] - base["update_accounts_ms"]) / len(r["rounds"])
        return {
            "tps_pct_of_base": 100 * tot["tps"] / base["tps"],
            "added_ms_per_update": added,
            "wal_ratio": tot["wal_per_txn"] / base["wal_per_txn"],
        }

    for k, v in pooled("lockstep").items():
        assert r[k] == pytest.approx(v)
    assert r["trigger"] == pytest.approx(pooled("trigger")) and r["sync"] == pytest.approx(pooled("sync"))
    lockstep_tps, sync_tps = (sum(rd[side]["tps"] for rd in r["rounds"]) for side in ("lockstep", "sync"))
    assert r["lockstep_pct_of_sync"] == pytest.approx(100 * lockstep_tps / sync_tps)

    text = render(r)
    assert "% of base" in text and text.count("converged True") == 3
    assert "% of sync's" in text and "trigger alone" in text
    labels = re.findall(r"^  ((?:base|trigger|lockstep|sync) \d) ", text, re.M)
    assert labels == [
        "base 1", "trigger 1", "lockstep 1", "sync 1", "sync 2", "lockstep 2", "trigger 2", "base 2",
    ]  # fmt: skip


def test_oltp_wal_scenario_on_a_logical_server():
    """The wal scenario (watched through the WAL, runners capturing) at a tiny size on a throw-away
    wal_level = logical cluster: converged, a WAL-watched UPDATE measured, the capture's CPU per change, and
    the fixed-rate runs with their latency percentiles."""
    import pg_cluster
    import wal_cluster

    from lockstep.lab import bench_oltp

    if not pg_cluster.AVAILABLE:
        pytest.skip(pg_cluster.MISSING)
    with pg_cluster.running("lockstep-oltp-wal-", **wal_cluster.SETTINGS) as c:
        r = bench_oltp.run(
            c.dsn, lambda m: None, scenarios="base,wal", seconds=2, scale=1, clients=2, threads=1, rounds=1
        )
    assert r["wal_level"] == "logical" and list(r["rounds"][0]) == ["base", "wal", "wal_pct"]
    w = r["rounds"][0]["wal"]
    assert w["converged"] and w["transactions"] > 0 and w["failed"] == 0 and w["keys_enqueued"] > 0
    assert w["trigger_us_per_update"] is not None and w["unwatched_us_per_update"] is not None
    assert r["capture"]["changes"] >= r["capture"]["transactions"] > 0
    assert r["capture"]["capture_us_per_change"] > 0
    assert set(r["fixed_rate"]) == {"base", "wal"}
    for x in r["fixed_rate"].values():
        assert x["latency_p99_ms"] >= x["latency_p50_ms"] > 0
    text = bench_oltp.render(r)
    assert "wal (watched through the WAL" in text and "µs server CPU per change" in text


def test_oltp_floor_scenarios_on_a_logical_server():
    """The floors' scenarios at a tiny size on a throw-away wal_level = logical cluster, beside wal and sync:
    decode reads its own slot on the capture's schedule and leaves no slot or publication behind; wal_now
    (runners at --batch-wait 0) converges; the lag's parts (capture and worker pass times) are reported."""
    import pg_cluster
    import psycopg
    import wal_cluster

    from lockstep.lab import bench_oltp

    if not pg_cluster.AVAILABLE:
        pytest.skip(pg_cluster.MISSING)
    with pg_cluster.running("lockstep-oltp-floor-", **wal_cluster.SETTINGS) as c:
        r = bench_oltp.run(
            c.dsn,
            lambda m: None,
            scenarios="base,wal,wal_now,decode,sync",
            seconds=2,
            scale=1,
            clients=2,
            threads=1,
            rounds=1,
        )
        with psycopg.connect(c.dsn, autocommit=True) as conn:
            assert conn.execute("select count(*) from pg_replication_slots").fetchone()[0] == 0
    rd = r["rounds"][0]
    assert [k for k in rd if k in bench_oltp.SCENARIOS] == ["base", "wal", "wal_now", "decode", "sync"]
    d = rd["decode"]
    assert d["transactions"] > 0 and d["failed"] == 0 and d["keys_enqueued"] == 0
    assert d["decode_calls"] > 0 and d["decode_changes"] > 0  # the last reads may end after the load
    assert d["decode_cpu_ms_per_change"] > 0 and d["decode_mb_per_call"] >= d["decode_new_mb_per_call"] > 0
    for side in ("wal", "wal_now"):
        w = rd[side]
        assert w["converged"] and w["keys_enqueued"] > 0
        assert w["capture_calls"] > 0 and w["capture_read_calls"] > 0 and w["capture_ms_mean"] > 0
        assert w["pass_ms_max"] >= w["pass_ms_p50"] > 0
    for side in ("wal_now", "decode"):
        assert r[side]["tps_pct_of_base"] == pytest.approx(100 * rd[side]["tps"] / rd["base"]["tps"])
    text = bench_oltp.render(r)
    assert "wal_now (wal, runners at --batch-wait 0)" in text and "decode alone" in text
    assert "wal lag parts: capture" in text and "floors: WAL sync" in text
