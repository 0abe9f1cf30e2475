"""Datasets: prompt files and folders (JSONL / JSON / CSV / parquet / Arrow through ``datasets``), their
tokenization and the seeded sampler whose position is part of a checkpoint."""
