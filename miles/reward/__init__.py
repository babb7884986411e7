"""Rewards under a time limit: the catalog of rewards by name (catalog), the pool of killable worker processes that
runs them (pool, worker) and the scorer that splits work between this process and the pool and counts what failed
(scorer). The contract they share is miles.protocols.reward."""
