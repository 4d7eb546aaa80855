"""worker registry and the steady-state TTFT of each job

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 17:55:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("nodename", sa.String(length=255), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("stopped_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ready", sa.Boolean(), nullable=False),
        sa.Column("state", sa.JSON(), nullable=False),
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
        sa.UniqueConstraint("nodename", name=op.f("uq_workers_nodename")),
    )
    with op.batch_alter_table("warmup_jobs") as batch_op:
        batch_op.add_column(sa.Column("ttft_steady_ms", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("warmup_jobs") as batch_op:
        batch_op.drop_column("ttft_steady_ms")
    op.drop_table("workers")
