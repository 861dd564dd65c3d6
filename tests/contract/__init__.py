"""Contract tests: one interface against a reference nobody here wrote (HF transformers, torch, the openai client,
the OpenAPI spec), or the same behaviour across its implementations (memory and Redis state, SQLite and
PostgreSQL stores)."""
