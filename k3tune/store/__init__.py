"""Store: the tuning database (SQLAlchemy models, sessions, alembic migrations), and what reads and writes it.
The store keeps records; it does not build kernels or run searches."""
