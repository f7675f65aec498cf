"""Helpers only tests and benchmarks use (simulated machines in Linux namespaces, throw-away TLS
certificates, an in-memory rendezvous backend). No product module imports this package."""
