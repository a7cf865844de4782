"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from alembic import op

from runner import sqlfiles

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def upgrade() -> None:
    sqlfiles.apply(op, ${repr(up_revision)}, "up")


def downgrade() -> None:
    sqlfiles.apply(op, ${repr(up_revision)}, "down")
