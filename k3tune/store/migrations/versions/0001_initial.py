"""Initial schema: hardware, software, runs, problems, trials, winners.

Revision ID: 0001
Revises:
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None

ENUM = dict(native_enum=False, length=20)
BACKEND = sa.Enum("measured", "simulated", "cpu", name="backend", **ENUM)
STATUS = sa.Enum("ok", "invalid", "compile_failed", "runtime_failed", "timeout", "wrong_result", name="trialstatus", **ENUM)


def upgrade() -> None:
    op.create_table(
        "hardware",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("digest", sa.String(32), nullable=False, unique=True),
        sa.Column("class_key", sa.String(200), nullable=False, index=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("compute_capability", sa.String(10), nullable=False),
        sa.Column("sm_count", sa.Integer, nullable=False),
        sa.Column("memory_gib", sa.Integer, nullable=False),
        sa.Column("driver", sa.String(40), nullable=False),
        sa.Column("cuda", sa.String(40), nullable=False),
        sa.Column("simulated", sa.Boolean, nullable=False),
    )
    op.create_table(
        "software",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("digest", sa.String(32), nullable=False, unique=True),
        sa.Column("torch", sa.String(60), nullable=False),
        sa.Column("cutlass_dsl", sa.String(60), nullable=False),
        sa.Column("k3tune", sa.String(60), nullable=False),
        sa.Column("git_rev", sa.String(60), nullable=False),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("command", sa.Text, nullable=False),
        sa.Column("backend", BACKEND, nullable=False),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("spec_digest", sa.String(32), nullable=False),
        sa.Column("hardware_id", sa.Integer, sa.ForeignKey("hardware.id"), nullable=False),
        sa.Column("software_id", sa.Integer, sa.ForeignKey("software.id"), nullable=False),
        sa.Column("started_at", sa.DateTime, nullable=False),
        sa.Column("ended_at", sa.DateTime, nullable=True),
        sa.Column("status", sa.String(20), nullable=False),
    )
    op.create_table(
        "problems",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("key", sa.String(300), nullable=False, unique=True),
        sa.Column("op", sa.String(60), nullable=False, index=True),
        sa.Column("kind", sa.String(30), nullable=False),
        sa.Column("dims", sa.JSON, nullable=False),
    )
    op.create_table(
        "trials",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), nullable=False),
        sa.Column("hardware_id", sa.Integer, sa.ForeignKey("hardware.id"), nullable=False),
        sa.Column("problem_id", sa.Integer, sa.ForeignKey("problems.id"), nullable=False),
        sa.Column("family", sa.String(60), nullable=False),
        sa.Column("family_digest", sa.String(32), nullable=False),
        sa.Column("variant", sa.String(60), nullable=False),
        sa.Column("params", sa.JSON, nullable=False),
        sa.Column("params_key", sa.String(400), nullable=False),
        sa.Column("round", sa.Integer, nullable=False),
        sa.Column("status", STATUS, nullable=False),
        sa.Column("backend", BACKEND, nullable=False),
        sa.Column("median_us", sa.Float, nullable=True),
        sa.Column("spread_us", sa.Float, nullable=True),
        sa.Column("samples", sa.Integer, nullable=False),
        sa.Column("compile_s", sa.Float, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.UniqueConstraint("hardware_id", "problem_id", "family", "family_digest", "params_key", "round", name="uq_trial"),
    )
    op.create_index("ix_trial_lookup", "trials", ["hardware_id", "problem_id", "family_digest"])
    op.create_table(
        "winners",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("hardware_id", sa.Integer, sa.ForeignKey("hardware.id"), nullable=False),
        sa.Column("problem_id", sa.Integer, sa.ForeignKey("problems.id"), nullable=False),
        sa.Column("op_digest", sa.String(32), nullable=False),
        sa.Column("backend", BACKEND, nullable=False),
        sa.Column("family", sa.String(60), nullable=False),
        sa.Column("family_digest", sa.String(32), nullable=False),
        sa.Column("params", sa.JSON, nullable=False),
        sa.Column("median_us", sa.Float, nullable=False),
        sa.Column("spread_us", sa.Float, nullable=False),
        sa.Column("default_us", sa.Float, nullable=True),
        sa.Column("ties", sa.JSON, nullable=False),
        sa.Column("trials", sa.Integer, nullable=False),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), nullable=True),
        sa.Column("origin", sa.String(300), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.UniqueConstraint("hardware_id", "problem_id", "op_digest", "backend", name="uq_winner"),
    )


def downgrade() -> None:
    for t in ("winners", "trials", "problems", "runs", "software", "hardware"):
        op.drop_table(t)
