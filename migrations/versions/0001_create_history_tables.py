"""create history tables

Revision ID: 0001
Revises:
Create Date: 2026-11-29 14:39:36.815321
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "schedules",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.Enum("manual", "peak", name="schedulekind", native_enum=False, length=32), nullable=False),
        sa.Column("cron", sa.String(length=120), nullable=False),
        sa.Column("timezone", sa.String(length=64), nullable=False),
        sa.Column("targets", sa.JSON(), nullable=False),
        sa.Column("lead_time_s", sa.Integer(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_schedules")),
        sa.UniqueConstraint("name", name=op.f("uq_schedules_name")),
    )
    op.create_table(
        "warmup_runs",
        sa.Column(
            "trigger",
            sa.Enum(
                "schedule",
                "pod_event",
                "worker_online",
                "manual",
                "peak",
                name="triggerkind",
                native_enum=False,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("trigger_detail", sa.JSON(), nullable=False),
        sa.Column("requested_by", sa.String(length=200), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "queued", "running", "succeeded", "degraded", "failed", name="runstatus", native_enum=False, length=32
            ),
            nullable=False,
        ),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_warmup_runs")),
    )
    op.create_index("ix_warmup_runs_created_at", "warmup_runs", ["created_at"], unique=False)
    op.create_table(
        "warmup_jobs",
        sa.Column("run_id", sa.Uuid(), nullable=False),
        sa.Column(
            "target_kind",
            sa.Enum("worker", "endpoint", name="targetkind", native_enum=False, length=32),
            nullable=False,
        ),
        sa.Column("target", sa.String(length=255), nullable=False),
        sa.Column("model", sa.String(length=64), nullable=False),
        sa.Column("template", sa.String(length=64), nullable=False),
        sa.Column("celery_task_id", sa.String(length=64), nullable=True),
        sa.Column(
            "status",
            sa.Enum(
                "queued",
                "running",
                "warm",
                "degraded",
                "failed",
                "skipped",
                "lost",
                name="jobstatus",
                native_enum=False,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("load_ms", sa.Double(), nullable=True),
        sa.Column("prefill_ms", sa.Double(), nullable=True),
        sa.Column("ttft_cold_ms", sa.Double(), nullable=True),
        sa.Column("ttft_warm_ms", sa.Double(), nullable=True),
        sa.Column("ttft_bare_ms", sa.Double(), nullable=True),
        sa.Column("cached_tokens", sa.Integer(), nullable=True),
        sa.Column("cache_bytes", sa.BigInteger(), nullable=True),
        sa.Column("device", sa.String(length=32), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["warmup_runs.id"], name=op.f("fk_warmup_jobs_run_id_warmup_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_warmup_jobs")),
        sa.UniqueConstraint("run_id", "target", "model", "template", name="uq_warmup_jobs_run_target_model_template"),
    )
    op.create_index("ix_warmup_jobs_status", "warmup_jobs", ["status"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_warmup_jobs_status", table_name="warmup_jobs")
    op.drop_table("warmup_jobs")
    op.drop_index("ix_warmup_runs_created_at", table_name="warmup_runs")
    op.drop_table("warmup_runs")
    op.drop_table("schedules")
