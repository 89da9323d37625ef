"""Durable records: the store interface, its PostgreSQL and SQLite backends, SQL, schema."""
