"""The ``flashckpt-etcd`` rendezvous: the handler torchrun and ``flashckpt run`` use, its
registration with torchrun, and stable group ranks.

Keep this ``__init__`` empty: torch imports ``registry`` while its own rendezvous package is
still initialising."""
