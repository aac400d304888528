"""Capture writes in a child process, so disk I/O never competes with the forward for the GIL.

A capturing vLLM runner hands each pass to :class:`WriterProcess`: the tensors' raw bytes
and the pass's metadata go down a pipe as one frame; the child (:func:`main` in a
new interpreter, started once per runner) rebuilds the tensors and writes the
pass with :class:`~accuracy.writer.CaptureWriter`, exactly as an in-process write would
(same directories, counters, files and manifest). The engine's cost per pass is the copy
of the captured bytes into a frame; with ``hold=True`` (vLLM's capture) the frame waits
for :meth:`WriterProcess.release` at the start of the next step before it goes down the
pipe.

Frames (parent -> child, on the child's stdin): a 4-byte big-endian length, a UTF-8 JSON
header, then the payload (the tensors' bytes back to back, as the header lists them).
Acknowledgements (child -> parent, on the child's stdout): one JSON line per frame. No
pickle anywhere: the child only decodes JSON and raw bytes.

- ``{"op": "write", "seq", "what", "tensors": [[name, dtype, shape, nbytes], ...],
  "args": {...}}``: one pass; ``args`` are :meth:`CaptureWriter.write`'s keyword
  arguments (JSON). Acked ``{"seq", "error"}`` (``error``: None or the failure's text,
  which names the file).
- ``{"op": "flush", "seq"}``: acked when every earlier frame is done.
- ``{"op": "reset"}``: the parent has reported an error; later passes are written again.

After a failed pass the child skips later passes (acking them as skipped) until the
parent has raised the error and sent ``reset``: no pass after a missing one lands on disk
unnoticed. At most ``max_pending`` passes are unacknowledged: a full queue blocks the
forward until the disk catches up, so memory stays bounded.

The child runs on the CPUs this process is *not* bound to (vLLM's CPU worker binds its
forward threads), when there are any.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import struct
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import torch

from .tensor_io import tensor_bytes, tensor_from_bytes

_LEN = struct.Struct(">I")
_CHILD = "import sys; from accuracy.writer_process import main; sys.exit(main())"


def _json_default(o: Any) -> Any:
    """JSON for the scalar and array types metadata may carry (tensors, numpy values)."""
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"capture metadata: {type(o).__name__} is not JSON-serialisable: {o!r}")


class WriterProcess:
    """A child process writing one :class:`~accuracy.writer.CaptureWriter`'s passes.

    Args:
        writer: the writer's constructor arguments (``capture_dir``, ``dp_rank``,
            ``tp_rank``, ``capture_filter``, ``config``; JSON-serialisable).
        max_pending: passes in flight (sent or held) before :meth:`submit` waits (>= 1).
        hold: keep each submitted pass (a copy of its bytes) until :meth:`release` or
            :meth:`flush` sends it, so the caller picks when the child works.

    ``submit`` raises, as ``RuntimeError`` naming the pass and the file, the first error
    of an earlier pass; ``flush`` waits until every submitted pass is on disk and raises
    the same way. A child that died is a ``RuntimeError`` naming its exit code.
    """

    def __init__(self, writer: dict[str, Any], max_pending: int = 64, hold: bool = False) -> None:
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1: {max_pending!r}")
        self.max_pending = max_pending
        self.hold = hold
        self._held: list[bytes] = []  # frames kept until release() (hold=True)
        self._pending = 0
        self._seq = 0
        self._error: str | None = None
        self._buf = b""
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = "1"
        init = json.dumps({"writer": writer, "cpus": sorted(_free_cpus())})
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, init],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=os.getcwd(),
            close_fds=True,
        )
        self._acks = self._proc.stdout.fileno()

    # --------------------------------------------------------------- parent side

    def submit(
        self,
        what: str,
        captures: Sequence[torch.Tensor],
        names: Sequence[str],
        req_ids: list[str] | None,
        positions: list[int],
        is_prefill: bool,
        *,
        tree: dict[str, Any] | None = None,
        padding_mask: list[bool] | None = None,
        token_ids: list[int] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Queue one pass (``what`` names it in errors); the other arguments are
        :meth:`CaptureWriter.write`'s, JSON-serialisable (tensors and numpy values in the
        metadata become lists). Metadata that is not JSON is a ``TypeError`` here,
        before anything is sent."""
        if len(captures) != len(names):
            raise ValueError(f"{len(captures)} captures but {len(names)} names")
        self._drain(block=False)
        self._raise()
        while self._pending + len(self._held) >= self.max_pending:
            self.release()
            self._drain(block=True)
            self._raise()
        bufs = [tensor_bytes(t) for t in captures]
        header = {
            "op": "write",
            "seq": self._seq,
            "what": what,
            "tensors": [
                [n, str(t.dtype).replace("torch.", ""), list(t.shape), len(b)]
                for n, t, b in zip(names, captures, bufs, strict=True)
            ],
            "args": {
                "req_ids": req_ids,
                "positions": positions,
                "is_prefill": bool(is_prefill),
                "tree": tree,
                "padding_mask": padding_mask,
                "token_ids": token_ids,
                "extra": extra,
            },
        }
        if self.hold:  # copied now: the forward's buffers may be reused before release()
            self._held.append(_frame(header, bufs))
        else:
            self._send(header, bufs)
            self._pending += 1
        self._seq += 1

    def release(self) -> None:
        """Send the frames kept by ``hold=True`` to the child (a no-op when none are kept).

        A capturing engine calls this as its next step starts: the child then decodes
        and writes while the forward keeps this process busy, instead of competing with
        the engine's own processes for the free CPUs between steps."""
        if not self._held or self._proc.stdin.closed:
            return
        frames, self._held = self._held, []
        try:
            for f in frames:
                self._proc.stdin.write(f)
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise self._died() from e
        self._pending += len(frames)

    def flush(self) -> None:
        """Wait until every submitted pass is written; raise the first error (a no-op
        after :meth:`close`)."""
        if self._proc.stdin.closed:
            return
        self.release()
        self._send({"op": "flush", "seq": -1}, [])
        self._pending += 1
        while self._pending:
            self._drain(block=True)
        self._raise()

    def close(self) -> None:
        """Flush, then end the child (idempotent)."""
        if self._proc.stdin.closed or self._proc.poll() is not None:
            return
        try:
            self.flush()
        finally:
            self._proc.stdin.close()
            self._proc.wait(timeout=60)

    def _send(self, header: dict[str, Any], bufs: list[memoryview]) -> None:
        data = _header(header)
        try:
            self._proc.stdin.write(data)
            for b in bufs:
                self._proc.stdin.write(b)
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise self._died() from e

    def _drain(self, block: bool) -> None:
        """Read the acknowledgements available (at least one when ``block``)."""
        while self._pending:
            ready, _, _ = select.select([self._acks], [], [], None if block else 0)
            if not ready:
                return
            chunk = os.read(self._acks, 1 << 16)
            if not chunk:
                raise self._died()
            self._buf += chunk
            *lines, self._buf = self._buf.split(b"\n")
            for line in lines:
                ack = json.loads(line)
                self._pending -= 1
                if ack.get("error") and self._error is None:
                    self._error = f"writing {ack['what']} failed: {ack['error']}"
            block = False

    def _raise(self) -> None:
        if self._error is not None:
            msg, self._error = self._error, None
            self._send({"op": "reset"}, [])
            raise RuntimeError(f"treespec capture: {msg}")

    def _died(self) -> RuntimeError:
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return RuntimeError(
            f"treespec capture: the writer process exited (code {code}) with "
            f"{self._pending} pass(es) unacknowledged"
        )


