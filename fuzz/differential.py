"""Differential check of the two frame decoders on a corpus: the C++ decoder (native addon, through node) and the
independent Python reference decoder (python-bridge/tzip/reference.py) must accept exactly the same frames and
decode them to the same bytes. Run on the corpus libFuzzer grew for fuzz_frame (coverage-guided, so it holds the
frames that reach the most decoder paths) and on the seeds:

    .venv/bin/python fuzz/differential.py build/fuzz-corpus/fuzz_frame build/fuzz-seeds/frame

Prints one line per disagreement and a summary; exits 1 on any disagreement. scripts/fuzz.sh runs it after the
fuzz_frame target.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from tzip import reference

_NODE = r"""
import { readFileSync } from 'node:fs';
import { decompress } from './dist/src/native.js';
const out = {};
for (const f of JSON.parse(readFileSync(0, 'utf8'))) {
  try {
    const b = await decompress(readFileSync(f), { threads: 1 });
    out[f] = { ok: true, sha: (await import('node:crypto')).createHash('sha256').update(b).digest('hex') };
  } catch (e) { out[f] = { ok: false, code: e.code }; }
}
process.stdout.write(JSON.stringify(out));
"""


def main(dirs: list[str]) -> int:
    files = sorted(str(p) for d in dirs for p in Path(d).iterdir() if p.is_file())
    root = Path(__file__).resolve().parents[1]
    native = json.loads(subprocess.run(["node", "--input-type=module", "-e", _NODE], input=json.dumps(files),
                                       capture_output=True, text=True, check=True, cwd=root).stdout)
    bad = accepted = 0
    for f in files:
        data = Path(f).read_bytes()
        try:
            raw, _ = reference.decode_frame(data)
            ref = {"ok": True, "sha": hashlib.sha256(raw).hexdigest()}
        except ValueError as e:
            ref = {"ok": False, "why": str(e)[:120]}
        n = native[f]
        accepted += n["ok"]
        if n["ok"] != ref["ok"] or (n["ok"] and n["sha"] != ref["sha"]):
            bad += 1
            print(f"DISAGREE {f}: native {n}, reference {ref}")
    print(f"differential: {len(files)} frames, {accepted} accepted by both decoders, {bad} disagreements")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
