#!/usr/bin/env bash
# Packaging smoke test (CI runs it before the suite): what `pip install .` alone gives must run.
# Builds the wheel, installs it WITHOUT extras into a fresh venv outside the checkout, and from
# another directory starts `kvlookup controller` (embedded Redis) and `kvlookup sidecar` on the
# same fresh data dir at once, sends LMCache worker traffic (`kvlookup demo`), then checks
# GET /health and a POST /lookup. Prints the timings; exit 0 when everything answered.
# Usage: scripts/smoke-install.sh. Needs python3 >= 3.11 ($PYTHON) and a package index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/kvlookup-smoke-XXXXXX")
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

start=$SECONDS
"$PY" -m venv "$work/venv"
# the venv's own pip builds the wheel (in an isolated build env, so the venv stays fresh)
"$work/venv/bin/python" -m pip wheel -q --no-deps . -w "$work/dist"
"$work/venv/bin/python" -m pip install -q "$work"/dist/kvlookup-*.whl
echo "smoke: wheel built and installed without extras in $((SECONDS - start)) s"

cd "$work"  # away from the checkout: only the installed package can be imported
bin="$work/venv/bin"
read -r http pull < <("$bin/python" -c "from kvlookup.redis_server import free_port as f; print(f(), f())")
"$bin/kvlookup" controller --port "$http" --data-dir "$work/data" --log-level WARNING &
pids+=($!)
"$bin/kvlookup" sidecar --pull-url "127.0.0.1:$pull" --data-dir "$work/data" --log-level WARNING &
pids+=($!)
"$bin/python" - "$http" "$pull" "${pids[@]}" <<'EOF'
import json, os, subprocess, sys, time, urllib.request

http, pull, pids = f"http://127.0.0.1:{sys.argv[1]}", sys.argv[2], [int(p) for p in sys.argv[3:]]

def get(path):
    try:
        with urllib.request.urlopen(http + path, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except OSError:
        return 0, {}

t0 = time.monotonic()
while get("/health")[0] != 200:
    for pid in pids:
        if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            sys.exit(f"smoke: pid {pid} exited before the controller answered /health")
    if time.monotonic() - t0 > 60:
        sys.exit("smoke: the controller did not answer /health within 60 s")
    time.sleep(0.2)
status, health = get("/health")
print(f"smoke: /health {status} after {time.monotonic() - t0:.1f} s: {json.dumps(health)}")
subprocess.run([os.path.join(os.path.dirname(sys.executable), "kvlookup"), "demo", "--pull-url",
                f"127.0.0.1:{pull}", "--http", http], check=True, stdout=subprocess.DEVNULL)
seed = [128000, 849, 21435, 279, 26431, 315, 85748, 6636, 304, 4221, 4211, 13]
req = urllib.request.Request(http + "/lookup", data=json.dumps({"tokens": seed}).encode(),
                             headers={"Content-Type": "application/json"}, method="POST")
with urllib.request.urlopen(req, timeout=10) as resp:
    answer = json.loads(resp.read())
print(f"smoke: /lookup {json.dumps(answer)}")
if answer.get("lmcache_default_instance") != ["LocalCPUBackend", 12]:
    sys.exit("smoke: /lookup did not find the seed prompt the demo stored")
EOF
echo "smoke: ok in $((SECONDS - start)) s"
