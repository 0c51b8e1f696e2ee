// Status page of the deltarl coordinator: plain JS, no dependencies, no CDN.
// Data: GET v1/status (polled every 2 s and on every new version), GET v1/versions/events (SSE).
// A token for non-public deployments can be given as #token=... (sent as X-Deltarl-Token).
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";
const W = 600, H = 220, PAD = { l: 48, r: 10, t: 10, b: 28 };
const token = new URLSearchParams(location.hash.slice(1)).get("token");
const queueSamples = [];  // [time, depth]
let refreshing = false;

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
}

function el(name, attrs, text) {
  const e = document.createElementNS(SVGNS, name);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function setText(id, text) { document.getElementById(id).textContent = text; }

function frame(svg, yMax, yFmt, emptyText) {
  svg.replaceChildren();
  svg.appendChild(el("line", { x1: PAD.l, y1: H - PAD.b, x2: W - PAD.r, y2: H - PAD.b, stroke: "#9ca3af" }));
  svg.appendChild(el("line", { x1: PAD.l, y1: PAD.t, x2: PAD.l, y2: H - PAD.b, stroke: "#9ca3af" }));
  svg.appendChild(el("text", { x: PAD.l - 4, y: PAD.t + 8, "text-anchor": "end" }, yFmt(yMax)));
  svg.appendChild(el("text", { x: PAD.l - 4, y: H - PAD.b, "text-anchor": "end" }, yFmt(0)));
  if (emptyText) svg.appendChild(el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, emptyText));
}

// bars: [{label, value, cls, data}] ; line: optional [{value}] drawn over the bars
// opts.log: logarithmic y axis (bytes: a 1% delta stays visible next to a full anchor)
function barChart(svg, bars, opts) {
  const tf = opts.log ? (v) => Math.log10(Math.max(1, v)) : (v) => v;
  const fmt = opts.yFmt || String;
  const yMax = Math.max(1e-9, ...bars.map((b) => tf(b.value)), ...(opts.line || []).map((p) => tf(p.value)));
  frame(svg, yMax, opts.log ? (t) => fmt(Math.pow(10, t)) : fmt, bars.length ? "" : "no data yet");
  if (!bars.length) return;
  const plotW = W - PAD.l - PAD.r, plotH = H - PAD.t - PAD.b;
  const bw = plotW / bars.length;
  const y = (v) => H - PAD.b - (tf(v) / yMax) * plotH;
  bars.forEach((b, i) => {
    const r = el("rect", {
      x: PAD.l + i * bw + bw * 0.1, y: y(b.value), width: Math.max(1, bw * 0.8),
      height: Math.max(0, H - PAD.b - y(b.value)), fill: b.color || "#2563eb", class: "bar",
    });
    for (const [k, v] of Object.entries(b.data || {})) r.setAttribute("data-" + k, v);
    r.appendChild(el("title", {}, b.label + ": " + (opts.yFmt || String)(b.value)));
    svg.appendChild(r);
    if (bars.length <= 24 || i % Math.ceil(bars.length / 24) === 0) {
      svg.appendChild(el("text", { x: PAD.l + i * bw + bw / 2, y: H - PAD.b + 12, "text-anchor": "middle" }, b.label));
    }
  });
  if (opts.line && opts.line.length) {
    const pts = opts.line.map((p, i) => `${PAD.l + i * bw + bw / 2},${y(p.value)}`).join(" ");
    svg.appendChild(el("polyline", { points: pts, fill: "none", stroke: "#dc2626", "stroke-width": 2, class: "line" }));
  }
}

function lineChart(svg, points, opts) {
  // points: [{x, y, label}]
  const yMax = Math.max(1e-9, ...points.map((p) => p.y));
  const yMin = Math.min(0, ...points.map((p) => p.y));
  frame(svg, yMax, opts.yFmt || String, points.length ? "" : "no data yet");
  if (!points.length) return;
  const xs = points.map((p) => p.x);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1e-9);
  const plotW = W - PAD.l - PAD.r, plotH = H - PAD.t - PAD.b;
  const sx = (x) => PAD.l + ((x - x0) / (x1 - x0 || 1)) * plotW;
  const sy = (v) => H - PAD.b - ((v - yMin) / (yMax - yMin || 1)) * plotH;
  const d = points.map((p, i) => (i ? "L" : "M") + sx(p.x).toFixed(1) + "," + sy(p.y).toFixed(1)).join(" ");
  svg.appendChild(el("path", { d, fill: "none", stroke: opts.color || "#16a34a", "stroke-width": 2, class: "line" }));
  points.forEach((p) => {
    const c = el("circle", { cx: sx(p.x), cy: sy(p.y), r: 2.5, fill: opts.color || "#16a34a", class: "point" });
    c.setAttribute("data-x", p.x);
    c.setAttribute("data-y", p.y);
    c.appendChild(el("title", {}, p.label));
    svg.appendChild(c);
  });
  svg.appendChild(el("text", { x: PAD.l, y: H - 4 }, opts.xLabel(x0)));
  svg.appendChild(el("text", { x: W - PAD.r, y: H - 4, "text-anchor": "end" }, opts.xLabel(x1)));
}

