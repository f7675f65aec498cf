"""Monitoring: the trainer's step ring (its format and writer), the node agent's step monitor,
hang/straggler alerts, Prometheus metrics, status views and goodput accounting. Torch-free."""
