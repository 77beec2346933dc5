"""Every table of the tuning database (SQLAlchemy 2.0 declarative). Natural keys carry unique constraints.

A trial's key is (hardware, problem, family, family digest, params, round): everything that invalidates a
measurement. A winner's key is (hardware, problem, op digest, backend): the op digest covers every family
that could serve the op, so adding or changing one makes the winner stale.
"""

from __future__ import annotations

import enum
from datetime import datetime, timezone

from sqlalchemy import JSON, Boolean, DateTime, Enum, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class TrialStatus(str, enum.Enum):
    ok = "ok"
    invalid = "invalid"
    compile_failed = "compile_failed"
    runtime_failed = "runtime_failed"
    timeout = "timeout"
    wrong_result = "wrong_result"


class Backend(str, enum.Enum):
    measured = "measured"  # real kernels timed on this hardware
    simulated = "simulated"  # analytic roofline model: never served as a measurement
    cpu = "cpu"  # the CPU test double


class Hardware(Base):
    __tablename__ = "hardware"
    id: Mapped[int] = mapped_column(primary_key=True)
    digest: Mapped[str] = mapped_column(String(32), unique=True)
    class_key: Mapped[str] = mapped_column(String(200), index=True)
    name: Mapped[str] = mapped_column(String(100))
    compute_capability: Mapped[str] = mapped_column(String(10))
    sm_count: Mapped[int] = mapped_column(Integer)
    memory_gib: Mapped[int] = mapped_column(Integer)
    driver: Mapped[str] = mapped_column(String(40))
    cuda: Mapped[str] = mapped_column(String(40))
    simulated: Mapped[bool] = mapped_column(Boolean)


class Software(Base):
    __tablename__ = "software"
    id: Mapped[int] = mapped_column(primary_key=True)
    digest: Mapped[str] = mapped_column(String(32), unique=True)
    torch: Mapped[str] = mapped_column(String(60))
    cutlass_dsl: Mapped[str] = mapped_column(String(60))
    k3tune: Mapped[str] = mapped_column(String(60))
    git_rev: Mapped[str] = mapped_column(String(60))


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(primary_key=True)
    command: Mapped[str] = mapped_column(Text)
    backend: Mapped[Backend] = mapped_column(Enum(Backend, native_enum=False, length=20))
    host: Mapped[str] = mapped_column(String(200))
    owner: Mapped[str] = mapped_column(String(200))
    spec_digest: Mapped[str] = mapped_column(String(32))
    hardware_id: Mapped[int] = mapped_column(ForeignKey("hardware.id"))
    software_id: Mapped[int] = mapped_column(ForeignKey("software.id"))
    started_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    status: Mapped[str] = mapped_column(String(20), default="running")


class ProblemRow(Base):
    __tablename__ = "problems"
    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(String(300), unique=True)
    op: Mapped[str] = mapped_column(String(60), index=True)
    kind: Mapped[str] = mapped_column(String(30))
    dims: Mapped[dict] = mapped_column(JSON)


PARAMS_KEY_CHARS = 2000  # trials.params_key (schema 0004; tests/test_kernels.py checks every family fits)


class Trial(Base):
    __tablename__ = "trials"
    __table_args__ = (
        UniqueConstraint("hardware_id", "problem_id", "family", "family_digest", "params_key", "round", "method",
                         name="uq_trial"),
        Index("ix_trial_lookup", "hardware_id", "problem_id", "family_digest"),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    hardware_id: Mapped[int] = mapped_column(ForeignKey("hardware.id"))
    problem_id: Mapped[int] = mapped_column(ForeignKey("problems.id"))
    family: Mapped[str] = mapped_column(String(60))
    family_digest: Mapped[str] = mapped_column(String(32))
    variant: Mapped[str] = mapped_column(String(60))
    params: Mapped[dict] = mapped_column(JSON)
    params_key: Mapped[str] = mapped_column(String(PARAMS_KEY_CHARS))
    round: Mapped[int] = mapped_column(Integer, default=0)  # 0: search, 1: re-measurement of the best few
    status: Mapped[TrialStatus] = mapped_column(Enum(TrialStatus, native_enum=False, length=20))
    backend: Mapped[Backend] = mapped_column(Enum(Backend, native_enum=False, length=20))
    median_us: Mapped[float | None] = mapped_column(Float, nullable=True)
    spread_us: Mapped[float | None] = mapped_column(Float, nullable=True)  # interquartile range of the samples
    samples: Mapped[int] = mapped_column(Integer, default=0)
    compile_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    routing: Mapped[str | None] = mapped_column(String(200), nullable=True)
    # how it was timed (search/method.py: the measuring code and the libraries it times through); a trial is
    # reused only by a sweep that times the same way, "" for trials recorded before schema 0003
    method: Mapped[str] = mapped_column(String(32), default="")
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class Winner(Base):
    __tablename__ = "winners"
    __table_args__ = (UniqueConstraint("hardware_id", "problem_id", "op_digest", "backend", name="uq_winner"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    hardware_id: Mapped[int] = mapped_column(ForeignKey("hardware.id"))
    problem_id: Mapped[int] = mapped_column(ForeignKey("problems.id"))
    op_digest: Mapped[str] = mapped_column(String(32))
    backend: Mapped[Backend] = mapped_column(Enum(Backend, native_enum=False, length=20))
    family: Mapped[str] = mapped_column(String(60))
    family_digest: Mapped[str] = mapped_column(String(32))
    params: Mapped[dict] = mapped_column(JSON)
    median_us: Mapped[float] = mapped_column(Float)
    spread_us: Mapped[float] = mapped_column(Float)
    default_us: Mapped[float | None] = mapped_column(Float, nullable=True)  # the safe default, same conditions
    ties: Mapped[list] = mapped_column(JSON, default=list)  # candidates statistically tied with the winner
    trials: Mapped[int] = mapped_column(Integer)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id"), nullable=True)
    origin: Mapped[str] = mapped_column(String(300), default="")  # provenance after a merge
    # how the trials it was decided from were timed (search/method.py), "" where unknown (before schema 0005):
    # two winners timed differently differ by the measurer too (s29: the queued replays read 2-5% lower)
    method: Mapped[str] = mapped_column(String(32), default="")
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class Claim(Base):
    """One row per (hardware, problem, op digest, backend) a sweep plans: machines sharing a database claim
    pending problems with row locks; a crashed owner's claim expires and is taken over."""

    __tablename__ = "claims"
    __table_args__ = (UniqueConstraint("hardware_id", "problem_id", "op_digest", "backend", name="uq_claim"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    hardware_id: Mapped[int] = mapped_column(ForeignKey("hardware.id"))
    problem_id: Mapped[int] = mapped_column(ForeignKey("problems.id"))
    op_digest: Mapped[str] = mapped_column(String(32))
    backend: Mapped[Backend] = mapped_column(Enum(Backend, native_enum=False, length=20))
    state: Mapped[str] = mapped_column(String(10), default="pending", index=True)  # pending, claimed, done
    owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
