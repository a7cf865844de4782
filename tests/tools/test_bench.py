"""``lockstep bench`` end to end on a small example: every method and level, sane numbers."""

from __future__ import annotations

import json
import subprocess
import sys

import psycopg

from lockstep.lab.bench import LEVELS, METHODS, max_over, scaling_summary


def test_bench_small_json(admin_dsn):
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockstep", "bench", "--dsn", admin_dsn, "--parents", "300", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=180)  # a hang guard, not a speed check
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "recompute 100%: measure matview" in err  # progress, one line per step, on stderr
    r = json.loads(out)
    assert r["parents"] == 300 and r["machine"]["nproc"] >= 1
    for level in LEVELS:
        per = r["recompute"][f"{level}%"]
        assert per["changed_parents"] == 300 * level // 100
        assert per["bare_compute_ms"] > 0
        for method in METHODS:
            m = per[method]
            assert m["total_ms"] > 0 and m["wal_lsn"] >= 0
            # the naive and seed patterns may die (40P01) against the app deleting exams they rewrite
            assert m["error"] is not None or (m["rows"] >= 0 and m["wal_own"] >= 0)
            assert m["app_delete"]["n"] >= 1 and m["app_delete"]["max_ms"] >= m["app_delete"]["p50_ms"] > 0
            rw = m["app_delete_rewritten"]
            assert (rw is None) == (level == 0) and (rw is None or rw["n"] >= 1)
        ls = per["lockstep"]
        assert ls["error"] is None and ls["deadlocks"] == 0 and not ls["app_delete"]["errors"]
        assert level == 0 or not ls["app_delete_rewritten"]["errors"]
        assert ls["lockstep"]["outcome"] == "done" and ls["transactions"] >= 1
        assert 0 <= ls["max_lock_ms"] <= ls["lock_ms"] <= ls["total_ms"] and ls["compute_ms"] >= 0
        assert per["lockstep_1tx"]["transactions"] == 1 and per["lockstep_1tx"]["error"] is None
        if level:
            assert ls["rows"] > 0
    noop = r["recompute"]["0%"]
    assert noop["lockstep"]["rows"] == 0 and noop["seed"]["rows"] == 0 and noop["matview"]["rows"] == 0
    assert noop["naive"]["rows"] > 0  # deletes and reinserts everything
    assert r["summary"]["lockstep_noop"]["rows"] == 0 and noop["lockstep"]["rows_repeat"] == 0
    rc = r["recompute_composite"]  # the composite-key run beside one column, the same size
    assert rc["parents"] == 300 and rc["converged"]
    for level in (1, 100):
        per = rc[f"{level}%"]
        assert per["kc_one"]["ms"] > 0 and per["kc_two"]["ms"] > 0 and per["ratio"] > 0
        assert per["kc_one"]["txns"] >= 1 and per["kc_two"]["txns"] >= 1
    q = r["queue"]
    for key in ("enqueue_batch_1_keys_per_s", "enqueue_batch_1000_keys_per_s", "worker_parents_per_s"):
        assert q[key] > 0
    assert q["worker_parents"] == 30 and 0 < q["noop_pass_ms"] < 1000 and q["unchanged_500_pass_ms"] > 0
    with psycopg.connect(admin_dsn) as admin:  # its database is dropped
        name = f"lockstep_bench_{proc.pid}"
        assert admin.execute("select count(*) from pg_database where datname = %s", [name]).fetchone()[0] == 0


def _run(lat: list[float]) -> dict:
    return {
        "100%": {
            "lockstep": {
                "max_lock_ms": 80.0,
                "total_ms": 1000.0,
                "transactions": 3,
                "app_delete_rewritten": {
                    "n": len(lat),
                    "p99_ms": max(lat),
                    "max_ms": max(lat),
                    "latencies_ms": lat,
                },
            }
        }
    }


def test_scaling_compares_the_longest_wait_over_as_many_deletes_at_both_sizes():
    """A run with 4x the deletes meets its slowest wait 4x as often: one 30 ms wait among 800 deletes of
    the large run is no longer than the one per 200 of the small run, and the like-for-like max says so."""
    small = [1.0] * 199 + [12.0]
    big = [1.0] * 800
    for i, ms in ((100, 11.0), (300, 13.0), (500, 30.0), (700, 12.0)):
        big[i] = ms
    assert max_over(big, 200) == 12.5  # chunk maxes 11, 13, 30, 12
    assert max_over(big, 900) is None and max_over(big, 0) is None
    out = scaling_summary(_run(big), 50000, {"parents": 12500, "recompute": _run(small)})
    assert out["12500"]["rewritten_max_same_n_ms"] == 12.0 and out["50000"]["rewritten_max_same_n_ms"] == 12.5
    assert out["50000"]["rewritten_max_ms"] == 30.0 and out["50000"]["same_n"] == 200
    assert "_latencies" not in out["50000"]


def test_the_composite_run_alone(admin_dsn):
    """python -m lockstep.lab.bench_composite: the recompute section's composite-key run by itself."""
    p = subprocess.run(
        [sys.executable, "-m", "lockstep.lab.bench_composite", "--dsn", admin_dsn, "--parents", "200"],
        capture_output=True,
        text=True,
        timeout=180,  # a hang guard, not a speed check
    )
    assert p.returncode == 0, p.stderr
    assert "(tenant_id, id) ms" in p.stdout and "converged: yes" in p.stdout, p.stdout
    rows = [line.split() for line in p.stdout.splitlines() if line.strip().startswith(("1%", "100%"))]
    assert [r[0] for r in rows] == ["1%", "100%"] and all(float(r[-1]) > 0 for r in rows), p.stdout
