"""lockstep 0002: the state's change in sql/0002/up.sql, the code of sql/src (frozen at release).

Revision ID: lockstep_0002
Revises: lockstep_0001

Down: sql/0002/down.sql, then 0001's functions, views and policies again.
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
    sqlfiles.apply(op, "0002", "up")


def downgrade() -> None:
    op.execute(MIGRATE_LOCK)
    sqlfiles.apply(op, "0002", "down")
