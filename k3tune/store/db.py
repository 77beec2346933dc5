"""Opening a tuning database: SQLite file or SQLAlchemy URL, schema checks, migrations, sessions.

SQLite runs in WAL mode; writers take the lock up front (BEGIN IMMEDIATE) so that concurrent writers wait
on the busy timeout instead of failing on a lock upgrade. Every SQLAlchemy error leaves as a DatabaseError.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, event, inspect, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from k3tune.errors import DatabaseError, SchemaError

T = TypeVar("T")
MIGRATIONS = Path(__file__).resolve().parent / "migrations"
BUSY_TIMEOUT_S = 60
CONNECT_TIMEOUT_S = 30  # PostgreSQL: seconds to connect before the command fails with a one-line error
# PostgreSQL: the pauses before a transaction that lost its server is run again (``Database.transact``): ~2 min in
# all, the time a restart or a failover takes
RETRY_WAITS_S = (1, 2, 4, 8, 15, 30, 30, 30)
SCHEMA_LOCK_KEY = 0x6B337475  # PostgreSQL advisory lock held while a new database's schema is made ("k3tu")


def _alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


SCHEMA_HEAD = "0005"  # the newest migration; a test checks it against alembic's script directory


def head_revision() -> str:
    return SCHEMA_HEAD


def script_head_revision() -> str:
    return ScriptDirectory.from_config(_alembic_config()).get_current_head()


def known_revisions() -> list[str]:
    return [s.revision for s in ScriptDirectory.from_config(_alembic_config()).walk_revisions()]


def newer_schema(rev: str) -> SchemaError:
    """The error for a database whose schema this k3tune does not know (written by a newer one)."""
    return SchemaError(f"database schema {rev} is newer than this k3tune understands (head {head_revision()}): "
                       "upgrade k3tune")


def to_url(target: str | os.PathLike) -> tuple[str, Path | None]:
    """A path becomes a SQLite URL; a URL stays as it is. Returns (url, sqlite path or None)."""
    s = str(target)
    if "://" in s:
        scheme = s.split("://", 1)[0]
        backend = scheme.split("+", 1)[0]
        if backend == "sqlite":
            try:
                url = make_url(s)
            except ArgumentError:
                raise DatabaseError(f"malformed SQLite URL {s!r}: give a SQLite path or sqlite:///PATH") from None
            # "sqlite://" and ":memory:" are SQLAlchemy's in-memory database: a sweep into one ran to the end and
            # its every trial and winner went with the process
            if url.database in (None, "", ":memory:") or url.query.get("mode") == "memory":
                raise DatabaseError(f"{s} is an in-memory SQLite database, which keeps nothing once the command "
                                    "ends: give a file path")
            return s, Path(url.database)
        if backend != "postgresql":  # "postgres://", "mysql://": SQLAlchemy's plugin error otherwise
            raise DatabaseError(f"unsupported database URL scheme '{scheme}': give a SQLite path or a "
                                "postgresql:// URL")
        return s, None
    p = Path(s).expanduser().resolve()
    return f"sqlite:///{p}", p


def shown_url(url: str) -> str:
    """A database URL as messages and logs may show it: without its password."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:  # not parseable: show none of it past the scheme
        return url.split("://", 1)[0] + "://…"


def check_sqlite_file(path: Path) -> None:
    """Refuse a file that is not a SQLite database before SQLAlchemy touches it.

    Asked through SQLite itself, never with a plain open()/close() of the file: closing any descriptor of a
    database file drops every POSIX lock this process holds on it, and SQLite connections open elsewhere in
    the process would then lose their locks (and, in WAL mode, committed transactions)."""
    if path.is_dir():
        raise DatabaseError(f"{path} is a directory, not a database file")
    if not path.exists() or path.stat().st_size == 0:
        return
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            conn.execute("PRAGMA schema_version").fetchone()
        finally:
            conn.close()
    except sqlite3.DatabaseError as e:
        if "not a database" in str(e):
            raise DatabaseError(f"{path} is not a SQLite database") from None
        if "readonly database" in str(e):  # read-only, a WAL-mode file needs its -shm: it could not be made here
            raise DatabaseError(f"cannot read {path}: {e} (a WAL-mode database in a directory this process cannot "
                                "write; serve a `k3tune db export` of it, which needs no side file)") from None
        raise DatabaseError(f"cannot read {path}: {e}") from None


