"""The storm (tests/lab/storm.py): a short storm (app clients + runner processes) keeps every invariant."""

from __future__ import annotations

import json

import pytest
from lab import storm


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_short_storm_keeps_every_invariant(admin_dsn, tmp_path):
    r = storm.run(
        admin_dsn,
        seconds=20,
        parents=300,
        clients=4,
        runners=2,
        every="3 seconds",
        progress=lambda msg: None,
        log_dir=tmp_path,
    )
    report = storm.render(r)
    assert r["deadlocks"] == 0, report
    assert r["app"]["errors"] == {}, report
    assert r["app"]["disconnects"] == 0, report
    assert r["runner"]["failed"] == 0, report
    assert r["runner"]["problems"] == [], report
    assert r["runner"]["exit_codes"] == [0, 0], report
    assert r["drain"]["drained"] and r["drain"]["queue_left"] == 0, report
    assert r["final_work"]["outcome"] == "idle", report
    fr = r["final_recompute"]
    assert (fr["outcome"], fr["inserted"], fr["updated"], fr["deleted"]) == ("done", 0, 0, 0), report
    assert r["failing_keys"] == 0, report
    assert r["divergence"] == [0, 0, 0], report
    assert r["ok"], report
    # the storm really stormed: every kind of app transaction, work and recompute runs both happened
    kinds = {"delete_one", "delete_any", "delete_each", "merge", "edit", "insert"}
    assert set(r["app"]["ops"]) == kinds, report
    assert r["app"]["transactions"] > 200, report
    assert r["runner"]["runs"].get("work:done", 0) > 0, report
    assert r["runner"]["runs"].get("recompute:done", 0) > 0, report


def test_storm_command_prints_json_and_fails_with_exit_1(admin_dsn, monkeypatch):
    """Thin command: options go to storm.run, the result comes out as JSON, exit 1 on a failed check."""
    from click.testing import CliRunner

    calls = []

    def fake_run(*args, **kw):
        calls.append((args, kw))
        return {"ok": False, "checks": {"deadlocks == 0": False}}

    monkeypatch.setattr(storm, "run", fake_run)
    out = CliRunner().invoke(
        storm.main,
        [
            "--dsn",
            admin_dsn,
            "--seconds",
            "2",
            "--parents",
            "60",
            "--clients",
            "3",
            "--runners",
            "1",
            "--every",
            "1 second",
            "--json",
        ],
    )
    assert out.exit_code == 1, out.output
    assert json.loads(out.output) == {"ok": False, "checks": {"deadlocks == 0": False}}
    assert calls == [
        (
            (admin_dsn, 2.0, 60, 3, 1, "1 second", False),
            {"poison": False, "flag_every": None, "runner_tz": None},
        )
    ]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_hostile_storm_ends_converged_and_healthy(admin_dsn, tmp_path):
    """A poison parent fixed halfway, a recompute flag every second and a runner in another TimeZone: the
    storm still converges with no deadlock, and lockstep status is healthy at the end."""
    r = storm.run(
        admin_dsn,
        seconds=30,
        parents=300,
        clients=3,
        runners=2,
        every="3 seconds",
        progress=lambda msg: None,
        log_dir=tmp_path,
        poison=True,
        flag_every=1.0,
        runner_tz="Asia/Kolkata",
    )
    report = storm.render(r)
    assert r["flags"] >= 20, report
    assert r["runner"]["runs"].get("recompute:done", 0) > 0, report
    assert r["ok"], report
