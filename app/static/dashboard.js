/* kvlookup dashboard, part 2: the page. Polls GET /controller/overview, GET /health and
 * GET /metrics every few seconds; the lookup box calls POST /lookup (and POST /tokenize and
 * POST /lookup/explain where they answer). Every call is read-only: no API token is needed.
 * Paths are relative, so the page also works behind a reverse proxy under a prefix.
 */
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const state = { interval: 3000, paused: false, timer: null, prev: null, overview: null, explain: true, seen: false };
  const TOKEN_MAX = 2 ** 32;

  // -- small helpers ----------------------------------------------------------------------

  /** An element with text and attributes; children may be nodes or strings. */
  function el(tag, props = {}, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(props)) {
      if (v == null) continue;
      if (k === "class") e.className = v;
      else if (k === "data") Object.assign(e.dataset, v);
      else e.setAttribute(k, v);
    }
    e.append(...children.filter((c) => c != null).map((c) => (c instanceof Node ? c : String(c))));
    return e;
  }

  const int = (n) => (n == null ? "–" : Number(n).toLocaleString("en-US"));

  function bytes(b) {
    if (b == null) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    for (; b >= 1024 && i < units.length - 1; i++) b /= 1024;
    return `${b.toFixed(i ? 1 : 0)} ${units[i]}`;
  }

  /** "4 s ago" for a unix time, against the server's clock (`now`). */
  function ago(ts, now) {
    if (!ts) return "never";
    const s = Math.max(0, now - ts);
    if (s < 90) return `${Math.round(s)} s ago`;
    if (s < 5400) return `${Math.round(s / 60)} min ago`;
    if (s < 172800) return `${Math.round(s / 3600)} h ago`;
    return `${Math.round(s / 86400)} d ago`;
  }

  const pill = (text, kind) => el("span", { class: `pill ${kind || ""}` }, text);

  async function call(path, body) {
    const init = body === undefined ? { cache: "no-store" }
      : { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
    const resp = await fetch(path, init);
    const type = resp.headers.get("Content-Type") || "";
    const data = type.includes("json") ? await resp.json() : await resp.text();
    return { status: resp.status, ok: resp.ok, data };
  }

  // -- overview ---------------------------------------------------------------------------

  function renderSummary(ov) {
    const t = ov.totals;
    const live = ov.sidecars.filter((s) => s.live).length;
    $("card-instances").textContent = `${int(t.live_instances)} / ${int(t.instances)}`;
    $("card-workers").textContent = `${int(t.live_workers)} / ${int(t.workers)}`;
    $("card-records").textContent = int(t.records);
    $("card-records").dataset.value = t.records;
    $("card-keys").textContent = int(ov.index.keys);
    const max = ov.index.maxmemory_bytes ? ` of ${bytes(ov.index.maxmemory_bytes)}` : "";
    $("card-memory").textContent = bytes(ov.index.used_memory_bytes) + max;
    $("card-memory").title = `${ov.index.masters} master(s)`;
    $("card-sidecars").textContent = `${live} / ${ov.sidecars.length}`;
  }

  const tiers = (locations) => Object.entries(locations).map(
    ([loc, n]) => el("span", { class: "tier", data: { location: loc, value: n } }, `${loc} ${int(n)}`));

  function instanceRow(inst) {
    const kind = inst.kind === "vllm" ? "vLLM" : "LMCache";
    const lease = inst.lease_s == null ? "–" : inst.lease_s >= 0 ? `${inst.lease_s.toFixed(0)} s left` : "expired";
    return el("tr", { class: "instance", data: { instance: inst.instance_id } },
      el("td", { class: "id" }, inst.instance_id),
      el("td", {}, pill(kind, "kind")),
      el("td", {}, inst.live ? pill("live", "ok") : pill("down", "bad"),
        ...(inst.possibly_stale ? [" ", el("span", { class: "pill warn stale", title: inst.possibly_stale.reason },
          "possibly stale")] : [])),
      el("td", {}, lease),
      el("td", {}, `${inst.workers.length} ${inst.kind === "vllm" ? "DP rank" : "TP rank"}${inst.workers.length === 1 ? "" : "s"}`),
      el("td", { class: "num records", data: { value: inst.key_count } }, int(inst.key_count)),
      el("td", {}, ...tiers(inst.locations)),
      el("td", { class: "small" }, inst.owner || "–"));
  }

  function workerRow(inst, w, now) {
    const where = w.ip ? `${w.ip}:${w.port}` : "–";
    const contact = `last contact ${ago(w.last_contact, now)}` + (w.heartbeats ? ` · ${int(w.heartbeats)} heartbeat${w.heartbeats === 1 ? "" : "s"}` : "");
    return el("tr", { class: "worker", data: { instance: inst.instance_id, worker: w.worker_id } },
      el("td", {}, `rank ${w.worker_id}`),
      el("td", { class: "small" }, where),
      el("td", {}, w.live ? pill("live", "ok") : pill("down", "bad")),
      el("td", { class: "small" }, `epoch ${w.epoch}`),
      el("td", { class: "small", title: "registration, heartbeat or answered health call" }, contact),
      el("td", { class: "num", data: { value: w.key_count } }, int(w.key_count)),
      el("td", {}, ...tiers(w.locations)),
      el("td", {}));
  }

  function renderInstances(ov) {
    const rows = [];
    for (const inst of ov.instances) {
      rows.push(instanceRow(inst));
      for (const w of inst.workers) rows.push(workerRow(inst, w, ov.generated_at));
    }
    $("instances").tBodies[0].replaceChildren(...rows);
    if (ov.instances.length > 0) state.seen = true;
    $("no-instances").hidden = ov.instances.length > 0 || state.seen;
    $("instances-gone").hidden = ov.instances.length > 0 || !state.seen;
  }

  function renderSidecars(ov) {
    const rows = ov.sidecars.map((s) => el("tr", { data: { sidecar: s.sidecar_id } },
      el("td", { class: "id" }, s.sidecar_id),
      el("td", {}, s.live ? pill("live", "ok") : pill("lease expired", "bad")),
      el("td", {}, s.lease_s >= 0 ? `${s.lease_s.toFixed(1)} s left` : `${(-s.lease_s).toFixed(0)} s ago`),
      el("td", { class: "num" }, int(s.owned_instances)),
      el("td", {}, s.host ?? "–"),
      el("td", { class: "num" }, s.pid ?? "–"),
      el("td", { class: "num" }, int(s.queued_ops)),
      el("td", { class: "num" }, s.lag_ms == null ? "–" : `${s.lag_ms} ms`)));
    $("sidecars").tBodies[0].replaceChildren(...rows);
    $("no-sidecars").hidden = ov.sidecars.length > 0;
  }

  function mpRow(m) {
    const state = m.departed ? pill(m.departed.reason.replace("_", " "), "bad")
      : m.live ? pill("live", "ok") : pill(m.registered ? "silent" : "not registered", "bad");
    const index = m.gap ? pill(`incomplete: ${m.missing_batches} batches missing, ${m.events_dropped} events dropped`, "bad")
      : pill("complete", "ok");
    const tiers = m.modules.map((t) => `${t.tier}/${t.backend}${t.shared ? " (shared)" : ""} ${bytes(t.capacity_bytes)}`);
    return el("tr", { data: { mp: m.instance_id } },
      el("td", { class: "id" }, m.instance_id),
      el("td", {}, state),
      el("td", {}, m.last_heartbeat_age_s == null ? "–" : `${m.last_heartbeat_age_s.toFixed(1)} s ago`),
      el("td", { class: "num" }, m.incarnation ?? "–"),
      el("td", { class: "num" }, m.last_seq ?? "–"),
      el("td", {}, index),
      el("td", {}, tiers.join(", ") || "–"),
      el("td", { class: "num" }, int(m.l1_keys)));
  }

  function renderMp(ov) {
    const rows = (ov.mp_instances || []).map(mpRow);
    $("mp-instances").tBodies[0].replaceChildren(...rows);
    $("no-mp-instances").hidden = rows.length > 0;
  }

  function renderFeatures(ov) {
    const text = Boolean(ov.features && ov.features.tokenize);
    $("mode-text").hidden = !text;
    $("bos-label").hidden = !text || mode() !== "text";
  }

  function renderHealth(health) {
    const s = $("status");
    if (!health) {
      s.replaceWith(Object.assign(pill("controller unreachable", "bad"), { id: "status" }));
      return;
    }
    const down = Object.entries(health.data.components || {}).filter(([, c]) => c.state !== "up");
    const text = down.length ? `degraded: ${down.map(([n, c]) => `${n} ${c.state}`).join(", ")}` : "healthy";
    const next = pill(text, down.length ? (health.data.redis === "ok" ? "warn" : "bad") : "ok");
    next.id = "status";
    s.replaceWith(next);
  }

  // -- refresh loop -----------------------------------------------------------------------

  async function refresh() {
    const t = Date.now();
    const [ov, metrics, health] = await Promise.allSettled([
      call("controller/overview"), call("metrics"), call("health")]);
    renderHealth(health.status === "fulfilled" ? health.value : null);
    if (ov.status === "fulfilled" && ov.value.ok) {
      state.overview = ov.value.data;
      renderSummary(state.overview);
      renderInstances(state.overview);
      renderSidecars(state.overview);
      renderMp(state.overview);
      renderFeatures(state.overview);
      showError(null);
    } else {
      const why = ov.status === "fulfilled" ? (ov.value.data.error || `HTTP ${ov.value.status}`) : ov.reason.message;
      showError(`overview: ${why}`);
    }
    if (metrics.status === "fulfilled" && metrics.value.ok) {
      const snap = KvMetrics.snapshot(metrics.value.data, t);
      if (state.prev) charts.push(KvMetrics.rates(state.prev, snap));
      state.prev = snap;
      charts.draw();
    }
    $("updated").textContent = new Date().toLocaleTimeString();
    document.body.dataset.refreshed = String(Number(document.body.dataset.refreshed || 0) + 1);
  }

  function showError(text) {
    $("error").hidden = !text;
    $("error").textContent = text || "";
  }

  function schedule() {
    clearTimeout(state.timer);
    if (!state.paused) state.timer = setTimeout(tick, state.interval);
  }

  async function tick() {
    try {
      await refresh();
    } catch (err) {
      showError(String(err));
    } finally {
      schedule();
    }
  }

  // -- lookup box -------------------------------------------------------------------------

  const mode = () => document.querySelector("input[name=mode]:checked").value;

  /** Token ids from "1, 2 3" or "[1, 2, 3]"; throws naming the first bad one. */
  function parseTokens(text) {
    const parts = text.replace(/^\s*\[|\]\s*$/g, "").split(/[\s,]+/).filter(Boolean);
    if (!parts.length) throw new Error("type some token ids first");
    return parts.map((p, i) => {
      const n = /^\d+$/.test(p) ? Number(p) : NaN;
      if (!(n < TOKEN_MAX)) throw new Error(`token ${i + 1} (${JSON.stringify(p.slice(0, 20))}) is not an integer 0..2^32-1`);
      return n;
    });
  }

  async function promptTokens() {
    const text = $("lookup-input").value;
    if (mode() === "tokens") return parseTokens(text);
    if (!text.trim()) throw new Error("type some text first");
    const r = await call("tokenize", { text: ($("bos").checked ? "<|begin_of_text|>" : "") + text });
    if (!r.ok) throw new Error(`tokenize: ${r.data.error || `HTTP ${r.status}`}`);
    return r.data.tokens;
  }

  function resultRow(inst, d, n) {
    const share = n ? Math.min(100, (100 * d.matched_prefix_length) / n) : 0;
    const bar = el("div", { class: "bar" }, el("div"));
    bar.firstChild.style.width = `${share.toFixed(1)}%`;
    return el("tr", { data: { instance: inst, matched: d.matched_prefix_length } },
      el("td", { class: "id" }, inst),
      el("td", {}, d.location),
      el("td", { class: "num matched" }, int(d.matched_prefix_length)),
      el("td", {}, bar, el("span", { class: "small muted" }, ` ${share.toFixed(0)}% of ${int(n)}`)),
      el("td", {}, ...tiers(d.locations || {})));
  }

  function renderLookup(tokens, body) {
    const detail = body.detail || {};
    const rows = Object.keys(body.layout_info || {}).map((inst) => resultRow(inst, detail[inst], tokens.length));
    $("lookup-result").tBodies[0].replaceChildren(...rows);
    $("lookup-result").hidden = rows.length === 0;
    const chunk = state.overview ? state.overview.settings.chunk_size : null;
    $("lookup-status").textContent = rows.length
      ? `${int(tokens.length)} tokens: ${rows.length} instance(s) hold a prefix`
      : `${int(tokens.length)} tokens: no instance holds a prefix` + (chunk ? ` (matching is in whole chunks of ${chunk} tokens)` : "");
    $("lookup-status").dataset.tokens = tokens.length;
  }

  async function explain(tokens) {
    if (!state.explain) return;
    const r = await call("lookup/explain", { tokens }).catch(() => null);
    const ok = Boolean(r && r.status === 200);
    if (r && (r.status === 404 || r.status === 405)) state.explain = false; // not served here: stop asking
    $("explain-panel").hidden = !ok;
    if (!ok) return;
    const d = r.data;
    const lines = d && Array.isArray(d.diagnosis) ? d.diagnosis.map((s) => `- ${s}`).join("\n") + "\n\n" : "";
    $("explain").textContent = typeof d === "string" ? d : lines + JSON.stringify(d, null, 2); // diagnosis first
  }

  async function lookup(ev) {
    ev.preventDefault();
    $("lookup-button").disabled = true;
    $("lookup-status").textContent = "looking up…";
    try {
      const tokens = await promptTokens();
      const r = await call("lookup?format=layout_info&detail=1", { tokens });
      if (!r.ok) throw new Error(r.data.error || `HTTP ${r.status}`);
      renderLookup(tokens, r.data);
      await explain(tokens);
    } catch (err) {
      $("lookup-result").hidden = true;
      $("explain-panel").hidden = true;
      $("lookup-status").textContent = err.message;
    } finally {
      $("lookup-button").disabled = false;
    }
  }

  // -- wiring -----------------------------------------------------------------------------

  const charts = new KvMetrics.Charts($("charts"));
  charts.draw();
  $("lookup-form").addEventListener("submit", lookup);
  for (const r of document.querySelectorAll("input[name=mode]")) {
    r.addEventListener("change", () => state.overview && renderFeatures(state.overview));
  }
  $("interval").addEventListener("change", (e) => {
    state.interval = Number(e.target.value);
    schedule();
  });
  $("pause").addEventListener("click", (e) => {
    state.paused = !state.paused;
    e.target.textContent = state.paused ? "Resume" : "Pause";
    if (state.paused) clearTimeout(state.timer);
    else tick();
  });
  tick();
})();
