#!/usr/bin/env sh
# One-off schema migration: wait for the database, then `alembic upgrade head`.
# Run once per deploy, before the API starts: the `migrate` service in docker-compose.yml, the
# `lattice-migrate` Job in deploy/kuberay/migrate-job.yaml, or by hand:
#   LATTICE_DATABASE_URL=postgresql+psycopg://... deploy/migrate.sh
# Environment: LATTICE_DATABASE_URL (required), LATTICE_DB_WAIT_SECONDS (default 60),
# LATTICE_APP_DIR (where alembic.ini lives; default: the repository root next to this script).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
app_dir=${LATTICE_APP_DIR:-$(dirname "$here")}

if [ -z "${LATTICE_DATABASE_URL:-}" ]; then
    echo "migrate.sh: LATTICE_DATABASE_URL is not set" >&2
    exit 2
fi

python "$here/wait_for_db.py" --timeout "${LATTICE_DB_WAIT_SECONDS:-60}"

cd "$app_dir"
echo "migrate.sh: alembic upgrade head (in $app_dir)"
exec alembic upgrade head
