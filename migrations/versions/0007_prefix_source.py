"""warmup jobs: whether the prefix was computed or restored from the prefix store

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 12:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("warmup_jobs", sa.Column("prefix_source", sa.String(length=16), nullable=True))
    op.add_column("warmup_jobs", sa.Column("restore_ms", sa.Double(), nullable=True))


def downgrade() -> None:
    op.drop_column("warmup_jobs", "restore_ms")
    op.drop_column("warmup_jobs", "prefix_source")
