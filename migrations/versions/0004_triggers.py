"""triggers: schedule slots, beat lease, traffic counts, run trigger keys

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29 19:53:44
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "beat_leases",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_beat_leases")),
        sa.UniqueConstraint("name", name=op.f("uq_beat_leases_name")),
    )
    op.create_table(
        "traffic_counts",
        sa.Column("minute", sa.DateTime(timezone=True), nullable=False),
        sa.Column("model", sa.String(length=64), nullable=False),
        sa.Column("template", sa.String(length=64), nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("prefix_tokens", sa.Integer(), nullable=True),
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_traffic_counts")),
        sa.UniqueConstraint("minute", "model", "template", name="uq_traffic_counts_minute_model_template"),
    )
    op.create_table(
        "schedule_slots",
        sa.Column("schedule_id", sa.Uuid(), nullable=False),
        sa.Column("schedule_name", sa.String(length=64), nullable=False),
        sa.Column("slot_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("fire_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "status",
            sa.Enum("claimed", "sent", "unsent", "failed", "missed", name="slotstatus", native_enum=False, length=32),
            nullable=False,
        ),
        sa.Column("run_id", sa.Uuid(), nullable=True),
        sa.Column("claimed_by", sa.String(length=255), nullable=True),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["warmup_runs.id"], name=op.f("fk_schedule_slots_run_id_warmup_runs"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["schedule_id"], ["schedules.id"], name=op.f("fk_schedule_slots_schedule_id_schedules"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_schedule_slots")),
        sa.UniqueConstraint("schedule_id", "slot_at", name="uq_schedule_slots_schedule_slot"),
    )
    with op.batch_alter_table("schedule_slots", schema=None) as batch_op:
        batch_op.create_index("ix_schedule_slots_status", ["status"], unique=False)

    with op.batch_alter_table("schedules", schema=None) as batch_op:
        # Existing rows (none are written before this revision) get a start and no detail.
        batch_op.add_column(
            sa.Column(
                "active_since", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.current_timestamp()
            )
        )
        batch_op.add_column(sa.Column("detail", sa.JSON(), nullable=False, server_default="{}"))
    with op.batch_alter_table("schedules", schema=None) as batch_op:
        batch_op.alter_column("active_since", server_default=None)
        batch_op.alter_column("detail", server_default=None)

    with op.batch_alter_table("warmup_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("trigger_key", sa.String(length=255), nullable=True))
        batch_op.create_unique_constraint(batch_op.f("uq_warmup_runs_trigger_key"), ["trigger_key"])


def downgrade() -> None:
    with op.batch_alter_table("warmup_runs", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("uq_warmup_runs_trigger_key"), type_="unique")
        batch_op.drop_column("trigger_key")

    with op.batch_alter_table("schedules", schema=None) as batch_op:
        batch_op.drop_column("detail")
        batch_op.drop_column("active_since")

    with op.batch_alter_table("schedule_slots", schema=None) as batch_op:
        batch_op.drop_index("ix_schedule_slots_status")

    op.drop_table("schedule_slots")
    op.drop_table("traffic_counts")
    op.drop_table("beat_leases")
