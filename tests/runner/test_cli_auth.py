"""A refused login is permanent for every command: a missing or wrong password, an unknown role or
database, a login pg_hba.conf rejects. Exit 4 at once (`lockstep run` too, loop and --once) with one error
line whose hint names the password file (.pgpass / PGPASSFILE) or PGPASSWORD.

A throw-away cluster (tests/pg_cluster.py) whose pg_hba.conf asks the role ``pw`` for its password (scram)
and rejects the role ``shut`` outright; ``root`` keeps trust to set it up.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pg_cluster
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from lockstep.errors import EXIT_SETUP
from lockstep.migrate import migrate

pytestmark = pytest.mark.skipif(not pg_cluster.AVAILABLE, reason=pg_cluster.MISSING)

HBA = """\
host all root 127.0.0.1/32 trust
host all shut 127.0.0.1/32 reject
host all all 127.0.0.1/32 scram-sha-256
"""
SECRET = "s3cret pass"


@pytest.fixture(scope="module")
def cluster() -> Iterator[pg_cluster.Cluster]:
    with pg_cluster.running("lockstep-auth-") as c:
        (c.data / "pg_hba.conf").write_text(HBA)
        c.pg_ctl("reload")
        with psycopg.connect(c.dsn, autocommit=True) as conn:
            conn.execute(f"create role pw login password '{SECRET}'")
            conn.execute("create role shut login")
            conn.execute("create database app owner pw")
        migrate(make_conninfo(dsn_as(c, "pw"), password=SECRET))  # as the database owner, the installer
        yield c


def dsn_as(c: pg_cluster.Cluster, user: str, dbname: str = "app") -> str:
    return make_conninfo(host="127.0.0.1", port=c.port, dbname=dbname, user=user)


def lockstep(*args: str, **extra: str) -> subprocess.CompletedProcess:
    base = {
        k: v for k, v in os.environ.items() if k != "DATABASE_URL" and not k.startswith(("PG", "LOCKSTEP_"))
    }
    try:
        return subprocess.run(
            [sys.executable, "-m", "lockstep", *args],
            env={**base, "PGCONNECT_TIMEOUT": "10", **extra},
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"lockstep {' '.join(args)} was still retrying after 60 s")


COMMANDS = [["status"], ["migrate", "current"], ["migrate"], ["run"], ["run", "--once"], ["retry", "j"]]


def refusals(c: pg_cluster.Cluster, tmp_path: Path) -> dict[str, tuple[str, dict[str, str]]]:
    empty = tmp_path / "empty-pgpass"
    empty.write_text("")
    empty.chmod(0o600)
    return {
        "no password": (dsn_as(c, "pw"), {"PGPASSFILE": str(empty)}),
        "wrong password": (dsn_as(c, "pw"), {"PGPASSWORD": "wrong"}),
        "pg_hba.conf rejects": (dsn_as(c, "shut"), {}),
    }


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_a_refused_login_is_exit_4_with_the_password_hint(cluster, tmp_path, cmd):
    for name, (dsn, extra) in refusals(cluster, tmp_path).items():
        p = lockstep(*cmd, "--dsn", dsn, **extra)
        assert p.returncode == EXIT_SETUP, (name, cmd, p.returncode, p.stderr)
        assert "Traceback" not in p.stderr and "retrying" not in p.stderr, (name, p.stderr)
        errors = [ln for ln in p.stderr.splitlines() if " ERROR " in ln or ln.startswith("Error: ")]
        assert len(errors) == 1, (name, p.stderr)
        assert "hint:" in errors[0] and "PGPASSFILE" in errors[0] and "PGPASSWORD" in errors[0], errors[0]
        assert ".pgpass" in errors[0], errors[0]


def test_the_password_file_lets_every_command_in(cluster, tmp_path):
    """The fix the hint names works: a 0600 password file named by PGPASSFILE."""
    pgpass = tmp_path / "pgpass"
    pgpass.write_text(f"127.0.0.1:{cluster.port}:app:pw:{SECRET}\n")
    pgpass.chmod(0o600)
    p = lockstep("migrate", "current", "--dsn", dsn_as(cluster, "pw"), PGPASSFILE=str(pgpass))
    assert p.returncode == 0, p.stderr
    p = lockstep("run", "--once", "--dsn", dsn_as(cluster, "pw"), PGPASSFILE=str(pgpass))
    assert p.returncode == 0, p.stderr


# -- the service recipes of docs/runner.md: their user can read their password file -------------------------

RUNNER_MD = Path(__file__).resolve().parents[2] / "docs" / "runner.md"
PROTECTED = ("/home/", "/root/", "/run/user/")  # what ProtectHome=true hides


def as_user(uid: int, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """``argv`` as user id ``uid`` (no supplementary groups), as the service or the container runs it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a command as another user")
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def secret_file(cluster: pg_cluster.Cluster, owner: int) -> Path:
    """A password file as the recipes prepare it: mode 0600, owned by ``owner``, in a folder all may enter."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="lockstep-pgpass-"))
    folder.chmod(0o755)
    path = folder / "pgpass"
    path.write_text(f"127.0.0.1:{cluster.port}:app:pw:{SECRET}\n")
    path.chmod(0o600)
    os.chown(path, owner, owner)
    return path


def test_systemd_unit_keeps_its_password_file_readable(cluster):
    """docs/runner.md's unit: ProtectHome hides ~/.pgpass, so PGPASSFILE names a file outside the homes, and
    the setup lines make it the unit's user's, mode 0600; that user then logs in with it."""
    from test_cli_service import parse_unit, units

    (unit,) = units(RUNNER_MD)
    env, argv = parse_unit(unit)
    user = next(ln.split("=", 1)[1] for ln in unit.splitlines() if ln.startswith("User="))
    protect = next((ln.split("=", 1)[1] for ln in unit.splitlines() if ln.startswith("ProtectHome=")), "no")
    assert protect in ("true", "yes", "tmpfs", "read-only"), "the recipe protects the homes"
    path = env.get("PGPASSFILE")
    assert path and path.startswith("/") and not path.startswith(PROTECTED), env
    assert f"install -m 0600 -o {user} -g {user} /dev/null {path}" in RUNNER_MD.read_text()
    pgpass = secret_file(cluster, 10001)  # the unit's path, in a scratch folder
    base = {
        k: v for k, v in os.environ.items() if k != "DATABASE_URL" and not k.startswith(("PG", "LOCKSTEP_"))
    }
    run_env = {**base, **env, "PGPASSFILE": str(pgpass), "DATABASE_URL": dsn_as(cluster, "pw")}
    args = [a for a in argv[2:] if a not in ("--metrics-port", "9478", "--metrics-host", "127.0.0.1")]
    p = as_user(10001, [sys.executable, "-m", "lockstep", "run", *args, "--once"], run_env)
    assert p.returncode == 0, p.stderr


def test_container_recipe_user_owns_its_password_file(cluster):
    """docs/runner.md's image runs as a numeric user id, the one the mounted password file is given to;
    that user logs in with it. The old recipe's `USER nobody` could not read a 0600 file of another owner
    and was refused with the password hint."""
    import re

    text = RUNNER_MD.read_text()
    (dockerfile,) = re.findall(r"```dockerfile\n(.*?)```", text, re.S)
    (user,) = re.findall(r"^USER (\S+)$", dockerfile, re.M)
    assert user.isdigit() and int(user) != 0, "a numeric, non-root user the host can give the file to"
    assert f"--uid {user}" in dockerfile
    (docker_run,) = [m for m in re.findall(r"(?ms)^docker run .*?(?<!\\)$", text) if "PGPASSFILE" in m]
    mount_target = re.search(r"PGPASSFILE=(\S+)", docker_run).group(1)
    host_file = re.search(rf"-v (\S+):{re.escape(mount_target)}:ro", docker_run).group(1)
    assert f"install -m 0600 -o {user} /dev/null {host_file}" in text
    pgpass = secret_file(cluster, int(user))
    base = {
        k: v for k, v in os.environ.items() if k != "DATABASE_URL" and not k.startswith(("PG", "LOCKSTEP_"))
    }
    env = {
        **base,
        "PGPASSFILE": str(pgpass),
        "DATABASE_URL": dsn_as(cluster, "pw"),
        "PGCONNECT_TIMEOUT": "10",
    }
    cmd = [sys.executable, "-m", "lockstep", "migrate", "current"]
    assert as_user(int(user), cmd, env).returncode == 0
    nobody = as_user(65534, cmd, env)
    assert nobody.returncode == EXIT_SETUP and "PGPASSFILE" in nobody.stderr, nobody.stderr
