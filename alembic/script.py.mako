"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}

Create with `alembic revision --rev-id lockstep_NNNN -m "..."` (namespaced ids; the SQL goes in sql/NNNN/).
"""

from alembic import op

from lockstep import sqlfiles

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}

MIGRATE_LOCK = "select pg_advisory_xact_lock(hashtextextended('lockstep:migrate', 0))"


def upgrade() -> None:
    op.execute(MIGRATE_LOCK)  # also when a host application's Alembic runs this revision
    sqlfiles.apply(op, ${repr(up_revision.removeprefix("lockstep_"))}, "up")


def downgrade() -> None:
    op.execute(MIGRATE_LOCK)
    sqlfiles.apply(op, ${repr(up_revision.removeprefix("lockstep_"))}, "down")
