"""sleep and wake: a run's action, a schedule's action and level, a job's sleep figures

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Every run and schedule before this one warmed.
    op.add_column("warmup_runs", sa.Column("action", sa.String(32), nullable=False, server_default="warm"))
    op.add_column("schedules", sa.Column("action", sa.String(32), nullable=False, server_default="warm"))
    op.add_column("schedules", sa.Column("sleep_level", sa.Integer(), nullable=True))
    op.add_column("warmup_jobs", sa.Column("sleep_level", sa.Integer(), nullable=True))
    op.add_column("warmup_jobs", sa.Column("sleep_ms", sa.Double(), nullable=True))
    op.add_column("warmup_jobs", sa.Column("bytes_freed", sa.BigInteger(), nullable=True))
    op.add_column("warmup_jobs", sa.Column("wake_ms", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("warmup_jobs") as batch:
        for column in ("wake_ms", "bytes_freed", "sleep_ms", "sleep_level"):
            batch.drop_column(column)
    with op.batch_alter_table("schedules") as batch:
        batch.drop_column("sleep_level")
        batch.drop_column("action")
    with op.batch_alter_table("warmup_runs") as batch:
        batch.drop_column("action")
