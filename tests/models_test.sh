#!/usr/bin/env bash
# The model shapes built into the tools agree with data/model-shapes.json, asked of the programs
# themselves: kvf-allocator --help names exactly the models of the json, and for each one
# kvf-allocator --model NAME (one block, tensor parallelism 1) creates the layout the json gives,
# read back from its control segment with kvf-ringdump --json.
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
SHAPES=$ROOT/data/model-shapes.json

# The models kvf-allocator --help lists, one a line: the words after "--model NAME" up to the
# next option.
"$B/kvf-allocator" --help >"$KVFERRY_RUN_DIR/help.txt" || fail "kvf-allocator --help failed"
/usr/bin/python3 - "$KVFERRY_RUN_DIR/help.txt" "$SHAPES" <<'PY' || fail "kvf-allocator --help and model-shapes.json name different models"
import json, re, sys
lines = open(sys.argv[1]).read().splitlines()
at = next(i for i, l in enumerate(lines) if l.lstrip().startswith("--model NAME"))
text = []
for l in lines[at + 1:]:
    if l.lstrip().startswith("-"):
        break
    text.append(l)
helped = [w for w in re.split(r"[,\s]+", " ".join(text)) if w]
names = [m["name"] for m in json.load(open(sys.argv[2]))["models"]]
assert sorted(helped) == sorted(names), f"--help lists {helped}, model-shapes.json has {names}"
PY

# One allocator per model, all at once; each is ours, stopped and its memory removed at exit.
mapfile -t MODELS < <(/usr/bin/python3 -c 'import json,sys; print("\n".join(m["name"] for m in json.load(open(sys.argv[1]))["models"]))' "$SHAPES")
[ ${#MODELS[@]} -gt 0 ] || fail "no models in $SHAPES"
declare -A APID=()
stop_allocators() {
  local i
  for i in "${!APID[@]}"; do kill -TERM "${APID[$i]}" 2>/dev/null || true; done
  for i in "${!APID[@]}"; do wait "${APID[$i]}" 2>/dev/null || true; done
  for i in "${!APID[@]}"; do "$B/kvf-ctl" unlink --instance $TAG-m$i 2>/dev/null || true; done
}
AT_EXIT+=(stop_allocators)
for i in "${!MODELS[@]}"; do
  "$B/kvf-allocator" --instance $TAG-m$i --role decode --model "${MODELS[$i]}" --blocks 1 \
    >"$KVFERRY_RUN_DIR/$TAG-m$i.log" 2>&1 &
  APID[$i]=$!
done
for i in "${!MODELS[@]}"; do
  "$B/kvf-ctl" wait-ready --instance $TAG-m$i --roles allocator --pid "${APID[$i]}" --timeout-ms 20000 ||
    fail "kvf-allocator --model ${MODELS[$i]} did not come up: $(tail -n 3 "$KVFERRY_RUN_DIR/$TAG-m$i.log")"
  "$B/kvf-ringdump" --instance $TAG-m$i --json --records 0 >"$KVFERRY_RUN_DIR/m$i.json" ||
    fail "kvf-ringdump --instance $TAG-m$i failed"
  /usr/bin/python3 - "$KVFERRY_RUN_DIR/m$i.json" "$SHAPES" "${MODELS[$i]}" <<'PY' || fail "${MODELS[$i]}: kvf-allocator and model-shapes.json disagree"
import json, sys
l = json.load(open(sys.argv[1]))["layout"]
shapes = json.load(open(sys.argv[2]))
m = next(m for m in shapes["models"] if m["name"] == sys.argv[3])
got = (l["num_layers"], l["extra_layers"], l["kv_heads"], l["head_dim"], l["key_only"], l["dtype"],
       l["block_size"], l["num_blocks"])
want = (m["layers"], 0, m["kv_heads"], m["head_dim"], m["key_only"], m["dtype"], shapes["block_size_tokens"], 1)
assert got == want, (f"{sys.argv[3]}: kvf-allocator made (layers, extra, kv heads, head dim, key only, dtype, "
                     f"block size, blocks) {got}, model-shapes.json says {want}")
PY
done
pass "${#MODELS[@]} models: kvf-allocator --help lists exactly those of data/model-shapes.json, and creates each one's shape"