def _header(header: dict[str, Any]) -> bytes:
    """A frame's length prefix and JSON header."""
    data = json.dumps(header, default=_json_default).encode()
    return _LEN.pack(len(data)) + data


def _frame(header: dict[str, Any], bufs: list[memoryview]) -> bytes:
    """A whole frame as one bytes object (a copy of the tensors' bytes)."""
    return b"".join([_header(header), *bufs])


def _free_cpus() -> set[int]:
    """CPUs of this machine that this process is not bound to (empty: none, or unknown)."""
    if not hasattr(os, "sched_getaffinity"):
        return set()
    mine = os.sched_getaffinity(0)
    try:
        with open("/sys/devices/system/cpu/online") as f:
            online: set[int] = set()
            for part in f.read().strip().split(","):
                lo, _, hi = part.partition("-")
                online.update(range(int(lo), int(hi or lo) + 1))
    except (OSError, ValueError):
        online = set(range(os.cpu_count() or 1))
    return online - mine


# ----------------------------------------------------------------------------- child side


def _read_exact(f, n: int) -> bytes | None:
    data = f.read(n)
    if len(data) < n:
        return None
    return data


def main(argv: list[str] | None = None) -> int:
    """The child: decode frames from stdin, write passes, ack each on stdout."""
    from .writer import CaptureWriter

    argv = sys.argv[1:] if argv is None else argv
    init = json.loads(argv[0])
    cpus = set(init.get("cpus") or ())
    if cpus and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):  # CPUs taken away since: keep the inherited
            os.sched_setaffinity(0, cpus)
    os.nice(10)  # the engine's own processes share these CPUs: they go first
    torch.set_num_threads(1)
    acks = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the acks
    writer = CaptureWriter(**init["writer"])
    writer.enable()
    frames = sys.stdin.buffer
    failed = False
    while True:
        head = _read_exact(frames, _LEN.size)
        if head is None:
            return 0
        raw = _read_exact(frames, _LEN.unpack(head)[0])
        if raw is None:  # the parent went away mid-frame
            return 0
        header = json.loads(raw)
        op = header["op"]
        if op == "reset":
            failed = False
            continue
        if op == "flush":
            acks.write(json.dumps({"seq": header["seq"], "error": None}) + "\n")
            continue
        tensors = []
        for _name, dtype, shape, nbytes in header["tensors"]:
            data = _read_exact(frames, nbytes) if nbytes else b""
            if data is None:
                return 0
            tensors.append((dtype, shape, data))
        error = None
        if not failed:
            try:
                caps = [tensor_from_bytes(b, d, s) for d, s, b in tensors]
                names = [t[0] for t in header["tensors"]]
                writer.write(caps, names, **header["args"])
            except Exception as e:  # reported to the parent, which raises it
                error, failed = str(e) or type(e).__name__, True
        ack = {"seq": header["seq"], "what": header["what"], "error": error}
        acks.write(json.dumps(ack) + "\n")
