"""Initial schema: tenants, api_tokens, jobs, job_events, checkpoints, nodes, idempotency_keys.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('nodes',
    sa.Column('id', sa.String(length=128), nullable=False),
    sa.Column('hostname', sa.String(length=255), nullable=False),
    sa.Column('rack', sa.String(length=64), nullable=False),
    sa.Column('gpus', sa.Integer(), nullable=False),
    sa.Column('health', sa.String(length=16), nullable=False),
    sa.Column('fault_count', sa.Integer(), nullable=False),
    sa.Column('last_fault', sa.Text(), nullable=True),
    sa.Column('last_fault_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint("health IN ('ready', 'suspect', 'quarantined', 'cordoned', 'dead')", name=op.f('ck_nodes_health')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_nodes'))
    )
    op.create_table('tenants',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_tenants'))
    )
    op.create_table('api_tokens',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('description', sa.String(length=200), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("role IN ('admin', 'user')", name=op.f('ck_api_tokens_role')),
    sa.ForeignKeyConstraint(['tenant'], ['tenants.name'], name=op.f('fk_api_tokens_tenant_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_tokens')),
    sa.UniqueConstraint('token_hash', name=op.f('uq_api_tokens_token_hash'))
    )
    op.create_index(op.f('ix_api_tokens_tenant'), 'api_tokens', ['tenant'], unique=False)
    op.create_table('jobs',
    sa.Column('id', sa.String(length=26), nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('spec', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('plan', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('total_steps', sa.Integer(), nullable=False),
    sa.Column('loss', sa.Float(), nullable=True),
    sa.Column('tokens_per_s', sa.Float(), nullable=True),
    sa.Column('mfu', sa.Float(), nullable=True),
    sa.Column('result', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('event_seq', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("state IN ('pending', 'queued', 'starting', 'running', 'recovering', 'succeeded', 'failed', 'cancelled')", name=op.f('ck_jobs_state')),
    sa.ForeignKeyConstraint(['tenant'], ['tenants.name'], name=op.f('fk_jobs_tenant_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs'))
    )
    op.create_index('ix_jobs_state_priority', 'jobs', ['state', 'priority'], unique=False)
    op.create_index('ix_jobs_tenant_state', 'jobs', ['tenant', 'state'], unique=False)
    op.create_table('checkpoints',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=26), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('verified', sa.Boolean(), nullable=False),
    sa.Column('manifest_digest', sa.String(length=128), nullable=True),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_checkpoints_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_checkpoints')),
    sa.UniqueConstraint('job_id', 'step', name=op.f('uq_checkpoints_job_id_step'))
    )
    op.create_table('idempotency_keys',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('request_hash', sa.String(length=64), nullable=False),
    sa.Column('job_id', sa.String(length=26), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_idempotency_keys_job_id_jobs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['tenant'], ['tenants.name'], name=op.f('fk_idempotency_keys_tenant_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_idempotency_keys')),
    sa.UniqueConstraint('tenant', 'key', name=op.f('uq_idempotency_keys_tenant_key'))
    )
    op.create_table('job_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=26), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('type', sa.String(length=32), nullable=False),
    sa.Column('payload', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('time', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_events_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_job_events')),
    sa.UniqueConstraint('job_id', 'seq', name=op.f('uq_job_events_job_id_seq'))
    )


def downgrade() -> None:
    op.drop_table('job_events')
    op.drop_table('idempotency_keys')
    op.drop_table('checkpoints')
    op.drop_index('ix_jobs_tenant_state', table_name='jobs')
    op.drop_index('ix_jobs_state_priority', table_name='jobs')
    op.drop_table('jobs')
    op.drop_index(op.f('ix_api_tokens_tenant'), table_name='api_tokens')
    op.drop_table('api_tokens')
    op.drop_table('tenants')
    op.drop_table('nodes')
