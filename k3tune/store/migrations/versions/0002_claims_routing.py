"""Scale-out claims, and the routing each trial measured with.

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    op.create_table(
        "claims",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("hardware_id", sa.Integer, sa.ForeignKey("hardware.id"), nullable=False),
        sa.Column("problem_id", sa.Integer, sa.ForeignKey("problems.id"), nullable=False),
        sa.Column("op_digest", sa.String(32), nullable=False),
        sa.Column("backend", sa.Enum("measured", "simulated", "cpu", name="backend", native_enum=False, length=20), nullable=False),
        sa.Column("state", sa.String(10), nullable=False, index=True),
        sa.Column("owner", sa.String(200), nullable=True),
        sa.Column("expires_at", sa.DateTime, nullable=True),
        sa.UniqueConstraint("hardware_id", "problem_id", "op_digest", "backend", name="uq_claim"),
    )
    with op.batch_alter_table("trials") as batch:
        batch.add_column(sa.Column("routing", sa.String(200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("routing")
    op.drop_table("claims")
