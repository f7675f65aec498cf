"""Membership for flashckpt: etcd v3 client, torch elastic rendezvous backend, launcher.

Submodules are imported explicitly (``from elastic.etcd import EtcdClient``); this package
module imports nothing so that torch's entry-point discovery can load
:mod:`elastic.rdzv_registry` without import cycles.
"""
