"""Listing of a capture directory (``python -m accuracy inspect DIR``)."""

from __future__ import annotations

import json
import os
import sys
from typing import TextIO

from .tensor_io import read, read_manifest


def inspect_dir(capture_dir: str, file: TextIO | None = None) -> int:
    """Print manifest summary, then per forward pass its modules, shapes and dtypes
    (from the metadata, without loading tensors). Returns the number of passes."""
    file = file or sys.stdout
    manifest = read_manifest(capture_dir)
    if manifest:
        print(f"manifest: versions={json.dumps(manifest.get('versions'))}", file=file)
        print(
            f"  git_revision={manifest.get('git_revision')} dtypes={manifest.get('dtypes')}",
            file=file,
        )
        print(f"  modules={len(manifest.get('modules', []))}", file=file)
    fwds = read(capture_dir, load_tensors=False)
    sub = [d for d in ("draft", "vision") if os.path.isdir(os.path.join(capture_dir, d))]
    print(
        f"{capture_dir}: {len(fwds)} forward pass(es)" + (f"; sub-captures: {sub}" if sub else ""),
        file=file,
    )
    for fwd in fwds:
        m = fwd.metadata
        pos = m.positions
        pos_s = f"{pos[:1]}..{pos[-1:]}" if len(pos) > 6 else str(pos)
        tree = f" tree={len(m.tree.parents)} nodes, depth<={max(m.tree.depths)}" if m.tree else ""
        print(
            f"\n[{m.seq}] dp{m.dp_rank}/{fwd.dir_name} req_ids={m.req_ids} positions={pos_s}{tree}",
            file=file,
        )
        shapes = m.shapes
        for mod in m.modules:
            for rank, (shape, dtype) in sorted(shapes.get(mod, {}).items()):
                print(f"  {mod:<50} rank{rank}  {str(shape):<20} {dtype}", file=file)
    return len(fwds)
