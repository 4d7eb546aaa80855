"""history indexes that keep `preheat history` and a task's failure fast at a million jobs

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 08:00:00
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # `preheat history --status/--trigger`: newest first among the matching runs only.
    op.create_index("ix_warmup_runs_status_created_at", "warmup_runs", ["status", "created_at"])
    op.create_index("ix_warmup_runs_trigger_created_at", "warmup_runs", ["trigger", "created_at"])
    # A task's failure finds its jobs by the task id (preheat.history.service.fail_task_jobs).
    op.create_index("ix_warmup_jobs_celery_task_id", "warmup_jobs", ["celery_task_id"])


def downgrade() -> None:
    op.drop_index("ix_warmup_jobs_celery_task_id", table_name="warmup_jobs")
    op.drop_index("ix_warmup_runs_trigger_created_at", table_name="warmup_runs")
    op.drop_index("ix_warmup_runs_status_created_at", table_name="warmup_runs")
