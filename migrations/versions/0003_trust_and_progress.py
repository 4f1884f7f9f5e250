"""Tokens expire and record their last use; nodes remember which jobs faulted on them; jobs carry a
reason and a progress document; tenants carry a priority cap.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine:
    return sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')


def _utc() -> sa.types.TypeEngine:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table('api_tokens') as batch:
        batch.add_column(sa.Column('expires_at', _utc(), nullable=True))
        batch.add_column(sa.Column('last_used_at', _utc(), nullable=True))
    with op.batch_alter_table('nodes') as batch:
        batch.add_column(sa.Column('fault_jobs', _json(), nullable=True))
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('reason', sa.Text(), nullable=True))
        batch.add_column(sa.Column('progress', _json(), nullable=True))
    with op.batch_alter_table('tenants') as batch:
        batch.add_column(sa.Column('max_priority', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('tenants') as batch:
        batch.drop_column('max_priority')
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('progress')
        batch.drop_column('reason')
    with op.batch_alter_table('nodes') as batch:
        batch.drop_column('fault_jobs')
    with op.batch_alter_table('api_tokens') as batch:
        batch.drop_column('last_used_at')
        batch.drop_column('expires_at')
