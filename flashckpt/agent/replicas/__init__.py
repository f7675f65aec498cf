"""Replicas: copies of a snapshot held in another machine's node agent memory, and the transport
between node agents that moves them. Torch-free, like the rest of the node agent."""
