"""model kind: whether a served model generates text or embeds

Workers announce the kind of the model they load (``generation`` or ``embedding``); a batch or
job whose endpoint the model cannot serve (a chat line to an embedding model, an embeddings line
to a chat model) is refused at create with the reason. Rows announced before this revision have
no kind (NULL: unknown, nothing refused until a worker announces again, within a minute).

Revision ID: 0008_model_kind
Revises: 0007_expiry_quotas
Create Date: 2026-12-01 22:15:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_model_kind"
down_revision = "0007_expiry_quotas"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch_op:
        batch_op.add_column(sa.Column("kind", sa.String(length=20), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch_op:
        batch_op.drop_column("kind")