function render(s) {
  setText("latest-version", s.latest_version ?? "none");
  setText("trainer-step", s.trainer_step ?? "–");
  setText("latest-anchor", s.latest_anchor ?? "none");
  setText("max-staleness", s.max_staleness);
  setText("queue-depth", `${s.queue.depth} / ${s.queue.leased}`);
  setText("workers", `${s.workers_active} / ${s.workers_lost}`);
  const dropped = Object.values(s.queue.dropped).reduce((a, b) => a + b, 0);
  setText("dropped", String(dropped));
  const last = s.versions[s.versions.length - 1];
  setText("delta-ratio", last ? `${fmtBytes(last.bytes)} / ${fmtBytes(last.full_bytes)}` : "–");
  const pool = s.challenges;
  setText("challenges", pool && pool.posted
    ? `${pool.pool_size} / ${s.workers_waiting_for_challenge ?? 0}` : "–");
  setText("refused", `${s.queue.dead_letters ?? 0} / ${s.workers_suspect ?? 0}`);

  barChart(document.getElementById("chart-versions"),
    s.versions.map((v) => ({ label: String(v.version), value: v.bytes, color: v.kind === "anchor" ? "#f59e0b" : "#2563eb", data: { version: v.version, kind: v.kind, bytes: v.bytes } })),
    { yFmt: fmtBytes, log: true, line: s.versions.map((v) => ({ value: v.full_bytes })) });
  lineChart(document.getElementById("chart-reward"),
    s.rewards.filter((r) => Number.isFinite(r.mean_reward))
      .map((r) => ({ x: r.version, y: r.mean_reward, label: `v${r.version}: ${r.mean_reward.toFixed(3)} (${r.groups} groups)` })),
    { yFmt: (v) => v.toFixed(2), xLabel: (x) => "v" + x, color: "#16a34a" });
  const lagged = s.workers.slice(0, 60);
  barChart(document.getElementById("chart-lag"),
    lagged.map((w) => ({ label: w.worker_id, value: w.lag_versions ?? 0, color: w.state === "lost" ? "#dc2626" : "#2563eb", data: { worker: w.worker_id, lag: w.lag_versions ?? "" } })),
    { yFmt: (v) => v.toFixed(0) });
  const hist = Object.entries(s.staleness_hist).map(([k, n]) => [Number(k), n]).sort((a, b) => a[0] - b[0]);
  barChart(document.getElementById("chart-staleness"),
    hist.map(([k, n]) => ({ label: String(k), value: n, data: { staleness: k, count: n } })),
    { yFmt: (v) => v.toFixed(0) });
  queueSamples.push([s.now, s.queue.depth]);
  if (queueSamples.length > 600) queueSamples.shift();
  lineChart(document.getElementById("chart-queue"),
    queueSamples.map(([t, d]) => ({ x: t, y: d, label: `${new Date(t * 1000).toLocaleTimeString()}: ${d}` })),
    { yFmt: (v) => v.toFixed(0), xLabel: (x) => new Date(x * 1000).toLocaleTimeString(), color: "#7c3aed" });

  const body = document.querySelector("#workers-table tbody");
  body.replaceChildren(...s.workers.slice(0, 200).map((w) => {
    const tr = document.createElement("tr");
    tr.className = w.suspect ? "lost" : w.state;
    // proven by a weight challenge; "unproven" while none was answered at this version
    const weights = w.weights_verified == null
      ? (w.weights_proven_version == null ? "unproven" : `proven v${w.weights_proven_version}`)
      : (w.weights_verified ? "proven" : "PROOF FAILED");
    const refused = w.rejected_groups ? `${w.rejected_groups} (${w.last_rejection ?? ""})` : "";
    for (const v of [w.worker_id, w.suspect ? "SUSPECT" : w.state, w.engine, w.applied_version ?? "–", weights,
      w.lag_versions ?? "–", w.lag_seconds == null ? "–" : w.lag_seconds.toFixed(1), w.in_flight, refused,
      w.last_error ?? ""]) {
      const td = document.createElement("td");
      td.textContent = String(v);
      tr.appendChild(td);
    }
    return tr;
  }));
}

async function refresh() {
  if (refreshing) return;
  refreshing = true;
  try {
    const r = await fetch("v1/status?workers=200", { headers: token ? { "X-Deltarl-Token": token } : {} });
    if (!r.ok) throw new Error("status " + r.status);
    render(await r.json());
    document.body.dataset.rendered = String(Number(document.body.dataset.rendered || 0) + 1);
  } catch (e) {
    const c = document.getElementById("conn");
    c.textContent = "error: " + e.message;
    c.className = "badge down";
  } finally {
    refreshing = false;
  }
}

function connect() {
  const conn = document.getElementById("conn");
  if (token || !window.EventSource) { conn.textContent = "polling"; return; }
  const es = new EventSource("v1/versions/events");
  es.addEventListener("open", () => { conn.textContent = "live"; conn.className = "badge live"; });
  es.addEventListener("version", (e) => { document.body.dataset.lastEvent = e.lastEventId; refresh(); });
  es.addEventListener("error", () => { conn.textContent = "reconnecting…"; conn.className = "badge down"; });
}

refresh();
connect();
setInterval(refresh, 2000);
