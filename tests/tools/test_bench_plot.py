"""``lockstep bench --plot DIR`` on a tiny bench: every chart is written as a real PNG of the expected size,
drawn from the same run as the JSON result."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import matplotlib.image
import pytest

from lockstep.lab import plot
from lockstep.lab.bench_oltp import pg_bindir

pytestmark = pytest.mark.skipif(not (pg_bindir() / "pgbench").exists(), reason="no pgbench binary")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# figsize x DPI of each chart (lockstep/lab/plot.py)
EXPECTED = {"locks.png": (1000, 480), "oltp_tps.png": (700, 380), "queue_age.png": (700, 380)}


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the signature and the chunk's name."""
    assert data[:8] == PNG_SIGNATURE, data[:8]
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_plot_writes_the_charts(admin_dsn, tmp_path):
    out = tmp_path / "img"
    env = {
        **os.environ,
        "LOCKSTEP_OLTP_SECONDS": "2",
        "LOCKSTEP_OLTP_SCALE": "1",
        "LOCKSTEP_OLTP_CLIENTS": "2",
        "LOCKSTEP_OLTP_THREADS": "1",
        "LOCKSTEP_OLTP_ROUNDS": "1",
    }
    cmd = [sys.executable, "-m", "lockstep", "bench", "--dsn", admin_dsn, "--parents", "200"]
    cmd += ["--sections", "recompute,oltp", "--plot", str(out), "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=540)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert sorted(f.name for f in out.iterdir()) == sorted(EXPECTED)
    for name, (width, height) in EXPECTED.items():
        data = (out / name).read_bytes()
        assert png_size(data) == (width, height), name
        assert len(data) > 10_000, f"{name}: {len(data)} bytes, too small to hold a chart"
        pixels = matplotlib.image.imread(out / name)  # decodes every chunk (CRCs, compressed data)
        assert pixels.shape[:2] == (height, width) and pixels.std() > 0.05, f"{name}: blank or unreadable"
        assert f"wrote {out / name}" in p.stderr
    # the queue chart's series comes from this run's lockstep scenario
    series = r["oltp"]["rounds"][0]["lockstep"]["queue_series"]
    assert series and all(len(s) == 3 and s[0] >= 0 and s[1] >= 0 and s[2] >= 0 for s in series)
    assert [s[0] for s in series] == sorted(s[0] for s in series)


def test_png_size_reads_the_header(tmp_path):
    """The PNG check above rejects what is not a PNG."""
    with pytest.raises(AssertionError):
        png_size(b"GIF89a" + bytes(30))
    header = PNG_SIGNATURE + struct.pack(">I4sII", 13, b"IHDR", 640, 480)
    assert png_size(header) == (640, 480)


def test_plot_without_recompute_or_oltp_writes_nothing(tmp_path):
    """A bench of the queue section alone has no figure to draw."""
    assert plot.write_charts({"queue": {}}, tmp_path / "img") == []


def test_plot_without_matplotlib_is_a_usage_error_before_the_bench_runs(monkeypatch):
    """No bench runs (minutes long) only to fail at the end for want of matplotlib."""
    from click.testing import CliRunner

    from lockstep.cli import main
    from lockstep.lab import bench

    def missing() -> None:
        raise ImportError("lockstep bench --plot needs matplotlib: pip install 'pg-lockstep[plot]'")

    ran = []
    monkeypatch.setattr(plot, "require", missing)
    monkeypatch.setattr(bench, "run", lambda *a, **k: ran.append(a))
    r = CliRunner().invoke(main, ["bench", "--parents", "10", "--plot", "/nonexistent/img"])
    assert r.exit_code == 2, r.output
    assert "pg-lockstep[plot]" in r.output and ran == []
