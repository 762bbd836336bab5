"""``kvlookup explain``: ask a controller why a prompt's lookup matched nothing (or less).

Tokens come as a JSON list or comma list (argument, or stdin when omitted), or ``--text`` with
the Llama-3 tokenizer (the ``demo`` extra). Prints the diagnosis and a table per instance (rich),
or the raw answer with ``--json``. Exit status: 0 answered, 1 the controller refused (its error
is printed), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

#: Llama-3's begin-of-text token, which every chat prompt an engine caches starts with.
BOS = "<|begin_of_text|>"


def add_parser(sub) -> None:
    e = sub.add_parser("explain", help="why did a lookup match nothing, or less than expected (POST /lookup/explain)")
    e.add_argument("tokens", nargs="?", help="token ids, a JSON list or comma separated (default: read stdin)")
    e.add_argument("--text", help="a prompt to tokenize with the Llama-3 tokenizer (needs the demo extra); "
                                  "it starts with <|begin_of_text|> as an engine's prompt does (and the dashboard's)")
    e.add_argument("--no-bos", action="store_true", help="with --text: do not add <|begin_of_text|>")
    e.add_argument("--lora-name", help="the request's LoRA adapter (vLLM namespaces)")
    e.add_argument("--cache-salt", help="the request's cache salt (vLLM; LMCache MP)")
    e.add_argument("--model-name", help="scope the lookup to one model; explains LMCache MP instances too")
    e.add_argument("--world-size", type=int, help="with --model-name: the MP servers' world size (default 1)")
    e.add_argument("--url", default="http://127.0.0.1:9000", help="controller base URL (http://127.0.0.1:9000)")
    e.add_argument("--json", action="store_true", help="print the raw JSON answer")
    e.set_defaults(func=cmd_explain)


def read_tokens(args: argparse.Namespace) -> list[int]:
    """The tokens to explain; ValueError naming the problem."""
    if args.text is not None:
        from kvlookup.tokenizer import available

        if not available():
            raise ValueError("--text needs a tokenizer: pip install 'kvlookup[demo]'")
        from kvlookup.tokenizer import load_tokenizer

        text = args.text
        if not getattr(args, "no_bos", False) and not text.startswith(BOS):
            text = BOS + text
        return load_tokenizer().encode(text, add_special_tokens=False).ids
    text = (args.tokens if args.tokens is not None else sys.stdin.read()).strip()
    try:
        tokens = json.loads(text) if text.startswith("[") else [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"tokens must be a JSON list or comma-separated integers, got {text[:60]!r}") from None
    from kvlookup.client import validate_tokens

    return validate_tokens(tokens)


def cmd_explain(args: argparse.Namespace) -> int:
    body = {"tokens": read_tokens(args)}
    body.update({k: v for k, v in (("lora_name", args.lora_name), ("cache_salt", args.cache_salt),
                                   ("model_name", args.model_name), ("world_size", args.world_size)) if v})
    req = urllib.request.Request(args.url.rstrip("/") + "/lookup/explain", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            out = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        print(f"kvlookup explain: {exc.code}: {exc.read().decode(errors='replace').strip()}", file=sys.stderr)
        return 1
    except urllib.error.URLError as exc:
        print(f"kvlookup explain: cannot reach {args.url}: {exc.reason}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    render(out)
    return 0


def render(out: dict) -> None:
    """The diagnosis, then one row per instance."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    p = out["profile"]
    console.print(f"[bold]{out['tokens']} tokens, {out['chunks']} chunks[/] (chunk_size {p['chunk_size']}, "
                  f"none_hash {p['none_hash']}, extra_keys {p['extra_keys']}, {p['algorithm']}); cause: "
                  f"[bold]{out['cause']}[/]")
    for line in out["diagnosis"]:
        console.print(f"- {line}", highlight=False)
    if out.get("mp"):
        render_mp(console, out["mp"])
    if not out["instances"]:
        return
    table = Table()
    # an instance id is never cut to "…" (it is what one greps for): folded onto a second line at worst
    table.add_column("instance", overflow="fold")
    for name in ("rank", "space", "matched", "stop chunk", "offset", "reason"):
        table.add_column(name)
    table.add_column("explanation", overflow="fold")
    for e in out["instances"]:
        s = e["stop"] or {}
        table.add_row(e["instance_id"], str(e["worker_id"]), e["space"] or "lmcache", str(e["matched_prefix_length"]),
                      str(s.get("chunk", "")), str(s.get("token_offset", "")), s.get("reason", "complete"),
                      s.get("explanation", ""))
    console.print(table)


def render_mp(console, mp: dict) -> None:
    """The LMCache MP part (``mp`` of /lookup/explain): one line an MP instance, its matched prefix
    and each cause, e.g. ``other_namespace (model_name=..., cache_salt=, world_size=1)``."""
    if "error" in mp:
        console.print(f"LMCache MP: {mp['error']}", highlight=False)
        return
    console.print(f"LMCache MP ({mp['model_name']}, world_size {mp['world_size']}, chunk_size {mp['chunk_size']}, "
                  f"{mp['chunks']} chunks):", highlight=False)
    for inst, e in mp["instances"].items():
        causes = "; ".join(c["cause"] + (" (" + ", ".join(f"{k}={v}" for k, v in c.items() if k != "cause") + ")"
                                         if len(c) > 1 else "") for c in e["causes"]) or "hit"
        console.print(f"- {inst}: matched {e['matched_prefix_length']}: {causes}", highlight=False)
