"""Tenant quotas, weights and borrowing; preemption bookkeeping (issue 18).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('tenants') as batch:
        batch.add_column(sa.Column('gpu_quota', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('weight', sa.Float(), server_default=sa.text('1.0'), nullable=False))
        batch.add_column(sa.Column('borrowing', sa.Boolean(), server_default=sa.false(), nullable=False))
    with op.batch_alter_table('nodes') as batch:
        batch.add_column(sa.Column('drain_reason', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('nodes') as batch:
        batch.drop_column('drain_reason')
    with op.batch_alter_table('tenants') as batch:
        batch.drop_column('borrowing')
        batch.drop_column('weight')
        batch.drop_column('gpu_quota')