_SESSIONS = [0]  # database sessions open in the main thread (any Database)
_DEFERRED = [False]  # an interrupt that arrived inside one, raised when the last closes


@contextlib.contextmanager
def interrupts_between_sessions(signals=(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
    """Ctrl-C, SIGTERM (a job scheduler's stop, ``timeout``, ``kill``) and SIGHUP (the ssh session of a sweep run in
    its foreground dropped: it was killed where it stood) raise KeyboardInterrupt between database sessions, never
    inside one: one arriving inside waits until the session has committed or rolled back and
    returned its connection. Python's own SIGINT handler raises anywhere: inside SQLAlchemy's commit or pool reset
    it left a sweep's run marked running and printed the pool's traceback (the Ctrl-C test failed about 1 run in
    7, s35); SIGTERM killed the sweep where it stood, its claims left to expire. Main thread only; the old handlers
    come back after."""
    def interrupt(signum, frame):
        if _SESSIONS[0]:
            _DEFERRED[0] = True
        else:
            raise KeyboardInterrupt

    old = {sig: signal.signal(sig, interrupt) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        _DEFERRED[0] = False


def make_parent(path: Path) -> None:
    """The folders a new database file goes in (a file on that path was a FileExistsError traceback)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next(p for p in (path.parent, *path.parent.parents) if p.exists())  # the nearest that exists
        raise DatabaseError(f"cannot make the folder for {path}: {blocker} is a file") from None
    except OSError as e:
        raise DatabaseError(f"cannot make the folder for {path}: {e.strerror or e}") from None


class Database:
    """A tuning database: engine, schema state, sessions."""

    def __init__(self, target: str | os.PathLike, *, create: bool = True, readonly: bool = False,
                 check_schema: bool = True):
        self.url, self.path = to_url(target)
        self.readonly = readonly
        if self.path is not None:
            check_sqlite_file(self.path)
            if not self.path.exists():
                if readonly or not create:
                    raise DatabaseError(f"database not found: {self.path}")
                make_parent(self.path)
        self.engine = self._make_engine()
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        if check_schema:
            try:
                for wait in (0.2, 0.5, 1.0, 2.0, None):
                    try:
                        self.ensure_schema(create=create and not readonly)
                        break
                    except DatabaseError as e:
                        # processes opening one new SQLite file at once: while one turns it to WAL mode, another's
                        # read can get SQLITE_BUSY at once, past the busy timeout (seen once in test_store's
                        # six-process open)
                        if wait is None or not self.is_sqlite or "database is locked" not in str(e):
                            raise
                        self.engine.dispose()
                        time.sleep(wait)
            except BaseException:  # refused (no schema, an older one): no pooled connection may outlive the refusal,
                self.engine.dispose()  # or it keeps the file in WAL mode under the `db upgrade` the error suggests
                raise

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    @property
    def name(self) -> str:
        """The file's path, or the URL without its password: what messages and recorded origins may show."""
        return str(self.path) if self.path is not None else shown_url(self.url)

    def __repr__(self) -> str:
        return f"Database({self.name})"

    def close(self) -> None:
        """Fold SQLite's WAL file into the database file (a copy of the file alone then holds every committed
        transaction: s35-r9 lost a timed-out sweep's trials copying it without its WAL) and close the pool.
        Another process still reading keeps the rest of the WAL; the file stays consistent either way."""
        if self.is_sqlite and not self.readonly:
            try:  # outside a transaction (a connection's begin takes the write lock: no checkpoint inside it)
                raw = self.engine.raw_connection()
                try:
                    raw.cursor().execute("PRAGMA wal_checkpoint(TRUNCATE)")
                finally:
                    raw.close()
            except (SQLAlchemyError, sqlite3.Error):
                pass  # best effort: nothing committed depends on it
        self.dispose()

    def _make_engine(self) -> Engine:
        name = self.name
        try:
            if self.path is None:
                # a server that takes the connection and never answers hung every command: libpq waits forever
                # unless told (a connect_timeout in the URL's query wins)
                engine = create_engine(self.url, pool_pre_ping=True, pool_size=2, max_overflow=4,
                                       connect_args={} if "connect_timeout=" in self.url
                                       else {"connect_timeout": CONNECT_TIMEOUT_S})
            else:
                url = self.url
                if self.readonly:
                    url = f"sqlite:///file:{self.path}?mode=ro&uri=true"
                engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_S, "check_same_thread": False},
                                       json_deserializer=_json_reader(name))
        except (SQLAlchemyError, ImportError) as e:
            raise DatabaseError(f"cannot open database {name}: {e}") from None

        @event.listens_for(engine, "handle_error")
        def _on_error(ctx):  # a copy or a merge reads one database inside the other's session: name the one that failed
            if ctx.sqlalchemy_exception is not None:
                ctx.sqlalchemy_exception.k3tune_db = name

        if self.path is None:
            return engine
        readonly = self.readonly

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # transactions are begun below, explicitly
            cur = dbapi_conn.cursor()
            cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_S * 1000}")
            if not readonly:
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn):
            conn.exec_driver_sql("BEGIN" if readonly else "BEGIN IMMEDIATE")

        return engine

    # ---- schema -------------------------------------------------------------------------------
    def revision(self) -> str | None:
        try:
            with self.engine.connect() as conn:
                return MigrationContext.configure(conn).get_current_revision()
        except (SQLAlchemyError, sqlite3.DatabaseError) as e:
            raise self._open_error(e) from None

    def _open_error(self, e: Exception) -> DatabaseError:
        msg = _short(e)
        if not self.readonly and "readonly database" in msg:  # the file or its folder (journal, WAL) not writable
            return DatabaseError(f"cannot write database {self.name}: the file or its folder is read-only ({msg})")
        return DatabaseError(f"cannot read database {self.name}: {msg}")

    def ensure_schema(self, create: bool) -> None:
        try:
            rev = self.revision()
            if rev is None and create:
                rev = self._create_schema()
            elif rev is None:
                tables = inspect(self.engine).get_table_names()
                if tables:
                    raise SchemaError(f"{self.name}: has tables {tables[:4]} but no k3tune schema version")
                raise SchemaError(f"{self.name}: empty database (no k3tune schema)")
        except (SQLAlchemyError, sqlite3.DatabaseError) as e:
            raise self._open_error(e) from None
        head = head_revision()
        if rev == head:
            return
        if rev in known_revisions():
            raise SchemaError(f"database schema {rev} is older than {head}: run `k3tune db upgrade {self.name}`")
        raise newer_schema(rev)

    def _create_schema(self) -> str:
        """The schema made where there is none, under the database's write lock, looked at again once the lock is
        held: two sweeps starting on one new database (two machines, two shells) both found it empty and both
        created it, or one read the other's half-made tables and refused them as "no k3tune schema version".
        Returns the revision then current (another process's, where it came first)."""
        from alembic import command

        with self.engine.begin() as conn:  # SQLite: BEGIN IMMEDIATE, the write lock; PostgreSQL: an advisory lock
            if not self.is_sqlite:
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEMA_LOCK_KEY})
            rev = MigrationContext.configure(conn).get_current_revision()
            if rev is not None:
                return rev
            tables = inspect(conn).get_table_names()
            if tables:
                raise SchemaError(f"{self.name}: has tables {tables[:4]} but no k3tune schema version")
            cfg = _alembic_config()
            cfg.attributes["connection"] = conn
            try:
                command.upgrade(cfg, "head")
            except SQLAlchemyError as e:  # (as ``migrate`` says it)
                raise DatabaseError(f"migration failed on {self.name}: {_short(e)}") from None
        return head_revision()

    def migrate(self, revision: str = "head") -> None:
        from alembic import command

        cfg = _alembic_config()
        try:
            with self.engine.begin() as conn:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, revision)
        except SQLAlchemyError as e:
            raise DatabaseError(f"migration failed on {self.name}: {_short(e)}") from None

    # ---- sessions -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        """Commits on success, rolls back on error; SQLAlchemy errors become DatabaseError. Under
        ``interrupts_between_sessions`` an interrupt that arrives inside waits for the session to end."""
        s = self._sessions()
        main = threading.current_thread() is threading.main_thread()
        _SESSIONS[0] += main
        try:
            yield s
            s.commit()
        except SQLAlchemyError as e:
            with contextlib.suppress(SQLAlchemyError):  # a lost connection may fail its rollback too
                s.rollback()
            # a server's disconnects, and its refusals while it restarts or fails over, are operational errors
            transient = not self.is_sqlite and (isinstance(e, OperationalError)
                                                or getattr(e, "connection_invalidated", False))
            raise DatabaseError(f"database error on {getattr(e, 'k3tune_db', self.name)}: {_short(e)}",
                                transient=transient) from None
        finally:
            s.close()
            _SESSIONS[0] -= main
            if main and not _SESSIONS[0] and _DEFERRED[0]:
                _DEFERRED[0] = False
                raise KeyboardInterrupt

    def transact(self, work: Callable[[Session], T], on_retry: Callable[[str], None] | None = None) -> T:
        """``work(session)`` in one transaction, as ``session``, returning what it returns. On PostgreSQL a transaction
        whose server went away (restarted, failed over, dropped the connection) is run again on a new connection
        after each pause of ``RETRY_WAITS_S``, ``on_retry`` told why; a sweep's hours survive a server's minute.
        ``work`` must be safe to run again: it is, when its transaction was rolled back, which is almost always;
        a commit whose answer was lost may have landed, so a retried write must tolerate its own earlier copy."""
        for wait in (*RETRY_WAITS_S, None):
            try:
                with self.session() as s:
                    return work(s)
            except DatabaseError as e:
                if wait is None or not e.transient:
                    raise
                if on_retry:
                    on_retry(f"{e}; retrying in {wait} s")
                time.sleep(wait)
        raise AssertionError("unreachable")

    def quick_check(self) -> list[str]:
        """SQLite's integrity check ('ok' when sound); empty for other databases."""
        if not self.is_sqlite:
            return []
        try:
            with self.engine.connect() as conn:
                return [r[0] for r in conn.execute(text("PRAGMA integrity_check"))]
        except SQLAlchemyError as e:
            return [_short(e)]

    def dispose(self) -> None:
        self.engine.dispose()


