"""Role classes hosted by a `reroll.distributed.Cluster` (in-process or as Ray actors).

Each is built as `cls(rank=r, world_size=n, **kwargs)` from plain, picklable arguments (paths and
config sections), so the same worker runs in this process or in another one.
"""
