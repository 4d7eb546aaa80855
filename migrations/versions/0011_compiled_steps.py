"""warmup_jobs.compile_source and compile_ms: how a worker's compiled steps came to run

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 01:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("warmup_jobs", sa.Column("compile_source", sa.String(16), nullable=True))
    op.add_column("warmup_jobs", sa.Column("compile_ms", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("warmup_jobs") as batch:
        batch.drop_column("compile_ms")
        batch.drop_column("compile_source")
