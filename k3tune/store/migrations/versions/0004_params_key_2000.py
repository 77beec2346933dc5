"""trials.params_key up to 2000 characters: the MoE block's knob set (30 knobs with pdl) outgrew 400, which
PostgreSQL enforces (SQLite does not). 2000 keeps the uq_trial index row far under PostgreSQL's btree limit.

Revision ID: 0004
Revises: 0003
"""
import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"


def upgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.alter_column("params_key", existing_type=sa.String(400), type_=sa.String(2000), existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.alter_column("params_key", existing_type=sa.String(2000), type_=sa.String(400), existing_nullable=False)
