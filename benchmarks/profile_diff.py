"""Where the CPU went between two ``--profile`` dumps of ``rendezvous_scale.py`` (the kill
path: ``before_kill`` -> ``round2``): per thread kind of every host, and the functions of the
cProfiled host by own CPU time.

Usage:
  python benchmarks/profile_diff.py DIR [--backend flashckpt] [--n 1024] [--top 40]
"""

from __future__ import annotations

import argparse
import json
import pstats
from pathlib import Path
from typing import Any


def _kinds(path: Path) -> dict[str, float]:
    data: dict[str, float] = json.loads(path.read_text())
    return data


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--backend", default="flashckpt")
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--before", default="before_kill")
    p.add_argument("--after", default="round2")
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args()
    out = Path(a.dir)
    for before in sorted(out.glob(f"{a.backend}-n{a.n}-m*-{a.before}.threads.json")):
        host = before.name.split(f"-{a.before}")[0]
        after = out / f"{host}-{a.after}.threads.json"
        if not after.exists():
            continue
        b, c = _kinds(before), _kinds(after)
        diff = {k: round(c.get(k, 0.0) - b.get(k, 0.0), 3) for k in set(b) | set(c)}
        total = round(sum(diff.values()), 3)
        print(f"{host}: {total} CPU-s, by thread kind:")
        for k, v in sorted(diff.items(), key=lambda kv: -kv[1]):
            if abs(v) >= 0.005:
                print(f"  {v:8.3f}  {k}")
    for before in sorted(out.glob(f"{a.backend}-n{a.n}-m*-{a.before}.prof")):
        host = before.name.split(f"-{a.before}")[0]
        after = out / f"{host}-{a.after}.prof"
        if not after.exists():
            continue
        sb: dict[Any, Any] = pstats.Stats(str(before)).stats  # type: ignore[attr-defined]
        sa: dict[Any, Any] = pstats.Stats(str(after)).stats  # type: ignore[attr-defined]
        rows = []
        for func, (_cc, nc, tt, ct, _callers) in sa.items():
            _, nc0, tt0, ct0, _ = sb.get(func, (0, 0, 0.0, 0.0, {}))
            rows.append((tt - tt0, ct - ct0, nc - nc0, func))
        own = sum(r[0] for r in rows)
        print(f"\n{host} (cProfiled): {own:.3f} CPU-s of own time in functions; top by own time:")
        print("   own_s   cum_s    calls  function")
        for tt, ct, nc, (file, line, name) in sorted(rows, key=lambda r: -r[0])[: a.top]:
            print(f"{tt:8.3f} {ct:7.3f} {nc:8d}  {Path(file).name}:{line}({name})")
        print("\ntop by cumulative time:")
        for tt, ct, nc, (file, line, name) in sorted(rows, key=lambda r: -r[1])[: a.top]:
            print(f"{tt:8.3f} {ct:7.3f} {nc:8d}  {Path(file).name}:{line}({name})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
