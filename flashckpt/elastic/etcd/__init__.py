"""etcd v3: the client, a private etcd server (embedded and standalone), and the
``torch.distributed.Store`` on etcd."""
