"""Machine liveness: lease-bound node keys, death detection (watch, probes, held peer links), the
pre-admission health check and the whole job's view from etcd."""
