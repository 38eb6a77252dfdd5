"""Ray: the job's cluster, placement of trainer ranks and rollout engines."""
