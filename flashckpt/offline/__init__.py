"""Committed checkpoints outside training: reading them (``flashckpt.load``) and exporting them to
other tools' formats (``flashckpt export``)."""
