"""an index on warmup_jobs.finished_at: the fleet exporter reads what finished since its last scrape

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 11:00:00
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_warmup_jobs_finished_at", "warmup_jobs", ["finished_at"])


def downgrade() -> None:
    op.drop_index("ix_warmup_jobs_finished_at", table_name="warmup_jobs")
