"""``lockstep bench --sections oltp`` at a tiny size: the real pgbench binary, base, lockstep's trigger
alone, lockstep and the sync reference (a row trigger), twice, the second round in the other order
(lockstep watches, converged first, and unwatches after each of its runs); the report has every figure, no
pgbench transaction failed, and the derived table converged after each lockstep and each sync run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from runner.lab.bench_oltp import pg_bindir, render

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
        [sys.executable, "-m", "runner", "bench", "--dsn", admin_dsn, "--sections", "oltp", "--json"],
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
        ls = rd["lockstep"]
        assert ls["converged"] and ls["divergence"] == 0 and ls["queue_left"] == 0
        assert ls["keys_enqueued"] >= ls["transactions"]  # one key per UPDATE pgbench_accounts
        assert ls["trigger_us_per_update"] is not None
        assert ls["worker_passes"] > 0 and ls["worker_ms_per_key"] > 0
        assert ls["queue_lag_max_s"] is not None and ls["queue_depth_max"] is not None
        assert rd["tps_pct_of_base"] > 0 and rd["sync_pct"] > 0 and rd["trigger_pct"] > 0
        assert rd["trigger"]["keys_enqueued"] >= rd["trigger"]["transactions"]
        assert rd["sync"]["converged"] and rd["sync"]["divergence"] == 0
    assert list(r["rounds"][0])[:4] == ["base", "trigger", "lockstep", "sync"]
    assert list(r["rounds"][1])[:4] == ["sync", "lockstep", "trigger", "base"]
    assert r["tps_pct_of_base"] > 0 and r["added_ms_per_update"] is not None and r["wal_ratio"] > 0
    assert r["sync"]["tps_pct_of_base"] > 0 and r["sync"]["wal_ratio"] > 0 and r["lockstep_pct_of_sync"] > 0
    assert r["trigger"]["tps_pct_of_base"] > 0 and r["trigger"]["wal_ratio"] > 0
    text = render(r)
    assert "% of base" in text and text.count("converged True") == 3
    assert "% of sync's" in text and "trigger alone" in text