def _json_reader(name: str) -> Callable[[str], object]:
    """SQLite's JSON cells, decoded. One that is not JSON (a hand edit, a damaged page the integrity check passed) is
    a one-line DatabaseError naming the database: it was a JSONDecodeError traceback from inside SQLAlchemy."""
    def loads(raw: str) -> object:
        try:
            return json.loads(raw)
        except ValueError:
            raise DatabaseError(f"{name}: a stored JSON value cannot be read ({str(raw)[:40]!r}): the database was "
                                f"edited or damaged; `k3tune db verify {name}` lists the rows") from None
    return loads


def _short(e: Exception) -> str:
    msg = str(getattr(e, "orig", None) or e).splitlines()[0]
    return msg[:300]


def backup_path(path: Path) -> Path:
    """The first of ``path``.bak, .bak.1, .bak.2, ... that does not exist: an upgrade never overwrites the original
    an earlier upgrade kept."""
    candidate, n = Path(f"{path}.bak"), 0
    while candidate.exists():
        n += 1
        candidate = Path(f"{path}.bak.{n}")
    return candidate


def open_db(target: str | os.PathLike, **kw) -> Database:
    return Database(target, **kw)


def open_for_serving(target: str | os.PathLike) -> tuple[Database, str]:
    """A database the serving path reads (``records.read_winners``, the hardware rows), and a note. Those columns
    exist in every schema since 0001, so an older known schema is served as it is, with a note to upgrade it:
    upgrading k3tune must not send a server back to heuristic defaults until someone runs ``k3tune db upgrade``.
    An empty database or a newer schema is refused (SchemaError)."""
    db = Database(target, create=False, readonly=True, check_schema=False)
    head = head_revision()
    try:
        rev = db.revision()
        if rev is None:
            raise SchemaError(f"{db.name}: no k3tune schema")
        if rev != head and rev not in known_revisions():
            raise newer_schema(rev)
    except DatabaseError:
        db.dispose()
        raise
    note = "" if rev == head else (f"{db.name}: schema {rev} is older than {head}; its winners are served "
                                   f"as they are (`k3tune db upgrade {db.name}` brings it up to date)")
    return db, note


