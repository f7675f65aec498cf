"""Membership for flashckpt: etcd v3 client, torch elastic rendezvous backend, launcher.

Submodules are imported explicitly (``from flashckpt.elastic.etcd.client import EtcdClient``); this
package module imports nothing so that torch's entry-point discovery can load
:mod:`flashckpt.elastic.rendezvous.registry` without import cycles.
"""
