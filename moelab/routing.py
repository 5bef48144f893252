"""Placeholder replaced by the routing implementation (issue 2)."""


def route(*args, **kwargs):
    raise NotImplementedError
