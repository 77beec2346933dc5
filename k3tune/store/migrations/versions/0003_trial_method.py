"""How each trial was timed: trials.method, part of the trial's key (a sweep reuses only trials timed its way).

Revision ID: 0003
Revises: 0002
"""
import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"

OLD_KEY = ["hardware_id", "problem_id", "family", "family_digest", "params_key", "round"]


def upgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.add_column(sa.Column("method", sa.String(32), nullable=False, server_default=""))
        batch.drop_constraint("uq_trial", type_="unique")
        batch.create_unique_constraint("uq_trial", [*OLD_KEY, "method"])


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.drop_constraint("uq_trial", type_="unique")
        batch.create_unique_constraint("uq_trial", OLD_KEY)
        batch.drop_column("method")
