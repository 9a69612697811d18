"""The multi-host bed's hostile host (tests/spark/test_multihost.py). Two commands:

    python bed_attacker.py sniff IFACE ADDRESS OUT STOPFILE
        in the bed's switch namespace: keep every TCP payload sent to ADDRESS that crosses IFACE
        (the switch port toward that host, read with an AF_PACKET socket), as a host on the path of
        its connections would, until STOPFILE exists; then write them to OUT (JSON, hex).
    python bed_attacker.py attack HOST PORT CAPTURE OUT
        on a host without the run's secret: try to get into the driver channel at HOST:PORT with a
        connection that says nothing, garbage, hellos with a guessed secret (this protocol's and the
        one that carried the secret in the clear), and every connection to PORT seen on the wire
        replayed byte for byte; write what each attempt got back to OUT (JSON).
"""
from __future__ import annotations

import json
import secrets
import socket
import struct
import sys
import time
from pathlib import Path

ETH_P_ALL = 0x0003


def sniff(iface: str, address: str, out: Path, stop: Path) -> None:
    target = socket.inet_aton(address)
    segments: dict[str, dict[int, bytes]] = {}  # "src:sport>dport" -> {seq: payload}
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(ETH_P_ALL)) as raw:
        raw.bind((iface, 0))
        raw.settimeout(0.2)
        out.with_suffix(".ready").touch()
        while not stop.exists():
            try:
                frame = raw.recv(1 << 16)
            except TimeoutError:
                continue
            if len(frame) < 34 or frame[12:14] != b"\x08\x00":  # IPv4 only
                continue
            ip = frame[14:]
            header = (ip[0] & 0x0F) * 4
            if ip[9] != 6 or ip[16:20] != target:  # TCP to the watched host
                continue
            total = struct.unpack(">H", ip[2:4])[0]
            tcp = ip[header:total]
            sport, dport, seq = struct.unpack(">HHI", tcp[:8])
            payload = tcp[(tcp[12] >> 4) * 4:]
            if payload:
                key = f"{socket.inet_ntoa(ip[12:16])}:{sport}>{dport}"
                segments.setdefault(key, {})[seq] = bytes(payload)
    out.write_text(json.dumps({key: _stream(parts).hex() for key, parts in segments.items()}))


def _stream(parts: dict[int, bytes]) -> bytes:
    """The bytes of one direction of a connection from its segments (retransmissions overlap)."""
    data, end = bytearray(), None
    for seq in sorted(parts):
        payload = parts[seq]
        if end is not None and seq < end:
            payload = payload[end - seq:]
        data += payload
        end = max(end or 0, seq + len(parts[seq]))
    return bytes(data)


def _frame(obj: dict[str, object]) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


def _try(host: str, port: int, payload: bytes, wait_s: float = 8.0) -> dict[str, object]:
    """Send `payload` on a fresh connection; what came back before the driver closed it."""
    received = bytearray()
    started = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=5) as sock:
            if payload:
                sock.sendall(payload)
            sock.settimeout(wait_s)
            while chunk := sock.recv(1 << 16):
                received += chunk
            closed = True
    except (ConnectionResetError, BrokenPipeError):  # closed with our bytes unread: a reset
        closed = True
    except TimeoutError:
        closed = False
    except OSError as exc:
        return {"error": str(exc)}
    replies = []  # frames after the driver's challenge: a reply would mean it took something in
    view = bytes(received)
    while len(view) >= 4:
        (size,) = struct.unpack(">I", view[:4])
        replies.append(view[4:4 + size][:200].decode("utf-8", "replace"))
        view = view[4 + size:]
    return {"closed_by_driver": closed, "seconds": round(time.monotonic() - started, 2), "frames": replies}


def attack(host: str, port: int, capture: Path, out: Path) -> None:
    seen = json.loads(capture.read_text()) if capture.exists() else {}
    replayed = {key: bytes.fromhex(data) for key, data in seen.items() if key.endswith(f">{port}")}
    guess = secrets.token_hex(32)
    attempts: dict[str, object] = {
        "silent": _try(host, port, b""),
        "garbage": _try(host, port, b"GET / HTTP/1.1\r\nHost: driver\r\n\r\n" + secrets.token_bytes(64)),
        "guessed_proof": _try(host, port, _frame({"hello": 2, "rank": 0, "proof": guess})
                              + _frame({"kind": "epoch", "epoch": 99, "loss": 1e9})),
        "secret_in_clear": _try(host, port, _frame({"hello": 1, "secret": guess, "rank": 0})
                                + _frame({"kind": "epoch", "epoch": 99, "loss": 1e9})),
    }
    for index, (key, data) in enumerate(sorted(replayed.items())):
        attempts[f"replay-{index}"] = {**_try(host, port, data), "bytes": len(data), "seen": key}
    out.write_text(json.dumps({"replayed_connections": len(replayed), "attempts": attempts}, indent=1))


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "sniff":
        sniff(args[0], args[1], Path(args[2]), Path(args[3]))
    elif command == "attack":
        attack(args[0], int(args[1]), Path(args[2]), Path(args[3]))
    else:
        raise SystemExit(f"unknown command {command!r}")
