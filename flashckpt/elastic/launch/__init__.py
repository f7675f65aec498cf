"""``flashckpt run``: the launcher, one machine's launch session (torch's elastic agent subclass),
the node agent runner, pre-warmed workers and the worker entry point."""
