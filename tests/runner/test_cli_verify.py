"""`lockstep verify JOB [--keys ...] [--json]`: exit 0 when the target matches its compute, 1 on any
difference (counts and examples in text or JSON), 2 for a key not of the job's key type."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from lockstep.lab.example import JOB


def lockstep(*args: str) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k != "DATABASE_URL" and not k.startswith(("PG", "LOCKSTEP_"))
    }
    return subprocess.run(
        [sys.executable, "-m", "lockstep", *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_verify_clean_then_damaged(ex, example_dsn):
    p = lockstep("verify", JOB, "--dsn", example_dsn)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"{JOB}: matches its compute (all parents)"

    ex.execute("delete from example.exam_key where exam_id = 1")
    ex.execute("update example.exam_key set weight = weight + 1 where exam_id = 2")
    ex.execute("delete from lockstep.queue")
    n1 = ex.execute("select count(*) from example.exam_key_compute(array[1::bigint])").fetchone()[0]
    n2 = ex.execute("select count(*) from example.exam_key where exam_id = 2").fetchone()[0]
    p = lockstep("verify", JOB, "--dsn", example_dsn)
    assert p.returncode == 1, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == f"{JOB}: {n1} missing, 0 extra, {n2} different (all parents)", p.stdout
    assert sum(ln.lstrip().startswith("missing ") for ln in lines) == min(n1, 3)
    assert sum(ln.lstrip().startswith("different ") for ln in lines) == min(n2, 3)

    p = lockstep("verify", JOB, "--keys", "2,3", "--json", "--dsn", example_dsn)
    assert p.returncode == 1, p.stderr
    out = json.loads(p.stdout)
    assert out["keys"] == ["2", "3"] and not out["ok"]
    assert (out["missing"], out["extra"], out["different"]) == (0, 0, n2)
    assert {e["kind"] for e in out["examples"]} == {"different"}

    p = lockstep("verify", JOB, "--keys", "3", "--keys", "4", "--dsn", example_dsn)
    assert p.returncode == 0 and "(2 parents)" in p.stdout, p.stdout + p.stderr


def test_verify_bad_input_is_one_line(ex, example_dsn):
    p = lockstep("verify", JOB, "--keys", "x", "--dsn", example_dsn)
    assert p.returncode == 2 and p.stderr.startswith("Error: ") and "Traceback" not in p.stderr, p.stderr
    assert "--keys" in p.stderr
    p = lockstep("verify", "no_such_job", "--dsn", example_dsn)
    assert p.returncode == 1 and "no_such_job" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_verify_prints_text_as_it_is(ex, example_dsn):
    """The text examples are JSON objects, not ASCII-escaped: a key "Zürich" printed as "Z\\u00fcrich"."""
    ex.execute("insert into example.exam_key values (1, 'Zürich', 1)")
    ex.execute("delete from lockstep.queue")
    p = lockstep("verify", JOB, "--keys", "1", "--dsn", example_dsn)
    assert p.returncode == 1, p.stderr
    assert '"key": "Zürich"' in p.stdout and "\\u00fc" not in p.stdout, p.stdout
    p = lockstep("verify", JOB, "--keys", "1", "--json", "--dsn", example_dsn)
    assert p.returncode == 1 and json.loads(p.stdout)["examples"][0]["target"]["key"] == "Zürich", p.stdout
