#!/usr/bin/env bash
# Re-packs the device bundle's pure-Python part (.carry/cutedsl/rest.tar.xz, made by ../shared/device/make-bundle.sh)
# without what the GPU machine never imports: SQLAlchemy's test suite and its mssql/oracle/mysql dialects (sqlite and
# postgresql stay; optuna's RDB storage and alembic import and run without them). 3.14 -> 2.92 MB: the tracked tree
# plus .carry must stay under the device tool's 64 MiB (s26's first call was refused at ~20 KB over).
# Usage (project root): bash bench/trim_bundle.sh        (idempotent; keeps the untrimmed file as rest.tar.xz.full
# outside the tree, in ~/.cache/k3tune-device-bundle)
set -euo pipefail
src=.carry/cutedsl/rest.tar.xz
[ -f "$src" ] || { echo "error: no $src: run bash ../shared/device/make-bundle.sh first" >&2; exit 1; }
keep=${K3_BUNDLE_CACHE:-$HOME/.cache/k3tune-device-bundle}
mkdir -p "$keep"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
xz -dc "$src" | tar -xf - -C "$work"
if [ ! -d "$work/sqlalchemy/testing" ] && [ ! -d "$work/sqlalchemy/dialects/mysql" ]; then
  echo "already trimmed: $(stat -c %s "$src") bytes"; exit 0
fi
cp "$src" "$keep/rest.tar.xz.full"
rm -rf "$work/sqlalchemy/testing" "$work/sqlalchemy/dialects/"{mssql,oracle,mysql}
(cd "$work" && tar -cf - . | xz -9e -T2 > "$work.tar.xz")
mv "$work.tar.xz" "$src"
echo "trimmed: $(stat -c %s "$keep/rest.tar.xz.full") -> $(stat -c %s "$src") bytes"
