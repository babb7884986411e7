"""Rewards under a time limit: the reward contract (api), the catalog of rewards by name (catalog), the pool of
killable worker processes that runs them (pool, worker) and the scorer that splits work between this process and
the pool and counts what failed (scorer)."""
