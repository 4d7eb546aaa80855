"""history outbox: outbox entries already written

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29 22:50:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "applied_writes",
        sa.Column("source", sa.String(length=255), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("applied_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_applied_writes")),
    )
    op.create_index("ix_applied_writes_applied_at", "applied_writes", ["applied_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_applied_writes_applied_at", table_name="applied_writes")
    op.drop_table("applied_writes")
