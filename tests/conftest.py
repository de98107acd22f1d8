"""Fixtures shared by several test modules: ``redis_server`` (a real redis-server per test,
tests/redis_support.py)."""

from .redis_support import redis_server

__all__ = ["redis_server"]
