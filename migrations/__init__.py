"""Alembic environment and versions for the preheat history database."""
