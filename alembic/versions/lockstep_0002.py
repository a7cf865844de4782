"""lockstep 0002: the state's change in sql/0002/up.sql, the code of sql/src (frozen at release).

Revision ID: lockstep_0002
Revises: lockstep_0001

Down: sql/0002/down.sql, then 0001's functions, views and policies again.

A schema already at 0002 (the comment on schema lockstep names its revision), stamped at 0001 to move it
from ``lockstep migrate`` to a host's Alembic as 0001's message advises, is only recorded, not changed.
"""

from alembic import op

from lockstep import sqlfiles

revision = "lockstep_0002"
down_revision = "lockstep_0001"
branch_labels = None
depends_on = None

MIGRATE_LOCK = "select pg_advisory_xact_lock(hashtextextended('lockstep:migrate', 0))"


def upgrade() -> None:
    op.execute(MIGRATE_LOCK)
    if sqlfiles.schema_revision(op) == "0002":
        return
    sqlfiles.apply(op, "0002", "up")


def downgrade() -> None:
    op.execute(MIGRATE_LOCK)
    sqlfiles.apply(op, "0002", "down")
