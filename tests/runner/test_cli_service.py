"""The service recipes of docs/runner.md work as written.

The systemd unit: its ``Environment=`` and ``ExecStart=`` lines are split into words the way systemd
splits them (whitespace-separated, double or single quotes keep spaces, an ``Environment=`` word must be
``NAME=VALUE``); then its command line runs with that environment against a test database (``--once``
added; the only substitutions: the DATABASE_URL host, which is an example, and the metrics port, so
parallel runs do not collide). ``systemd-analyze verify`` checks each unit where it is installed. The old
unit line ``Environment=PGOPTIONS=-c client_connection_check_interval=1s`` is kept here as the failing
case it was: systemd hands the runner ``PGOPTIONS=-c``.

The container recipe: the Dockerfile installs the distribution this repository builds (pg-lockstep, not
the unrelated ``lockstep`` of the package index) and its command line parses.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.cli import main

ROOT = Path(__file__).resolve().parents[2]
DOCS = {"docs/runner.md": ROOT / "docs" / "runner.md"}
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
OLD_UNIT = """[Service]
Environment=DATABASE_URL=postgresql://lockstep_runner@db.internal:5432/app_db
Environment=PGOPTIONS=-c client_connection_check_interval=1s
ExecStart=/opt/lockstep/venv/bin/lockstep run --log-format json --metrics-port 9478
"""


def units(doc: Path) -> list[str]:
    text = doc.read_text()
    found = [b for b in re.findall(r"```ini\n(.*?)```", text, re.S) if "[Service]" in b]
    assert found, f"{doc.name}: no systemd unit"
    return found


def systemd_words(value: str) -> list[str]:
    """systemd's word splitting for Environment= and ExecStart= (extract_first_word with unquoting).

    For values without specifiers (%) or C escapes (\\\\), which the test refuses, this is shlex's POSIX
    splitting: whitespace separates, quotes group and are removed.
    """
    assert "%" not in value and "\\" not in value, f"specifiers/escapes not modelled: {value!r}"
    return shlex.split(value, posix=True)


def parse_unit(text: str) -> tuple[dict[str, str], list[str]]:
    """(environment, ExecStart argv) of a unit, as systemd would compute them."""
    env: dict[str, str] = {}
    exec_start: list[str] = []
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line
            continue
        key, _, value = line.partition("=")
        if section != "[Service]":
            continue
        if key == "Environment":
            for word in systemd_words(value):
                name, eq, val = word.partition("=")
                assert eq and ENV_NAME.match(name), f"systemd would ignore {word!r} (invalid assignment)"
                env[name] = val
        elif key == "ExecStart":
            exec_start = systemd_words(value)
    assert exec_start, "no ExecStart="
    return env, exec_start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_unit(text: str, dsn: str) -> subprocess.CompletedProcess:
    unit_env, argv = parse_unit(text)
    assert Path(argv[0]).name == "lockstep" and argv[1] == "run", argv
    assert "DATABASE_URL" in unit_env
    unit_env["DATABASE_URL"] = dsn
    args = argv[2:]
    if "--metrics-port" in args:
        args[args.index("--metrics-port") + 1] = str(free_port())
    base = {
        k: v for k, v in os.environ.items() if k != "DATABASE_URL" and not k.startswith(("PG", "LOCKSTEP_"))
    }
    return subprocess.run(
        [sys.executable, "-m", "lockstep", "run", *args, "--once"],
        env={**base, **unit_env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _job_that_records_the_check_interval(dsn: str) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(
            "create table public.seen (setting text);"
            " create function public.record() returns void language sql as"
            " $$ insert into public.seen select current_setting('client_connection_check_interval') $$;"
            " select lockstep.define_job('rec', 'public.record()', every => '1 hour');"
        )


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_systemd_unit_runs_as_systemd_would_start_it(doc, dsn):
    import psycopg

    _job_that_records_the_check_interval(dsn)
    for text in units(DOCS[doc]):
        unit_env, argv = parse_unit(text)
        assert (
            "PGOPTIONS" not in unit_env
            or unit_env["PGOPTIONS"].count("-c") == len(unit_env["PGOPTIONS"].split()) / 2
        ), unit_env
        p = run_unit(text, dsn)
        assert p.returncode == 0, p.stderr
        assert "run starting" in p.stderr and "rec call done" in p.stderr, p.stderr
        with psycopg.connect(dsn, autocommit=True) as c:
            # the unit asks for a 1 s connection check, and the runner's session got it
            assert "--connection-check-interval" in argv
            assert c.execute("select setting from public.seen").fetchall()[-1] == ("1s",)
            c.execute("update lockstep.job_state set next_run_at = now() where job = 'rec'")


def test_the_old_unit_fails_the_way_the_issue_saw_it(dsn):
    unit_env, _ = parse_unit(OLD_UNIT)
    assert unit_env["PGOPTIONS"] == "-c"  # systemd split the value at the space
    assert unit_env["client_connection_check_interval"] == "1s"
    p = run_unit(OLD_UNIT, dsn)
    assert p.returncode == 4, p.stderr  # used to loop forever; now a permanent start-up error with a hint
    assert "invalid command-line argument for server process: -c" in p.stderr
    assert "--connection-check-interval" in p.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("doc", sorted(DOCS))
def test_systemd_analyze_verify(doc, tmp_path):
    for i, text in enumerate(units(DOCS[doc])):
        _, argv = parse_unit(text)
        # verify checks that ExecStart's program exists: point it at this environment's lockstep
        here = Path(sys.executable).parent / "lockstep"
        unit = tmp_path / f"lockstep-runner-{i}.service"
        unit.write_text(text.replace(argv[0], str(here)))
        p = subprocess.run(
            ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
        )
        assert p.returncode == 0 and not p.stderr.strip() and not p.stdout.strip(), p.stdout + p.stderr


def test_container_recipe_installs_this_distribution():
    import tomllib

    name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    assert name == "pg-lockstep"
    text = (ROOT / "docs" / "runner.md").read_text()
    (dockerfile,) = re.findall(r"```dockerfile\n(.*?)```", text, re.S)
    installs = [ln for ln in dockerfile.splitlines() if "pip install" in ln]
    assert installs and all("pg_lockstep" in ln or "pg-lockstep" in ln for ln in installs), installs
    for doc in [*DOCS.values(), ROOT / "README.md"]:  # nowhere `pip install lockstep` (an unrelated package)
        assert not re.search(r"pip install (--\S+ )*'?lockstep\b", doc.read_text()), doc
    entry = re.search(r'ENTRYPOINT \["lockstep"\]\nCMD (\[.*\])', dockerfile)
    assert entry, dockerfile
    import json

    cmd = json.loads(entry.group(1))
    assert cmd[0] == "run"
    main.commands["run"].make_context("lockstep run", cmd[1:])  # parses (raises on a bad option)
    # the docker run lines parse too
    docker_runs = re.findall(r"(?ms)^docker run .*?(?<!\\)$", text)
    assert docker_runs, "docs/runner.md shows a docker run line"
    for line in docker_runs:
        words = shlex.split(line.replace("\\\n", " "))
        # the image's ENTRYPOINT is lockstep: the arguments after the image start at the command (the docs
        # said `image lockstep run ...`, which ran `lockstep lockstep run`)
        (i,) = [k for k, w in enumerate(words) if w.startswith("your-registry/lockstep")]
        assert words[i + 1] in main.commands, line
        main.commands[words[i + 1]].make_context("lockstep", words[i + 2 :])
