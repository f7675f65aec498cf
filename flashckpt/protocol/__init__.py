"""The trainer <-> node agent protocol: typed messages, one JSON object per line over a local Unix
socket. Torch-free."""
