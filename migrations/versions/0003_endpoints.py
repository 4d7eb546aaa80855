"""endpoint warmups: connect time per job, keep-alive counters

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 18:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "endpoint_keepalives",
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("pings_sent", sa.Integer(), nullable=False),
        sa.Column("pings_failed", sa.Integer(), nullable=False),
        sa.Column("skipped_inactive", sa.Integer(), nullable=False),
        sa.Column("last_ping_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_ttft_ms", sa.Double(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_endpoint_keepalives")),
        sa.UniqueConstraint("endpoint", name=op.f("uq_endpoint_keepalives_endpoint")),
    )
    with op.batch_alter_table("warmup_jobs") as batch_op:
        batch_op.add_column(sa.Column("connect_ms", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("warmup_jobs") as batch_op:
        batch_op.drop_column("connect_ms")
    op.drop_table("endpoint_keepalives")
