"""Where roles run: a Cluster of workers (in-process or Ray actors), the driver's proxies over
them (groups.py), placement of roles on devices, colocation turns, and weight sync from the
policy to the engines (the driver's side in weight_sync.py, the in-process transport in
collective.py). The roles themselves are built by the pipeline (`reroll.pipelines.roles`)."""
