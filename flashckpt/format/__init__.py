"""Byte formats: tensors' layout and safetensors headers, shared-memory slots, snapshot meta,
manifests and committed checkpoints in storage. Imports only ``flashckpt.errors``/``names``/
``envnames``; never torch at module level."""
