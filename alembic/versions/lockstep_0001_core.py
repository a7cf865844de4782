"""lockstep core: schema, lock groups, jobs, queue, result type, status view (sql/0001/).

Revision ID: lockstep_0001
Revises:

Revision ids are namespaced (``lockstep_NNNN``) so they never collide with a host application's own
revisions when its Alembic runs lockstep's branch. The SQL stays in ``sql/NNNN/``.

Both ways of running this revision take the migrate lock first: ``lockstep migrate`` (its env.py takes it
before reading the version, and again here: transaction-level advisory locks stack) and a host
application's Alembic, whose env.py we do not control: here the lock serializes lockstep's DDL with any
concurrent ``lockstep migrate`` or host upgrade.
"""

from alembic import context, op
from alembic.util import CommandError

from lockstep import sqlfiles

revision = "lockstep_0001"
down_revision = None
branch_labels = ("lockstep",)
depends_on = None

MIGRATE_LOCK = "select pg_advisory_xact_lock(hashtextextended('lockstep:migrate', 0))"
OWN_VERSION_TABLE = "lockstep_alembic_version"


def _refuse_if_installed() -> None:
    """A lockstep schema this version table does not know of: say how to adopt it, change nothing."""
    if context.is_offline_mode():
        return
    if not op.get_bind().exec_driver_sql("select to_regnamespace('lockstep') is not null").scalar():
        return
    table = op.get_context().version_table
    if table == OWN_VERSION_TABLE:
        advice = (
            "`lockstep migrate` did not install it. If your application's Alembic did (its version table "
            "records it), keep upgrading it there with `alembic upgrade heads`; if it is a leftover or an "
            "empty schema of your own, `drop schema lockstep cascade` first"
        )
    else:
        advice = (
            f"if `lockstep migrate` installed it (version table {OWN_VERSION_TABLE}), move it to this "
            f"Alembic with `alembic stamp {revision}`, then `drop table {OWN_VERSION_TABLE}`; if another "
            "upgrade installed it meanwhile, run this upgrade again"
        )
    raise CommandError(
        f"the lockstep schema already exists but version table {table} does not record {revision}: {advice}"
    )


def upgrade() -> None:
    op.execute(MIGRATE_LOCK)
    _refuse_if_installed()
    sqlfiles.apply(op, "0001", "up")


def downgrade() -> None:
    op.execute(MIGRATE_LOCK)
    sqlfiles.apply(op, "0001", "down")
