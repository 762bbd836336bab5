#!/usr/bin/env bash
# Packaging smoke test (CI runs it before the suite): what `pip install .` alone gives must run.
# Builds the wheel, installs it WITHOUT extras into a fresh venv outside the checkout, and from
# a project directory with its own app/ and sidecar/ packages starts `python -m kvlookup
# controller` (embedded Redis) and `kvlookup sidecar` on the
# same fresh data dir at once, sends LMCache worker traffic (`kvlookup demo`), then checks
# GET /health, a POST /lookup and the dashboard (GET /, its static files, GET /controller/overview;
# POST /tokenize is absent without the demo extra). Prints the timings; exit 0 when everything answered.
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
# the wheel installs one top-level name: a project's own app/, sidecar/ or bench/ cannot shadow it
tops=$("$PY" -c 'import sys, zipfile; print(" ".join(sorted({n.split("/")[0] for n in zipfile.ZipFile(sys.argv[1]).namelist() if ".dist-info/" not in n})))' "$work"/dist/kvlookup-*.whl)
if [ "$tops" != "kvlookup" ]; then
  echo "smoke: the wheel's top-level names are '$tops', not 'kvlookup'" >&2
  exit 1
fi
# the C hot path (kvlookup._native, setup.py: optional): in the wheel when a compiler was there, and in
# use by the installed package; KVLOOKUP_REQUIRE_NATIVE=1 (CI) makes a wheel without it a failure
native=$(cd "$work" && "$work/venv/bin/python" -c 'from kvlookup import native; print("in use" if native.ext else "not in use: " + native.WHY_NOT)')
echo "smoke: native extension $native"
if [ "${KVLOOKUP_REQUIRE_NATIVE:-}" = 1 ] && [ "$native" != "in use" ]; then
  echo "smoke: KVLOOKUP_REQUIRE_NATIVE=1 but the wheel's C extension is $native" >&2
  exit 1
fi

# away from the checkout, in a project directory with packages of its own named app and sidecar:
# only the installed package is kvlookup's, and `python -m kvlookup` (cwd on sys.path) still works
mkdir -p "$work/project/app" "$work/project/sidecar"
printf 'raise ImportError("the user project'"'"'s own app package was imported")\n' > "$work/project/app/__init__.py"
cp "$work/project/app/__init__.py" "$work/project/sidecar/__init__.py"
cd "$work/project"
bin="$work/venv/bin"
read -r http pull < <("$bin/python" -c "from kvlookup.proc.redis_server import free_port as f; print(f(), f())")
"$bin/python" -m kvlookup controller --port "$http" --data-dir "$work/data" --log-level WARNING &
pids+=($!)
"$bin/kvlookup" sidecar --pull-url "127.0.0.1:$pull" --data-dir "$work/data" --log-level WARNING &
pids+=($!)
"$bin/python" - "$http" "$pull" "${pids[@]}" <<'EOF'
import json, os, re, subprocess, sys, time, urllib.error, urllib.request

http, pull, pids = f"http://127.0.0.1:{sys.argv[1]}", sys.argv[2], [int(p) for p in sys.argv[3:]]

def get(path, decode=json.loads):
    try:
        with urllib.request.urlopen(http + path, timeout=5) as resp:
            return resp.status, decode(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}
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
subprocess.run([os.path.join(os.path.dirname(sys.executable), "kvlookup"), "demo", "--exit", "--pull-url",
                f"127.0.0.1:{pull}", "--http", http], check=True, stdout=subprocess.DEVNULL, timeout=60)
seed = [128000, 849, 21435, 279, 26431, 315, 85748, 6636, 304, 4221, 4211, 13]
req = urllib.request.Request(http + "/lookup", data=json.dumps({"tokens": seed}).encode(),
                             headers={"Content-Type": "application/json"}, method="POST")
with urllib.request.urlopen(req, timeout=10) as resp:
    answer = json.loads(resp.read())
print(f"smoke: /lookup {json.dumps(answer)}")
if answer.get("lmcache_default_instance") != ["LocalCPUBackend", 12]:
    sys.exit("smoke: /lookup did not find the seed prompt the demo stored")
status, page = get("/", decode=lambda b: b.decode())
files = re.findall(r'(?:src|href)="(static/[^"]+)"', page) if status == 200 else []
if "<title>kvlookup fleet</title>" not in page or "static/dashboard.js" not in files:
    sys.exit(f"smoke: GET / answered {status} without the dashboard page")
for path in files:
    status, body = get("/" + path, decode=bytes)
    if status != 200 or not body:
        sys.exit(f"smoke: GET /{path} answered {status}: the static files are not in the wheel")
status, overview = get("/controller/overview")
ids = [i["instance_id"] for i in overview.get("instances", [])]
if status != 200 or "lmcache_default_instance" not in ids or overview["features"]["tokenize"]:
    sys.exit(f"smoke: GET /controller/overview answered {status}: {json.dumps(overview)[:300]}")
req = urllib.request.Request(http + "/tokenize", data=b'{"text": "hi"}', method="POST",
                             headers={"Content-Type": "application/json"})
try:
    urllib.request.urlopen(req, timeout=5)
    sys.exit("smoke: POST /tokenize answered without a tokenizer installed")
except urllib.error.HTTPError as exc:
    if exc.code != 404:
        sys.exit(f"smoke: POST /tokenize answered {exc.code}, expected 404 without the demo extra")
print(f"smoke: dashboard GET / and {len(files)} static files served; overview lists {ids}")
status, api = get("/openapi.json")
if status != 200 or api.get("openapi") != "3.1.0" or "/lookup" not in api.get("paths", {}):
    sys.exit(f"smoke: GET /openapi.json answered {status}")
status, page = get("/docs", decode=lambda b: b.decode())
docs = re.findall(r'(?:src|href)="/(static/swagger-ui/[^"]+)"', page) if status == 200 else []
for path in docs:
    status, body = get("/" + path, decode=bytes)
    if status != 200 or not body:
        sys.exit(f"smoke: GET /{path} answered {status}: Swagger UI is not in the wheel")
if len(docs) < 3:
    sys.exit(f"smoke: GET /docs names {docs}, not Swagger UI's files")
print(f"smoke: /openapi.json ({len(api['paths'])} paths) and /docs with {len(docs)} Swagger UI files served")
EOF
echo "smoke: ok in $((SECONDS - start)) s"
