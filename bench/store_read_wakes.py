"""What a peer's stream entry costs the router that reads it, by how it is read.

Beside a peer, a router with ``--state-store`` spends several hundred µs of CPU per
request more than alone (``bench/shared_state_http_cpu.py --peers``): one ``XREAD BLOCK``
reply per entry the peer writes, each waking the router, then the next ``XREAD`` sent.
Would Redis pub/sub, which pushes every message without a command re-issued, cost less?
And how much of either is the wake-up itself?

One writer process writes ``--n`` entries, ``--gap-ms`` apart, each as an ``XADD`` to a
stream and a ``PUBLISH`` of the same bytes (one socket write, on a connection Redis
does not answer: ``CLIENT REPLY OFF``, as the store publishes). Three reader processes
run at the same time, each an event loop (uvloop, as ``kvroute serve`` runs) on a
connection of its own, parsing with hiredis as the store does:

* ``xread``: ``XREAD COUNT 20 BLOCK 3000`` from the last id read, re-issued after each
  reply (the store's read loop, less the applying);
* ``subscribe``: ``SUBSCRIBE`` to the channel, each pushed message parsed;
* ``timer``: no connection at all, a timer every ``--gap-ms``: the cost of waking an
  idle event loop and going back to sleep, with no work.

Each reader's CPU (user + kernel, ``getrusage``) over the run, per entry (or per timer
expiry), the median over ``--rounds`` rounds. Redis's and the writer's CPU are not
counted.

Usage:
    python bench/store_read_wakes.py --gaps-ms 50,20,5,1 --n 300 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import hiredis
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

READERS = ("xread", "subscribe", "timer")
STREAM, CHANNEL, END = "bench:s", "bench:ch", b"end"


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.parser = reader, writer, hiredis.Reader()

    @classmethod
    async def open(cls, port: int) -> _Conn:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    def send(self, *command: str | bytes | int) -> None:
        self.writer.write(hiredis.pack_command(command))  # type: ignore[arg-type]

    async def reply(self) -> object:
        while True:
            got = self.parser.gets()
            if got is not False:
                return got
            chunk = await self.reader.read(1 << 16)
            if not chunk:
                raise ConnectionError("redis closed the connection")
            self.parser.feed(chunk)


async def _writer(port: int, n: int, gap_s: float, size: int) -> None:
    conn = await _Conn.open(port)
    conn.send("CLIENT", "REPLY", "OFF")
    await asyncio.sleep(1.0)  # the readers are waiting by then
    payload = os.urandom(size)
    for _ in range(n):
        conn.writer.write(
            hiredis.pack_command(("XADD", STREAM, "MAXLEN", "~", "2000", "*", "b", payload))  # type: ignore[arg-type]
            + hiredis.pack_command(("PUBLISH", CHANNEL, payload))  # type: ignore[arg-type]
        )
        await asyncio.sleep(gap_s)
    conn.send("XADD", STREAM, "*", "b", END)
    conn.send("PUBLISH", CHANNEL, END)
    await asyncio.sleep(0.5)


async def _reader(kind: str, port: int, n: int, gap_s: float) -> tuple[int, float, float]:
    """Entries read (or timer expiries) and the CPU (user, kernel) seconds it took."""
    got = 0
    if kind == "timer":
        u0, s0 = _cpu()
        for _ in range(n):
            await asyncio.sleep(gap_s)
        u1, s1 = _cpu()
        return n, u1 - u0, s1 - s0
    conn = await _Conn.open(port)
    if kind == "subscribe":
        conn.send("SUBSCRIBE", CHANNEL)
        await conn.reply()
        u0, s0 = _cpu()
        while True:
            message = await conn.reply()
            assert isinstance(message, list)
            if message[2] == END:
                break
            got += 1
    else:
        conn.send("XREVRANGE", STREAM, "+", "-", "COUNT", "1")
        latest = await conn.reply()
        last = latest[0][0] if isinstance(latest, list) and latest else b"0"
        u0, s0 = _cpu()
        done = False
        while not done:
            conn.send("XREAD", "COUNT", 20, "BLOCK", 3000, "STREAMS", STREAM, last)
            reply = await conn.reply()
            if not isinstance(reply, list):
                continue  # nothing before the block ended
            for _key, entries in reply:
                for entry_id, fields in entries:
                    last = entry_id
                    if fields[1] == END:
                        done = True
                    else:
                        got += 1
    u1, s1 = _cpu()
    conn.writer.close()
    return got, u1 - u0, s1 - s0


def _child(args: argparse.Namespace) -> None:
    gap_s = args.gap_ms / 1000
    if args.child == "writer":
        uvloop.run(_writer(args.port, args.n, gap_s, args.entry_bytes))
        return
    got, user, kernel = uvloop.run(_reader(args.child, args.port, args.n, gap_s))
    print(f"{got} {user} {kernel}")


def _round(port: int, n: int, gap_ms: float, size: int) -> dict[str, tuple[float, float]]:
    """Per reader: (µs per entry, of it in the kernel)."""
    base = [sys.executable, __file__, "--port", str(port), "--n", str(n)]
    base += ["--gap-ms", str(gap_ms), "--entry-bytes", str(size), "--child"]
    readers = {
        kind: subprocess.Popen([*base, kind], stdout=subprocess.PIPE, text=True) for kind in READERS
    }
    time.sleep(0.5)  # connected and waiting before the first entry
    subprocess.run([*base, "writer"], check=True, timeout=n * gap_ms / 1000 * 4 + 60)
    out: dict[str, tuple[float, float]] = {}
    for kind, proc in readers.items():
        text, _ = proc.communicate(timeout=60)
        got, user, kernel = text.split()
        if int(got) != n:
            raise SystemExit(f"{kind}: read {got} entries of {n}")
        out[kind] = (1e6 * (float(user) + float(kernel)) / n, 1e6 * float(kernel) / n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gaps-ms", default="50,20,5,1", help="gaps between entries (ms)")
    ap.add_argument("--n", type=int, default=300, help="entries per round and gap")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--entry-bytes", type=int, default=300, help="bytes per entry")
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--gap-ms", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--child", choices=(*READERS, "writer"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    from support import RedisServer

    gaps = [float(g) for g in args.gaps_ms.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp))
        try:
            rows: dict[float, dict[str, list[tuple[float, float]]]] = {
                g: {k: [] for k in READERS} for g in gaps
            }
            for r in range(args.rounds):
                for g in gaps:  # interleaved: every gap once per round
                    for kind, cost in _round(redis.port, args.n, g, args.entry_bytes).items():
                        rows[g][kind].append(cost)
                print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
        finally:
            redis.stop()
    print(
        f"\nreader CPU per entry, µs (of it kernel), median of {args.rounds} rounds, "
        f"{args.n} entries of {args.entry_bytes} bytes each"
    )
    ratios = " | xread / timer | subscribe / timer |"
    print("| gap between entries | " + " | ".join(READERS) + ratios)
    print("|---" * (len(READERS) + 3) + "|")
    for g in gaps:
        med = {
            k: (
                statistics.median(c for c, _ in rows[g][k]),
                statistics.median(s for _, s in rows[g][k]),
            )
            for k in READERS
        }
        cells = " | ".join(f"{med[k][0]:.0f} ({med[k][1]:.0f})" for k in READERS)
        t = med["timer"][0]
        print(f"| {g:g} ms | {cells} | {med['xread'][0] / t:.2f} | {med['subscribe'][0] / t:.2f} |")


if __name__ == "__main__":
    main()
