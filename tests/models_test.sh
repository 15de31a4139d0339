#!/usr/bin/env bash
# The model shapes built into the tools (common/layout.c) agree with data/model-shapes.json.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
/usr/bin/python3 - "$ROOT" <<'PY'
import json, re, sys
root = sys.argv[1]
data = json.load(open(f"{root}/data/model-shapes.json"))["models"]
src = open(f"{root}/common/layout.c").read()
rows = dict((m[0], (int(m[1]), int(m[2]), int(m[3]), int(m[4]))) for m in
            re.findall(r'\{"([^"]+)", (\d+), (\d+), (\d+), (\d), KVF_DTYPE_BF16\}', src))
for m in data:
    want = (m["layers"], m["kv_heads"], m["head_dim"], int(m["key_only"]))
    got = rows.get(m["name"])
    assert got == want, f'{m["name"]}: layout.c has {got}, model-shapes.json {want}'
assert len(rows) == len(data), f"layout.c has {len(rows)} models, the json {len(data)}"
print(f"models_test: {len(data)} model shapes agree")
PY
