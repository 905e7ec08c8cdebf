"""What the integrations that join a transaction of the caller's (SQLAlchemy's session,
Django's ``atomic`` block) share: which store joins which DB-API driver (:mod:`.kinds`) and
whether both sides are on one database (:mod:`.identity`, :mod:`.sync_identity`). Needs no
framework: each integration passes what its framework knows."""