def journal_mode(path: Path) -> str:
    """A SQLite file's journal mode ('delete', 'wal', ...), asked read-only: it changes nothing."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return conn.execute("PRAGMA journal_mode").fetchone()[0].lower()


def upgrade(target: str | os.PathLike) -> tuple[str | None, str]:
    """Migrate a database to the current schema. A SQLite file is upgraded on a copy that then replaces it
    (the original kept as .bak, or .bak.1, ... where an earlier backup exists), so a failed migration leaves it
    untouched; the upgraded file keeps the original's permissions and journal mode (an export stays a
    rollback-journal file a read-only server can open). A database already at the current schema is left alone,
    unopened for writing, and no backup is made."""
    probe = Database(target, create=False, readonly=True, check_schema=False)
    try:
        before = probe.revision()
    finally:
        probe.dispose()
    if before is not None and before not in known_revisions():
        raise newer_schema(before)
    if before == head_revision():
        return before, before
    if probe.path is None:
        db = Database(target, create=False, check_schema=False)
        try:
            db.migrate()
            return before, db.revision()
        finally:
            db.dispose()
    path = probe.path
    mode = journal_mode(path)
    fd, tmp = tempfile.mkstemp(prefix=".k3tune-upgrade-", suffix=".sqlite", dir=path.parent)
    os.close(fd)
    try:
        src = sqlite3.connect(path)
        dst = sqlite3.connect(tmp)
        with dst:
            src.backup(dst)
        src.close()
        dst.close()
        copy = Database(tmp, create=False, check_schema=False)
        copy.migrate()
        after = copy.revision()
        copy.close()  # migrated read-write, so in WAL mode: back to rollback mode unless the original was WAL
        if mode != "wal":
            with contextlib.closing(sqlite3.connect(tmp, isolation_level=None)) as conn:
                conn.execute("PRAGMA journal_mode=DELETE")
        leave_wal_mode(path)  # folds the original's WAL in: the backup then holds it all, and no -wal is left
        shutil.copy2(path, backup_path(path))  # beside the new file to be read into it
        shutil.copymode(path, tmp)  # the upgraded file keeps the original's permissions (mkstemp's are 0600)
        os.replace(tmp, path)
    finally:
        for p in (tmp, tmp + "-wal", tmp + "-shm"):
            if os.path.exists(p):
                os.unlink(p)
    return before, after


def leave_wal_mode(dest: Path) -> None:
    """Before ``dest`` is replaced: a database in WAL mode is checkpointed and switched to rollback mode, which folds
    and removes its -wal and -shm files. Left beside the new file, SQLite would read the old WAL into it (s29: a
    forced export over a sweep's database then read "database disk image is malformed"). A database another
    connection holds open cannot leave WAL mode: that is refused, and nothing is replaced."""
    if not (Path(f"{dest}-wal").exists() or Path(f"{dest}-shm").exists()):
        return
    try:
        with contextlib.closing(sqlite3.connect(dest, timeout=5, isolation_level=None)) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            mode = conn.execute("PRAGMA journal_mode=DELETE").fetchone()[0]
    except sqlite3.Error as e:
        mode = f"error: {e}"
    if mode.lower() != "delete" or Path(f"{dest}-wal").exists():
        raise DatabaseError(f"{dest} is open elsewhere (its write-ahead log is live; {mode}): close it and retry")
