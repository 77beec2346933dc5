"""Alembic environment: migrations run on the connection k3tune hands over (see k3tune.store.db.migrate)."""

from alembic import context

from k3tune.store.models import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
