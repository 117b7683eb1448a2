"""Where roles run: a Cluster of workers (in-process or Ray actors), placement of roles on
devices, weight sync from the policy to the engines, and restart-and-resume supervision."""
