"""How each winner was timed: winners.method, the method digest of the trials it was decided from
(search/method.py), so that `db diff` can tell a faster kernel from a changed measurer; export and merge keep
it. "" where unknown (winners recorded before schema 0005).

Revision ID: 0005
Revises: 0004
"""
import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    with op.batch_alter_table("winners") as batch:
        batch.add_column(sa.Column("method", sa.String(32), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("winners") as batch:
        batch.drop_column("method")
