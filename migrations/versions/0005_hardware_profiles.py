"""Measured hardware profiles per node type (issue 16), versioned; jobs remember predicted vs measured.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('hardware_profiles',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('node_type', sa.String(length=64), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('profile', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'),
              nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_hardware_profiles')),
    sa.UniqueConstraint('node_type', 'version', name=op.f('uq_hardware_profiles_node_type_version'))
    )


def downgrade() -> None:
    op.drop_table('hardware_profiles')
