"""lockstep core: schema, lock groups, jobs, queue, result type, status view (sql/0001/).

Revision ID: 0001
Revises:
"""

from alembic import op

from runner import sqlfiles

revision = "0001"
down_revision = None
branch_labels = ("lockstep",)
depends_on = None


def upgrade() -> None:
    sqlfiles.apply(op, "0001", "up")


def downgrade() -> None:
    sqlfiles.apply(op, "0001", "down")
