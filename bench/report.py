"""Render results JSON into docs/benchmarks.md and PNG plots (matplotlib) in docs/img/."""

from __future__ import annotations

from pathlib import Path

from kvlookup.bench.procs import PARTS, REPO

DOCS = REPO / "docs"
IMG = DOCS / "img"


def targets(res: dict) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) rows; met None when the part did not run."""
    rows: list[tuple[str, str, bool | None]] = []
    cmp_ = res.get("compare")
    if cmp_:
        conf = cmp_["config"]["kv_configs"][0]
        ratios = [r for r in cmp_["ratios"] if r["gunicorn"] == conf]
        best = {r["concurrency"]: r["throughput_ratio"] for r in ratios}
        txt = ", ".join(f"c={c}: {v}x" for c, v in best.items())
        rows.append(("HTTP lookup throughput >= 1.5x LMCache 0.5.6 (same run), at every concurrency measured",
                     txt + f" (gunicorn {conf})",
                     all(v >= 1.5 for v in best.values())))
    sw = res.get("sweeps")
    if sw:
        row = next((r for r in sw["prompt_length"] if r["tokens"] == 32768), None)
        if row:
            rows.append(("p99 <= 2 ms at 32k tokens, 8 instances",
                         f"HTTP p99 {row['http_c1']['p99_ms']} ms (p50 {row['http_c1']['p50_ms']}); "
                         f"in-process p99 {row['inprocess']['p99_ms']} ms (p50 {row['inprocess']['p50_ms']})",
                         row["http_c1"]["p99_ms"] <= 2.0))
        sizes = sw["index_size"]
        if len(sizes) >= 2:
            a, b = sizes[0], sizes[-1]
            ratio = b["inprocess"]["p50_ms"] / a["inprocess"]["p50_ms"]
            rows.append((f"lookup latency flat from 10k to {b['records']:,} records",
                         f"in-process p50 {a['inprocess']['p50_ms']} -> {b['inprocess']['p50_ms']} ms "
                         f"({ratio:.2f}x); HTTP p50 {a['http_c1']['p50_ms']} -> {b['http_c1']['p50_ms']} ms",
                         ratio <= 1.25))
    ing = res.get("ingest")
    if ing:
        rows.append(("ingest >= 150k chunk ops/s per sidecar", f"{ing['ops_per_s']:,} ops/s",
                     ing["ops_per_s"] >= 150_000))
    mem = res.get("memory")
    if mem:
        txt = "; ".join(f"{c['holders_per_chunk']} holder(s)/chunk: {c['bytes_per_record']} B"
                        for c in mem["cases"])
        rows.append(("<= 120 B Redis memory per (chunk, holder) record", txt,
                     all(c["bytes_per_record"] <= 120 for c in mem["cases"])))
    wk = res.get("wrk")
    if wk:
        by = {(r["tokens"], r["concurrency"]): r["throughput_ratio"] for r in wk["rows"]}
        short = {c: v for (n, c), v in by.items() if n == 12}
        long = {c: v for (n, c), v in by.items() if n == 32768}
        if short:
            rows.append(("12-token lookups: throughput >= 1.2x LMCache at c=1, 4, 16 (wrk, same run)",
                         ", ".join(f"c={c}: {v}x" for c, v in sorted(short.items())), min(short.values()) >= 1.2))
        if long:
            p99 = next((r["p99_ratio"] for r in wk["rows"] if r["tokens"] == 32768 and r["concurrency"] == 1), None)
            rows.append(("32k-token lookups, 8 instances: throughput >= 2.5x LMCache; c=1 p99 <= half of LMCache's",
                         ", ".join(f"c={c}: {v}x" for c, v in sorted(long.items())) + f"; c=1 p99 ratio {p99}",
                         min(long.values()) >= 2.5 and p99 is not None and p99 <= 0.5))
    cl = res.get("cluster")
    if cl:
        row = next((r for r in cl["lookups"] if r["tokens"] == 32768), None)
        if row:
            http = [h for h in row.get("http", [])]
            ok = row["p50_ratio"] <= 1.5 and all(h["throughput_ratio"] >= 1 / 1.5 for h in http)
            rows.append(("32k-token lookup on a 3-master cluster <= 1.5x one server, each its default (same run)",
                         f"p50 {row['cluster']['p50_ms']} vs {row['single']['p50_ms']} ms ({row['p50_ratio']}x)"
                         + "".join(f"; HTTP c={h['concurrency']} {h['throughput_ratio']}x req/s" for h in http), ok))
        bal = cl["balance"]["cluster"]
        rows.append(("records balance across masters, Mooncake trace: max/mean <= 1.2",
                     f"keys {bal['keys_max_mean']}, memory {bal['memory_max_mean']}",
                     max(bal["keys_max_mean"], bal["memory_max_mean"]) <= 1.2))
    rows += _mp_targets(res.get("mp"))
    return rows


def _mp_targets(mp: dict | None) -> list[tuple[str, str, bool | None]]:
    """Issue 19's targets against LMCache's MP coordinator (bench/mp.py, one run)."""
    if not mp:
        return []
    k, c = mp["ingest_kvlookup"], mp["ingest_coordinator"]
    rows: list[tuple[str, str, bool | None]] = [(
        "MP ingest: POST /events placements/s >= 10x the MP coordinator's (same run)",
        f"{k['placements_per_s']:,} vs {c['placements_per_s']:,}/s whole server ({mp['ingest_ratio']}x); per CPU "
        f"second {mp.get('ingest_cpu_ratio', '-')}x", mp["ingest_ratio"] >= 10)]
    row = next((r for r in mp["lookups"] if r["tokens"] == 32768), None)
    if row:
        rows.append(("MP /directory/lookup at 32k tokens >= 5x faster than the coordinator at p50 and p99",
                     f"p50 {row['kvlookup']['p50_ms']} vs {row['coordinator']['p50_ms']} ms ({row['p50_ratio']}x), "
                     f"p99 {row['kvlookup']['p99_ms']} vs {row['coordinator']['p99_ms']} ms ({row['p99_ratio']}x)",
                     row["p50_ratio"] >= 5 and row["p99_ratio"] >= 5))
    rows.append(("MP: <= 150 B of Redis memory per placement", f"{mp['redis_bytes_per_placement']} B",
                 mp["redis_bytes_per_placement"] <= 150))
    return rows


def plots(res: dict, tag: str) -> list[str]:
    """The PNG plots; ValueError (one line from ``kvlookup bench report``) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("bench report draws its plots with matplotlib, which is not installed: "
                         "pip install 'kvlookup[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    made = []

    def save(fig, name: str) -> None:
        path = IMG / f"bench{tag}-{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        made.append(path.name)

    cmp_ = res.get("compare")
    if cmp_:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        series: dict[str, list] = {}
        for r in cmp_["http"]:
            label = "LMCache 0.5.6" if r["target"] == "lmcache" else f"kvlookup {r['gunicorn']}"
            series.setdefault(label, []).append(r)
        for label, rs in series.items():
            rs = sorted(rs, key=lambda r: r["concurrency"])
            cs = [r["concurrency"] for r in rs]
            a1.plot(cs, [r["req_s"] for r in rs], marker="o", label=label)
            a2.plot(cs, [r["p99_ms"] for r in rs], marker="o", label=label + " p99")
            a2.plot(cs, [r["p50_ms"] for r in rs], marker=".", linestyle="--", label=label + " p50")
        for ax, yl in ((a1, "lookups/s"), (a2, "latency (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(yl)
            ax.legend(fontsize=7)
        a1.set_title("HTTP /lookup throughput, Mooncake trace prompts")
        a2.set_title("HTTP /lookup latency")
        save(fig, "http")
    sw = res.get("sweeps")
    if sw:
        for key, xk, title in (("prompt_length", "tokens", "prompt length (tokens), 8 instances"),
                               ("instances", "instances", "instances holding a 32k prompt"),
                               ("index_size", "records", "index size (records), 32k prompt, 8 instances")):
            rows = sw.get(key) or []
            if not rows:
                continue
            fig, ax = plt.subplots(figsize=(6, 4))
            xs = [r[xk] for r in rows]
            for path, label in (("inprocess", "in-process Client"), ("http_c1", "HTTP c=1")):
                ax.plot(xs, [r[path]["p50_ms"] for r in rows], marker="o", label=f"{label} p50")
                ax.plot(xs, [r[path]["p99_ms"] for r in rows], marker="x", linestyle="--", label=f"{label} p99")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(title)
            ax.set_ylabel("lookup latency (ms)")
            ax.legend(fontsize=7)
            save(fig, key.replace("_", "-"))
    return made


def _table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _parts(res: dict) -> list[tuple[str, dict]]:
    return [(name, res[name]) for name in PARTS if name in res]


def markdown(res: dict, images: list[str], results_path: Path) -> str:
    m = res["machine"]
    try:
        rel = results_path.resolve().relative_to(REPO)
    except ValueError:
        rel = results_path
    lines = ["# Benchmarks", "",
             "kvlookup's controller against LMCache 0.5.6's own `lmcache_controller`, fed the same worker "
             "traffic and hit by the same load generator, **in one run on one machine**. Ratios matter; "
             "absolute times depend on the box (this one is small and shared, so p99s are noisy).", "",
             "Reproduce (every number and plot below):", "", "```",
             "kvlookup bench all" + (" --quick" if res.get("quick") else ""), "```", "",
             f"Results JSON: `{rel}`{' (quick mode: small sizes)' if res.get('quick') else ''}. "
             + "; ".join(f"{name}: `{part.get('command', res['command'])}` at {part.get('date', res['date'])}, "
                         f"{part.get('wall_s', '?')} s" for name, part in _parts(res)) + ".", "",
             f"Machine: {m['nproc']} cores ({m['cpu']}), {m['memory_gib']} GiB, Python {m['python']}, "
             f"{m['redis']}, {m['os']}.", "", "## Targets", "",
             _table(["target", "measured", "met"],
                    [[t, v, {True: "yes", False: "**no**", None: "-"}[ok]] for t, v, ok in targets(res)]), ""]
    cmp_ = res.get("compare")
    if cmp_:
        c, w = cmp_["config"], cmp_["workload"]
        ing = cmp_["ingest"]
        lp = cmp_["load_prompts"]
        lines += ["## Side by side with LMCache 0.5.6", "",
                  f"Workload: the first {w['requests']:,} requests of the Mooncake conversation trace, each "
                  f"512-token block id turned into 512 deterministic token ids (= two 256-token LMCache chunks), "
                  f"routed to {c['instances']} simulated instances (50% prefix-affine, else random) with LRU "
                  f"tiers of {c['cpu_chunks']:,} CPU and {c['disk_chunks']:,} disk chunks each. The replay "
                  f"(untimed, order only) yields {w['ops']:,} admit/evict operations, sent as LMCache 0.5.6 "
                  "`BatchedKVOperationMsg` frames (50 ops/frame, 50 frames/multipart, per-location seq_num) "
                  "after a DEALER `RegisterMsg`, byte-identical to both controllers.", "",
                  _table(["ingest of the trace, end to end", "ops", "applied in (s)", "ops/s"],
                         [[k, f"{v['ops']:,}", v["applied_s"], f"{v['ops_per_s']:,}"] for k, v in ing.items()]),
                  "", f"HTTP load: {lp['n']} distinct prompts from the last 30% of the trace (mean "
                  f"{lp['mean_tokens']:,} tokens, max {lp['max_tokens']:,}), `POST /lookup`, keep-alive "
                  f"`http.client` threads in a separate process, {c['duration_s']} s per point after 0.5 s "
                  "warm-up, targets alternating who goes first. LMCache runs its stock single uvicorn process; "
                  "kvlookup under gunicorn as `<worker class>:<workers>[x<threads>]` (uvicorn, the default; "
                  "gevent; gthread; sync, which closes each connection).",
                  "",
                  _table(["target", "concurrency", "req/s", "p50 ms", "p99 ms", "errors"],
                         [["LMCache 0.5.6" if r["target"] == "lmcache" else f"kvlookup {r['gunicorn']}",
                           r["concurrency"], r["req_s"], r["p50_ms"], r["p99_ms"], r["errors"]]
                          for r in sorted(cmp_["http"], key=lambda r: (r["target"], r["gunicorn"] or "",
                                                                        r["concurrency"]))]),
                  "", _table(["kvlookup config", "concurrency", "throughput kvlookup/LMCache",
                              "p50 LMCache/kvlookup", "p99 LMCache/kvlookup"],
                             [[r["gunicorn"], r["concurrency"], r["throughput_ratio"],
                               r["p50_ratio_lmcache_over_kvlookup"], r["p99_ratio_lmcache_over_kvlookup"]]
                              for r in cmp_["ratios"]]), ""]
        lines += [f"![HTTP]({'img/' + n})" for n in images if n.endswith("-http.png")]
        a = cmp_["agreement"]
        lines += ["", "### Do the answers agree? Who is right?", "",
                  f"{a['requests']:,} lookups (last 30% of the trace) asked of both after ingest; the reference "
                  "is the simulated fleet's own final state: every instance's longest run of chunks from "
                  "token 0 held in any tier (kvlookup's rule). Compared as {instance: matched length}.", "",
                  _table(["measure", "value"], [
                      ["identical answers", f"{a['identical_answers_pct']}%"],
                      ["same best (longest) length", f"{a['same_best_length_pct']}%"],
                      ["same location where both name an instance",
                       f"{a['same_location_where_both_name_instance_pct']}%"],
                      ["kvlookup right", f"{a['right_pct']['kvlookup']}%"],
                      ["LMCache right", f"{a['right_pct']['lmcache']}%"],
                      ["kvlookup wrong (per instance)", a["wrong_kinds"]["kvlookup"] or "none"],
                      ["LMCache wrong (per instance)", a["wrong_kinds"]["lmcache"] or "none"]]), "",
                  "LMCache 0.5.6 credits, chunk by chunk, only the *first* registered instance holding each "
                  "chunk: replicas are omitted, and an instance found first for a later chunk is credited "
                  "although it lacks an earlier one (suffix-only / over-credit). Examples where they differ:",
                  ""]
        for ex in a["examples"][:4]:
            lines.append(f"- request {ex['request']}: truth `{ex['truth']}`; kvlookup `{ex['kvlookup']}`; "
                         f"LMCache `{ex['lmcache']}` ({', '.join(ex['lmcache_wrong']) or 'right'})")
        lines.append("")
    ing = res.get("ingest")
    if ing:
        lines += ["## Ingest (one sidecar)", "",
                  f"`kvlookup sidecar` process + its Redis; {ing['workers']} registered 0.5.6 workers, "
                  f"{ing['pushers']} pusher processes sending pre-encoded frames (80% admits of new int64 "
                  "hashes, 20% evicts of earlier ones); clock from first send to every worker's final "
                  "sentinel chunk visible in Redis.", "",
                  _table(["ops", "seconds", "chunk ops/s applied", "records after"],
                         [[f"{ing['ops']:,}", ing["seconds"], f"{ing['ops_per_s']:,}", f"{ing['records_after']:,}"]]),
                  ""]
    mem = res.get("memory")
    if mem:
        lines += ["## Redis memory per (chunk, holder) record", "",
                  "Fresh Redis per case, records written by `Store.apply`; `INFO memory` used_memory delta / "
                  "records. Breakdown by `MEMORY USAGE` (the rest is the keyspace table).", "",
                  _table(["records", "holders/chunk", "B/record", "chunk zset B/chunk (encoding)",
                          "reverse sets B/record"],
                         [[f"{c['records']:,}", c["holders_per_chunk"], c["bytes_per_record"],
                           f"{c['chunk_zset_bytes_per_chunk']} ({c['chunk_zset_encoding']})",
                           c["reverse_sets_bytes_per_record"]] for c in mem["cases"]]), ""]
    sw = res.get("sweeps")
    if sw:
        lines += ["## Lookup latency sweeps", "",
                  f"Synthetic prompts held in full by every instance (the walk visits every chunk: worst case). "
                  f"In-process `Client.matches` (cached reads, as the controller by default: `lookup_cache: on`, so "
                  f"a repeated prompt's chunk sets are read from the process's coherent copies) and HTTP at "
                  f"concurrency 1 (gunicorn {sw['gunicorn']}), {sw['seconds_per_point']} s per point each.", ""]
        for key, xk in (("prompt_length", "tokens"), ("instances", "instances"), ("index_size", "records")):
            rows = sw.get(key) or []
            lines += [f"### by {xk}", "",
                      _table([xk, "in-process p50 ms", "in-process p99 ms", "Client lookups/s",
                              "HTTP p50 ms", "HTTP p99 ms"],
                             [[f"{r[xk]:,}", r["inprocess"]["p50_ms"], r["inprocess"]["p99_ms"],
                               r["inprocess"]["per_s"], r["http_c1"]["p50_ms"], r["http_c1"]["p99_ms"]]
                              for r in rows]), ""]
            lines += [f"![{key}](img/{n})" for n in images if n.endswith(key.replace("_", "-") + ".png")]
            lines.append("")
    lines += _stages_section(res.get("stages"))
    pg = res.get("purge")
    if pg:
        lines += ["## Purge of a retired holder", "",
                  "Fresh Redis; one holder's records written by `Store.apply`, then its worker registers again "
                  f"(a new epoch retires the holder) and `Store.purge` runs in calls of {pg['budget']:,} records "
                  "(an idle sidecar's turn) until the holder is forgotten. tests/faults/test_faults.py measures it "
                  "with two sidecars under traffic (docs/operations.md, \"Fault injection: measured\")."
                  + (f" Run alone on another machine: {pg['machine']['nproc']} cores ({pg['machine']['cpu']})."
                     if pg.get("machine") else ""), "",
                  _table(["records", "seconds", "records/s", "calls", "p50 / max call ms", "records left"],
                         [[f"{pg['records']:,}", pg["seconds"], f"{pg['records_per_s']:,}", pg["calls"],
                           f"{pg['p50_call_ms']} / {pg['max_call_ms']}", pg["records_left"]]]), ""]
    lines += _cluster_section(res.get("cluster"))
    lines += _wrk_section(res.get("wrk"))
    lines += _mp_section(res.get("mp"))
    notes = DOCS / "benchmarks-notes.md"
    if notes.exists():
        lines += [notes.read_text()]
    return "\n".join(lines) + "\n"


def _stages_section(st: dict | None) -> list[str]:
    if not st:
        return []
    names = [k for k in st["rows"][0] if isinstance(st["rows"][0][k], dict)]
    header = ["tokens (body)"] + [f"{n} p50 / p99 ms" for n in names]
    rows = [[f"{r['tokens']:,} ({r['body_bytes'] // 1024} KiB)"]
            + [f"{r[n]['p50_ms']} / {r[n]['p99_ms']}" for n in names] for r in st["rows"]]
    return ["## Where an HTTP lookup's time goes", "",
            f"gunicorn ({st['gunicorn']}) serving the /lookup handler cut short after each stage (bench/stages.py), "
            "then the real controller; prompts held in full by 8 instances; concurrency 1, "
            f"{st['seconds_per_point']} s per point. Each column adds one stage: read the body, decode and "
            "validate the JSON, hash the chunks, walk Redis, then everything else of /lookup (response, metrics).",
            "", _table(header, rows), ""]


def _cluster_section(cl: dict | None) -> list[str]:
    if not cl:
        return []
    look = [[f"{r['tokens']:,}", r["instances"], f"{r['single']['p50_ms']} / {r['single']['p99_ms']}",
             f"{r['cluster']['p50_ms']} / {r['cluster']['p99_ms']}", f"{r['p50_ratio']}x",
             f"{r['single-off']['p50_ms']} / {r['cluster-off']['p50_ms']} ({r['off_p50_ratio']}x)"]
            for r in cl.get("lookups", [])]
    http = [[f"{r['tokens']:,}", h["concurrency"], f"{h['single']['req_s']} ({h['single']['p99_ms']})",
             f"{h['cluster']['req_s']} ({h['cluster']['p99_ms']})", f"{h['throughput_ratio']}x"]
            for r in cl.get("lookups", []) for h in r.get("http", [])]
    ing = {}
    for r in cl["ingest"]:
        ing.setdefault(r["sidecars"], {})[r["backend"]] = f"{r['ops_per_s']:,}"
    ing_rows = [[k, v.get("single", "-"), v.get("cluster", "-")] for k, v in sorted(ing.items())]
    bal = cl["balance"]
    c = bal["cluster"]
    return ["## One server against a 3-master Redis Cluster", "",
            f"Same run, same records, the two backends measured turn about (bench/cluster.py); the cluster has "
            f"{cl['masters']} masters with {cl['replicas_per_master']} replica each, all on this machine's loopback. "
            "Lookups: in-process `Client.matches`, 8 instances holding growing prefixes of the prompt, each "
            "backend with its default read path (cached reads: kvlookup/index/tracking.py on one server, "
            "kvlookup/index/cluster_cache.py per master) and with `lookup_cache: off`, the four interleaved per "
            "request.", "",
            _table(["prompt tokens", "instances", "one server p50 / p99 ms", "cluster p50 / p99 ms", "p50 ratio",
                    "off: one server / cluster p50 ms"], look), "",
            "Over HTTP: one controller per backend (its defaults, gunicorn uvicorn:2), Python load generator, "
            "the backends in alternating rounds (each one's best of 2): req/s (p99 ms).", "",
            _table(["prompt tokens", "concurrency", "one server", "cluster", "cluster / one server"], http), "",
            "Ingest: aggregate chunk ops/s with k sidecar processes, each fed pre-encoded LMCache 0.5.6 traffic by "
            "its own pusher process (2 workers per sidecar). Every process shares the same 2 cores here, so this "
            "shows what the backend costs, not how far it scales on real hosts.", "",
            _table(["sidecars", "one server ops/s", "cluster ops/s"], ing_rows), "",
            f"Balance: the Mooncake trace ({bal['requests']:,} requests) on {bal['instances']} simulated instances, "
            f"{c['records']:,} records. Keys per master {c['keys_per_master']} (max/mean {c['keys_max_mean']}); "
            f"memory per master {[round(m / 2**20, 1) for m in c['memory_per_master']]} MiB "
            f"(max/mean {c['memory_max_mean']}). Bytes per record: one server {bal['single']['bytes_per_record']}, "
            f"cluster {c['bytes_per_record']} (used_memory without each master's replication backlog and replica "
            "output buffers, a fixed cost per master).", ""]


def _wrk_section(wk: dict | None) -> list[str]:
    if not wk:
        return []
    ref = wk.get("reference")
    rows = [[f"{r['tokens']:,}", r["concurrency"], f"{r['kvlookup']['req_s']:,}", f"{r['lmcache']['req_s']:,}",
             f"{r['throughput_ratio']}x", f"{r['kvlookup']['p50_ms']} / {r['kvlookup']['p99_ms']}",
             f"{r['lmcache']['p50_ms']} / {r['lmcache']['p99_ms']}",
             *([f"{r['reference']['req_s']:,} ({r['reference']['p99_ms']})"] if ref else [])] for r in wk["rows"]]
    ref_txt = (f" The last column is kvlookup under gunicorn {ref} on the same Redis, measured at the same "
               f"points: req/s (p99 ms).") if ref else ""
    return ["## Per-request cost at every prompt length (wrk)", "",
            f"wrk (Debian's C load generator, so the client is not the bottleneck) against kvlookup (gunicorn "
            f"{wk['gunicorn']}, the default) and LMCache 0.5.6's `lmcache_controller` in turn, {wk.get('rounds', 1)} "
            f"rounds of {wk['seconds']} s per point (each target's median round; 1 s of warm-up first); both "
            f"fed the same 0.5.6 worker traffic: {wk['instances']} instances, instance i holding the first "
            f"(i + 1)/{wk['instances']} of every prompt (bench/wrkload.py).{ref_txt}", "",
            _table(["prompt tokens", "concurrency", "kvlookup req/s", "LMCache req/s", "ratio",
                    "kvlookup p50 / p99 ms", "LMCache p50 / p99 ms", *([f"{ref} req/s (p99 ms)"] if ref else [])],
                   rows), ""]


def _mp_section(mp: dict | None) -> list[str]:
    if not mp:
        return []
    k, c = mp["ingest_kvlookup"], mp["ingest_coordinator"]
    wrk_note = "wrk, concurrency 1" if "seconds_per_point" in mp else "concurrency 1"
    rows = []
    for r in mp["lookups"]:
        row = [f"{r['tokens']:,}", f"{r['kvlookup']['p50_ms']} / {r['kvlookup']['p99_ms']}",
               f"{r['coordinator']['p50_ms']} / {r['coordinator']['p99_ms']}", f"{r['p50_ratio']}x / {r['p99_ratio']}x"]
        side = r.get("kvlookup_server_side")
        row.append(f"{side['p50_ms']} / {side['p99_ms']}" if side else "-")
        row.append(f"{r['lookup_kvlookup']['p50_ms']} / {r['lookup_kvlookup']['p99_ms']}")
        rows.append(row)
    ingest = [["POST /events placements/s (whole server)", f"{k['placements_per_s']:,}", f"{c['placements_per_s']:,}",
               f"{mp['ingest_ratio']}x"]]
    if "placements_per_cpu_s" in k:
        ingest.append(["placements per CPU second (server processes)",
                       f"{k['placements_per_cpu_s']:,} (HTTP workers {k['cpu_s'][:-1]} s + Redis {k['cpu_s'][-1]} s)",
                       f"{c['placements_per_cpu_s']:,} ({c['cpu_s'][0]} s, one process)", f"{mp['ingest_cpu_ratio']}x"])
    ingest.append(["memory per placement (B)", f"{mp['redis_bytes_per_placement']} (Redis used_memory)",
                   f"{mp['coordinator_rss_bytes_per_placement']} (process RSS)", ""])
    return ["## LMCache multiprocess (MP) coordinator paths", "",
            f"kvlookup's controller (gunicorn {mp['gunicorn']}, one Redis) and LMCache {mp['lmcache']}'s MP "
            "coordinator (`python -m lmcache.v1.mp_coordinator`, one process) in turn, fed the same pre-encoded "
            f"bytes (bench/mp.py): {mp['placements']:,} L1 placements in `store` batches of {mp['batch_entries']} "
            f"entries from {mp['clients']} emitters, each on its own keep-alive connection (http.client); then one "
            f"instance holding each prompt in L1 and L2, and `/directory/lookup` (tokens form) on both ({wrk_note}, "
            f"{mp.get('rounds', 1)} round(s) of {mp.get('seconds_per_point', '-')} s on each target after a 1 s "
            "warm-up, the two in turn and who goes first alternating, the medians shown; ingest too is sent in "
            "that many rounds in turn); the answers are checked identical first. kvlookup's server-side time is "
            "the route's own function (`kvlookup.app.coordinator.directory_lookup`: decode, hash, one Redis read, "
            "encode) timed in the benchmark process on the same Redis. `/lookup` (kvlookup only: the coordinator "
            "has no prefix answer) is asked the same prompt with `model_name`. Reproduce: `kvlookup bench mp` (needs "
            "`KVLOOKUP_LMCACHE_PYTHON`)."
            + (f" Load average (1/5/15 min) at the start {mp['loadavg_start']}, at the end {mp['loadavg_end']}: "
               "other jobs shared the 2 cores, so absolute times are inflated and noisy; compare the columns."
               if mp.get("loadavg_start") else ""), "",
            _table(["", "kvlookup", "MP coordinator", "ratio"], ingest), "",
            _table(["prompt tokens", "kvlookup /directory/lookup p50 / p99 ms", "coordinator p50 / p99 ms",
                    "p50 / p99 ratio", "kvlookup server-side p50 / p99 ms", "kvlookup /lookup p50 / p99 ms"], rows),
            ""]


def render(res: dict, results_path: Path) -> Path:
    """Write plots and the markdown; quick runs go to docs/benchmarks-quick.md."""
    tag = "-quick" if res.get("quick") else ""
    images = plots(res, tag)
    path = DOCS / f"benchmarks{tag}.md"
    path.write_text(markdown(res, images, results_path))
    return path
