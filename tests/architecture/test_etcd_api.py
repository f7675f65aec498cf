"""etcd's wire stays inside ``flashckpt/elastic/etcd/`` (issue 45): every other module talks to
etcd through the client's public methods and the typed operations of
:mod:`flashckpt.elastic.etcd.ops` (``Compare``, ``Range``, ``Put``, ``Delete``, ``Txn``).

Outside ``elastic/etcd/``, no module

- calls a ``_call`` method (the client's private transport entry),
- builds or reads a request or answer body of etcd's JSON gateway (a dict keyed by one of the
  gateway's operation or answer names, or reading one of them: ``request_range``,
  ``response_range``, ``range_end``, ``mod_revision`` as a string key, ...),
- imports the client's private modules (``_wire``, ``_gateway``, ``_grpckv``, ``_kvproto``,
  ``_hpack``, ``_leasestream``).

Read from the source (AST), so a lazy import or a body built inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ETCD = "flashckpt/elastic/etcd/"

# The JSON gateway's names: operations and answers of a transaction, and a request's fields
# that only a hand-built body would spell as strings.
WIRE_NAMES = frozenset(
    {
        "request_range",
        "request_put",
        "request_delete_range",
        "request_txn",
        "response_range",
        "response_put",
        "response_delete_range",
        "response_txn",
        "range_end",
        "mod_revision",
        "create_revision",
        "count_only",
        "keys_only",
        "min_mod_revision",
        "sort_order",
        "sort_target",
    }
)
PRIVATE_MODULES = ("_wire", "_gateway", "_grpckv", "_kvproto", "_hpack", "_leasestream")


def _problems(source: str) -> list[str]:
    """What one module does that only ``elastic/etcd/`` may do, one line each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "_call":
                found.append(f"line {node.lineno}: calls ._call (use EtcdClient's methods)")
        elif isinstance(node, ast.Constant) and node.value in WIRE_NAMES:
            found.append(
                f"line {node.lineno}: spells the gateway's {node.value!r} (build a "
                "flashckpt.elastic.etcd.ops.Txn / Range / Put / Delete instead)"
            )
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            if any(
                n.startswith("flashckpt.elastic.etcd.") and n.split(".")[3] in PRIVATE_MODULES
                for n in names
            ):
                found.append(f"line {node.lineno}: imports a private module of elastic/etcd")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if (
                    parts[:3] == ["flashckpt", "elastic", "etcd"]
                    and len(parts) > 3
                    and (parts[3] in PRIVATE_MODULES)
                ):
                    found.append(f"line {node.lineno}: imports a private module of elastic/etcd")
    return found


def test_only_elastic_etcd_speaks_etcds_wire() -> None:
    wrong = []
    for path in sorted((ROOT / "flashckpt").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(ETCD):
            continue
        text = path.read_text()
        if "_call" in text or "etcd._" in text or any(n in text for n in WIRE_NAMES):
            wrong += [f"{rel} {p}" for p in _problems(text)]
    assert not wrong, "etcd's wire outside flashckpt/elastic/etcd/:\n" + "\n".join(wrong)


def test_the_rule_can_fail() -> None:
    """A planted hand-built transaction, a ``_call`` and a private import are each found; the
    same transaction through the typed API is not."""
    planted = (
        "from flashckpt.elastic.etcd._wire import b64\n"
        "def join(client, key):\n"
        "    body = {'success': [{'request_range': {'key': b64(key)}}]}\n"
        "    return client._call('/v3/kv/txn', body, timeout=None, idempotent=True)\n"
    )
    found = _problems(planted)
    assert len(found) == 3, found
    assert any("._call" in f for f in found)
    assert any("'request_range'" in f for f in found)
    assert any("private module" in f for f in found)
    typed = (
        "from flashckpt.elastic.etcd.ops import Range, Txn\n"
        "def join(client, key):\n"
        "    return client.txn(Txn(success=[Range(key)])).kvs(0)\n"
    )
    assert _problems(typed) == []
