"""Scheduling core: requests, the block pool, the KV cache manager and the scheduler.

Integers and lists only; nothing here imports torch or any other Loom package.
"""
