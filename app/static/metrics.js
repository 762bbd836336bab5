/* kvlookup dashboard, part 1: Prometheus text -> rates -> inline SVG charts.
 *
 * window.KvMetrics = {parse, snapshot, rates, Charts}. Nothing here fetches: dashboard.js
 * scrapes GET /metrics and hands the text over. Counters are turned into per-second rates
 * between two scrapes (a counter that went down was reset: its new value is the delta).
 */
"use strict";

window.KvMetrics = (() => {
  const SAMPLE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
  const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

  /** Prometheus text -> Map(sample name -> [{labels: {k: v}, value: number}]). */
  function parse(text) {
    const out = new Map();
    for (const line of text.split("\n")) {
      if (!line || line[0] === "#") continue;
      const m = SAMPLE.exec(line);
      if (!m) continue;
      const labels = {};
      for (const l of (m[2] || "").matchAll(LABEL)) {
        labels[l[1]] = l[2].replace(/\\n/g, "\n").replace(/\\(.)/g, "$1");
      }
      const value = m[3] === "+Inf" ? Infinity : m[3] === "-Inf" ? -Infinity : Number(m[3]);
      if (!out.has(m[1])) out.set(m[1], []);
      out.get(m[1]).push({ labels, value });
    }
    return out;
  }

  /** Sum of a sample's values whose labels match every key of `where`. */
  function total(samples, name, where = {}) {
    let sum = 0;
    for (const s of samples.get(name) || []) {
      if (Object.entries(where).every(([k, v]) => s.labels[k] === v)) sum += s.value;
    }
    return sum;
  }

  /** Values keyed by one label (e.g. rejects by reason). */
  function byLabel(samples, name, label) {
    const out = {};
    for (const s of samples.get(name) || []) {
      const key = s.labels[label] || "?";
      out[key] = (out[key] || 0) + s.value;
    }
    return out;
  }

  /** Histogram buckets [{le, count}] ascending, summed over any other labels. */
  function buckets(samples, name) {
    const by = new Map();
    for (const s of samples.get(name + "_bucket") || []) {
      const le = s.labels.le === "+Inf" ? Infinity : Number(s.labels.le);
      by.set(le, (by.get(le) || 0) + s.value);
    }
    return [...by.entries()].sort((a, b) => a[0] - b[0]).map(([le, count]) => ({ le, count }));
  }

  /** The counters the charts need, from one scrape taken at time t (ms). */
  function snapshot(text, t) {
    const s = parse(text);
    const rejects = byLabel(s, "kvlookup_rejected_frames_total", "reason");
    return {
      t,
      hit: total(s, "kvlookup_lookups_total", { outcome: "hit" }),
      miss: total(s, "kvlookup_lookups_total", { outcome: "miss" }),
      failed: total(s, "kvlookup_lookups_total", { outcome: "redis_error" }),
      latSum: total(s, "kvlookup_lookup_seconds_sum"),
      latCount: total(s, "kvlookup_lookup_seconds_count"),
      latBuckets: buckets(s, "kvlookup_lookup_seconds"),
      matchedSum: total(s, "kvlookup_lookup_matched_tokens_sum"),
      matchedCount: total(s, "kvlookup_lookup_matched_tokens_count"),
      admit: total(s, "kvlookup_ingest_ops_total", { kind: "admit", outcome: "applied" }),
      evict: total(s, "kvlookup_ingest_ops_total", { kind: "evict", outcome: "applied" }),
      ops: total(s, "kvlookup_ingest_ops_total"),
      rejects,
    };
  }

  const delta = (a, b) => (b >= a ? b - a : b);

  /** The q-quantile (seconds) of the observations between two bucket lists, interpolated
   * linearly inside its bucket as Prometheus' histogram_quantile does; null without any. */
  function quantile(q, before, after) {
    const prev = new Map(before.map((b) => [b.le, b.count]));
    const d = after.map((b) => ({ le: b.le, count: delta(prev.get(b.le) || 0, b.count) }));
    const n = d.length ? d[d.length - 1].count : 0;
    if (!n) return null;
    const rank = q * n;
    let lower = 0;
    let below = 0;
    for (const b of d) {
      if (b.count >= rank) {
        if (b.le === Infinity) return lower;
        const inside = b.count - below;
        return inside ? lower + (b.le - lower) * ((rank - below) / inside) : b.le;
      }
      lower = b.le;
      below = b.count;
    }
    return lower;
  }

  /** One chart point between two snapshots: per-second rates and interval means (null when
   * there was nothing to average). */
  function rates(a, b) {
    const dt = (b.t - a.t) / 1000;
    if (!(dt > 0)) return null;
    const hits = delta(a.hit, b.hit);
    const answered = hits + delta(a.miss, b.miss);
    const latN = delta(a.latCount, b.latCount);
    const matchedN = delta(a.matchedCount, b.matchedCount);
    const applied = delta(a.admit, b.admit) + delta(a.evict, b.evict);
    const point = {
      t: b.t,
      lookups: (answered + delta(a.failed, b.failed)) / dt,
      hitPct: answered ? (100 * hits) / answered : null,
      matched: matchedN ? delta(a.matchedSum, b.matchedSum) / matchedN : null,
      latMean: latN ? (1000 * delta(a.latSum, b.latSum)) / latN : null,
      latP99: latN ? 1000 * quantile(0.99, a.latBuckets, b.latBuckets) : null,
      admit: delta(a.admit, b.admit) / dt,
      evict: delta(a.evict, b.evict) / dt,
      dropped: Math.max(0, delta(a.ops, b.ops) - applied) / dt,
      rejects: {},
    };
    for (const [reason, v] of Object.entries(b.rejects)) {
      point.rejects[reason] = delta(a.rejects[reason] || 0, v) / dt;
    }
    return point;
  }

  // -- charts ---------------------------------------------------------------------------------

  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];
  const W = 360;
  const H = 130;
  const PAD = { l: 40, r: 6, t: 8, b: 16 };
  const SVG = "http://www.w3.org/2000/svg";

  /** The charts drawn: a title, and series as [label, point -> value or null]. */
  const DEFS = [
    { id: "lookups", title: "Lookups / s", series: [["lookups", (p) => p.lookups]] },
    { id: "hit-ratio", title: "Hit ratio (%)", max: 100, series: [["hits", (p) => p.hitPct]] },
    { id: "matched", title: "Matched tokens per lookup (mean)", series: [["tokens", (p) => p.matched]] },
    { id: "latency", title: "Lookup latency (ms)",
      series: [["mean", (p) => p.latMean], ["p99", (p) => p.latP99]] },
    { id: "ingest", title: "Ingest ops / s",
      series: [["admit", (p) => p.admit], ["evict", (p) => p.evict], ["dropped", (p) => p.dropped]] },
    { id: "rejects", title: "Rejected frames / s, by reason", series: null },
  ];

  function svgEl(tag, attrs) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    return e;
  }

  function fmt(v) {
    if (v == null || Number.isNaN(v)) return "–";
    if (v === 0) return "0";
    if (Math.abs(v) >= 100) return Math.round(v).toLocaleString("en-US");
    if (Math.abs(v) >= 1) return v.toFixed(1);
    return v.toPrecision(2);
  }

  /** Polyline point lists of one series, split where the value is null. */
  function segments(points, value, x, y) {
    const out = [];
    let cur = [];
    points.forEach((p, i) => {
      const v = value(p);
      if (v == null || !Number.isFinite(v)) {
        if (cur.length) out.push(cur);
        cur = [];
      } else {
        cur.push(`${x(i).toFixed(1)},${y(v).toFixed(1)}`);
      }
    });
    if (cur.length) out.push(cur);
    return out;
  }

  class Chart {
    constructor(def, parent, capacity) {
      this.def = def;
      this.capacity = capacity;
      this.box = document.createElement("div");
      this.box.className = "chart";
      this.box.id = `chart-${def.id}`;
      const title = document.createElement("div");
      title.className = "title";
      title.textContent = def.title;
      this.svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img" });
      this.svg.setAttribute("aria-label", def.title);
      this.legend = document.createElement("div");
      this.legend.className = "legend";
      this.box.append(title, this.svg, this.legend);
      parent.append(this.box);
    }

    series(points) {
      if (this.def.series) return this.def.series;
      const reasons = new Set();
      for (const p of points) for (const [r, v] of Object.entries(p.rejects)) if (v > 0) reasons.add(r);
      return [...reasons].sort().map((r) => [r, (p) => p.rejects[r] || 0]);
    }

    draw(points, spanS) {
      const series = this.series(points);
      let max = this.def.max || 0;
      for (const [, value] of series) for (const p of points) max = Math.max(max, value(p) || 0);
      max = max > 0 ? max * (this.def.max ? 1 : 1.15) : 1;
      const x = (i) => PAD.l + ((W - PAD.l - PAD.r) * i) / Math.max(1, this.capacity - 1);
      const shift = this.capacity - points.length;
      const y = (v) => H - PAD.b - ((H - PAD.t - PAD.b) * Math.min(v, max)) / max;
      this.svg.replaceChildren(
        svgEl("line", { class: "axis", x1: PAD.l, x2: W - PAD.r, y1: H - PAD.b, y2: H - PAD.b }),
        svgEl("line", { class: "axis", x1: PAD.l, x2: PAD.l, y1: PAD.t, y2: H - PAD.b }),
        this.text(PAD.l - 4, PAD.t + 8, fmt(max), "end"),
        this.text(PAD.l - 4, H - PAD.b, "0", "end"),
        this.text(PAD.l, H - 3, `−${Math.round(spanS)} s`, "start"),
        this.text(W - PAD.r, H - 3, "now", "end"),
      );
      this.legend.replaceChildren();
      series.forEach(([label, value], k) => {
        const color = COLORS[k % COLORS.length];
        for (const seg of segments(points, value, (i) => x(i + shift), y)) {
          const line = svgEl("polyline", { points: seg.join(" "), stroke: color });
          if (seg.length === 1) line.setAttribute("points", `${seg[0]} ${seg[0]}`);
          this.svg.append(line);
        }
        this.legend.append(this.key(label, color, points.length ? value(points[points.length - 1]) : null));
      });
      if (!series.length) this.legend.textContent = "none";
    }

    text(xp, yp, s, anchor) {
      const t = svgEl("text", { x: xp, y: yp, "text-anchor": anchor });
      t.textContent = s;
      return t;
    }

    key(label, color, last) {
      const span = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.style.background = color;
      span.append(swatch, `${label} ${fmt(last)}`);
      span.dataset.series = label;
      return span;
    }
  }

  /** Every chart, over the last `capacity` points. */
  class Charts {
    constructor(parent, capacity = 90) {
      this.capacity = capacity;
      this.points = [];
      this.charts = DEFS.map((d) => new Chart(d, parent, capacity));
    }

    push(point) {
      if (!point) return;
      this.points.push(point);
      if (this.points.length > this.capacity) this.points.shift();
    }

    draw() {
      const pts = this.points;
      const step = pts.length > 1 ? (pts[pts.length - 1].t - pts[0].t) / (pts.length - 1) / 1000 : 0;
      const spanS = step * (this.capacity - 1); // the left edge, if every interval were the mean one
      for (const c of this.charts) c.draw(pts, spanS);
    }
  }

  return { parse, snapshot, rates, quantile, Charts };
})();
