"""warmup runs and jobs: each change of a final status, with when

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 09:50:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("warmup_runs", sa.Column("status_changes", sa.JSON(), nullable=True))
    op.add_column("warmup_jobs", sa.Column("superseded", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("warmup_jobs", "superseded")
    op.drop_column("warmup_runs", "status_changes")
