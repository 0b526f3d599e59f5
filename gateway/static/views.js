"use strict";
// The live views: the cluster's workers and throughput chart, the key's batch jobs, and the waterfall of the
// traces of the last requests sent from here. Uses app.js's helpers and state.

const MAX_JOURNEYS = 10;
// A trace can gain its last hops just after the stream ends (each service notes a cancel when it gets to it);
// unless it reached the last hop, keep asking this long after the end.
const TRACE_PATIENCE_MS = 10000;
const LAST_HOP = "delivered";
const HISTORY_SECONDS = 300;

// Names of the stretches between consecutive hops; any other pair is named by its two hops.
const PHASES = {
  "received>queued": "admit", "queued>dispatched": "queue", "dispatched>admitted": "to worker",
  "admitted>prefill_done": "prefill", "prefill_done>first_token": "first token", "first_token>finished": "decode",
  "finished>delivered": "deliver",
};
const COLOURS = {
  admit: "#98a2b3", queue: "#f79009", "to worker": "#7a5af8", prefill: "#2e90fa", "first token": "#0ba5ec",
  decode: "#12b76a", deliver: "#667085", cancelled: "#f04438",
};

// ---------- cluster ----------

// A table cell with a bar filled `part` of `whole`, and its figures beside it.
function meterCell(kind, part, whole, title, figures) {
  const meter = el("span", "meter");
  meter.title = title;
  const fill = el("span");
  fill.style.width = `${whole ? (100 * part) / whole : 0}%`;
  meter.append(fill);
  const cell = el("td", kind);
  cell.append(meter, el("span", "slot-count", figures));
  return cell;
}

function emptyRow(text, columns) {
  const cell = el("td", "empty", text);
  cell.colSpan = columns;
  const row = el("tr");
  row.append(cell);
  return row;
}

function workerRow(worker) {
  const row = el("tr", "worker");
  const free = Math.max(worker.slots - worker.running, 0);
  const id = el("td", "id", worker.id);
  id.title = worker.id;
  const slots = meterCell("slots", worker.running, worker.slots, `${worker.running} of ${worker.slots} slots running`,
                          `${worker.running} / ${free}`);
  const status = el("td");
  status.append(el("span", worker.draining ? "badge draining" : "badge", worker.draining ? "draining" : "serving"));
  row.append(id, el("td", "", worker.model), slots, el("td", "", String(worker.waiting)), status);
  return row;
}

async function refreshCluster() {
  try {
    const response = await fetch("/v1/cluster", { headers: headers() });
    if (!response.ok) throw new Error(await errorMessage(response));
    const cluster = await response.json();
    $("queue").textContent = cluster.queue;
    $("cluster-tps").textContent = cluster.tokens_per_s.toFixed(1);
    $("worker-count").textContent = cluster.workers.length;
    const rows = cluster.workers.map(workerRow);
    $("workers").replaceChildren(...(rows.length ? rows
      : [emptyRow("No live workers: requests wait in the queue until one joins.", 5)]));
    state.chartHistory = cluster.history;
    drawChart();
    $("cluster-status").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    $("cluster-status").textContent = `unavailable: ${error.message}`;
  }
}

// ---------- batch jobs ----------

function batchRow(job) {
  const row = el("tr", "batch-job");
  row.dataset.batchId = job.id;
  const counts = job.request_counts;
  const done = counts.completed + counts.failed;
  const progress = meterCell("progress", done, counts.total, `${done} of ${counts.total} lines answered`,
                             `${done} / ${counts.total}`);
  const id = el("td", "id", job.id);
  id.title = job.id;
  const status = el("td", "status");
  status.append(el("span", `badge ${job.status}`, job.status));
  row.append(id, status, progress, el("td", "failed", String(counts.failed)),
             el("td", "", new Date(job.created_at * 1000).toLocaleString()));
  return row;
}

async function refreshBatches() {
  try {
    const response = await fetch("/v1/batches?limit=10", { headers: headers() });
    if (!response.ok) throw new Error(await errorMessage(response));
    const { data } = await response.json();
    const rows = data.map(batchRow);
    $("batch-jobs").replaceChildren(...(rows.length ? rows : [emptyRow("No batch jobs for this key.", 5)]));
    $("batches-status").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    $("batches-status").textContent = `unavailable: ${error.message}`;
  }
}

function niceCeiling(value) {
  const power = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 5, 10].map((m) => m * power).find((v) => v >= value);
}

function drawChart() {
  const canvas = $("chart");
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  const g = canvas.getContext("2d");
  g.scale(ratio, ratio);
  g.clearRect(0, 0, width, height);
  const pad = { left: 38, right: 8, top: 8, bottom: 18 };
  const points = state.chartHistory;
  // The server's clock places the points: "now" is its newest point, not this browser's time.
  const end = points.length ? points[points.length - 1][0] : Date.now() / 1000;
  const start = end - HISTORY_SECONDS;
  const top = niceCeiling(Math.max(1, ...points.map((p) => p[1])));
  const x = (t) => pad.left + ((t - start) / HISTORY_SECONDS) * (width - pad.left - pad.right);
  const y = (v) => height - pad.bottom - (v / top) * (height - pad.top - pad.bottom);

  g.font = "11px system-ui, sans-serif";
  g.fillStyle = "#667085";
  g.strokeStyle = "#d9dee7";
  g.lineWidth = 1;
  g.textAlign = "right";
  g.textBaseline = "middle";
  for (const v of [0, top / 2, top]) {
    g.beginPath();
    g.moveTo(pad.left, Math.round(y(v)) + 0.5);
    g.lineTo(width - pad.right, Math.round(y(v)) + 0.5);
    g.stroke();
    g.fillText(Number.isInteger(v) ? v : v.toFixed(1), pad.left - 5, y(v));
  }
  g.textBaseline = "alphabetic";
  g.textAlign = "left";
  g.fillText("−5 min", pad.left, height - 4);
  g.textAlign = "right";
  g.fillText("now", width - pad.right, height - 4);
  if (!points.length) return;

  g.beginPath();
  points.forEach(([t, v], i) => (i ? g.lineTo(x(t), y(v)) : g.moveTo(x(t), y(v))));
  g.strokeStyle = "#2f6fed";
  g.lineWidth = 2;
  g.stroke();
  g.lineTo(x(points[points.length - 1][0]), y(0));
  g.lineTo(x(points[0][0]), y(0));
  g.closePath();
  g.fillStyle = "rgba(47, 111, 237, 0.15)";
  g.fill();
}

// ---------- journeys ----------

function track(id, kind) {
  const journey = { id, kind, ended: null, settled: false, trace: null, note: "waiting for its trace…" };
  state.journeys.unshift(journey);
  state.journeys.length = Math.min(state.journeys.length, MAX_JOURNEYS);
  drawWaterfall();
  return journey;
}

async function refreshTrace(journey) {
  try {
    const response = await fetch(`/v1/requests/${encodeURIComponent(journey.id)}/trace`, { headers: headers() });
    if (response.ok) {
      journey.trace = await response.json();
      journey.note = null;
    } else if (response.status !== 404) {  // 404: not recorded yet, ask again
      journey.note = await errorMessage(response);
    }
  } catch (error) {
    journey.note = error.message;
  }
  const finished = journey.trace && journey.trace.events.some((e) => e.hop === LAST_HOP);
  journey.settled = finished || (journey.ended !== null && Date.now() - journey.ended > TRACE_PATIENCE_MS);
  if (journey.settled && !journey.trace) journey.note = journey.note || "no trace was recorded";
}

async function refreshTraces() {
  const open = state.journeys.filter((j) => !j.settled);
  if (!open.length) return;
  await Promise.all(open.map(refreshTrace));
  drawWaterfall();
}

function segments(events) {
  const origin = events[0].at;
  return events.slice(1).map((to, i) => {
    const from = events[i];
    // Every service that drops a cancelled request says so: all those stretches are one "cancelled".
    const name = to.hop === "cancelled" ? "cancelled" : PHASES[`${from.hop}>${to.hop}`] || `${from.hop} → ${to.hop}`;
    const colour = COLOURS[name] || "#98a2b3";
    return { name, colour, from, to, start: (from.at - origin) * 1000, ms: (to.at - from.at) * 1000 };
  });
}

// The model a journey named, and the worker it was dispatched to last, from its trace's hops.
function servedBy(journey) {
  const events = journey.trace ? journey.trace.events : [];
  const received = events.find((e) => e.hop === "received");
  const dispatched = events.filter((e) => e.hop === "dispatched").pop();
  return { model: (received && received.detail && received.detail.model) || "",
    worker: (dispatched && dispatched.detail && dispatched.detail.worker_id) || "" };
}

function drawWaterfall() {
  const box = $("waterfall");
  if (!state.journeys.length) return;
  const width = Math.max(box.clientWidth, 480);
  const labelWidth = 170;
  const totalWidth = 70;
  const rowHeight = 26;
  const axisHeight = 20;
  const barWidth = width - labelWidth - totalWidth;
  const rows = state.journeys.map((j) => ({ journey: j, parts: j.trace && j.trace.events.length > 1
    ? segments(j.trace.events) : [] }));
  const spans = rows.map((r) => r.parts.reduce((end, p) => Math.max(end, p.start + p.ms), 0));
  // One scale for every row, so that rows compare; each row starts when the gateway received it.
  const scale = Math.max(...spans, 1);
  const height = axisHeight + rows.length * rowHeight;
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-label": "Waterfall of the last requests" });

  for (let i = 0; i <= 4; i += 1) {
    const x = labelWidth + (barWidth * i) / 4;
    root.append(svg("line", { class: "grid", x1: x, x2: x, y1: axisHeight - 4, y2: height }));
    root.append(svg("text", { class: "axis", x, y: axisHeight - 8, "text-anchor": i ? (i === 4 ? "end" : "middle")
      : "start" }, `${formatMs((scale * i) / 4)} ms`));
  }
  rows.forEach(({ journey, parts }, row) => {
    const top = axisHeight + row * rowHeight;
    const served = servedBy(journey);
    const label = svg("text", { x: 0, y: top + rowHeight / 2 + 4, "data-model": served.model },
      `${journey.id.slice(0, 8)} · ${served.model || journey.kind}`);
    label.append(svg("title", {}, [journey.id, journey.kind, served.model, served.worker && `worker ${served.worker}`]
      .filter(Boolean).join(" · ")));
    const group = svg("g", { class: "journey", "data-request-id": journey.id });
    group.append(label);
    if (!parts.length) {
      group.append(svg("text", { class: "axis", x: labelWidth, y: top + rowHeight / 2 + 4 },
        journey.note || "the trace has a single hop so far"));
    }
    for (const part of parts) {
      const x = labelWidth + (part.start / scale) * barWidth;
      const w = Math.max((part.ms / scale) * barWidth, 1);
      const rect = svg("rect", { class: "seg", x, y: top + 4, width: w, height: rowHeight - 8, rx: 2,
        fill: part.colour, "data-hop": part.to.hop });
      rect.append(svg("title", {}, `${part.name}: ${formatMs(part.ms)} ms (${part.from.hop} → ${part.to.hop}, `
        + `${part.to.service})`));
      group.append(rect);
      if (w > part.name.length * 6.5 + 6) {
        group.append(svg("text", { class: "seg-label", x: x + 4, y: top + rowHeight / 2 + 4 }, part.name));
      }
    }
    if (parts.length) {
      group.append(svg("text", { x: width, y: top + rowHeight / 2 + 4, "text-anchor": "end" },
        `${formatMs(spans[row])} ms`));
    }
    root.append(group);
  });
  // The short stretches are too narrow for their names: the legend names every colour drawn.
  const legend = el("div", "legend");
  const named = new Map(rows.flatMap((r) => r.parts.map((p) => [p.name, p.colour])));
  for (const [name, colour] of named) {
    const swatch = el("span", "swatch");
    swatch.style.background = colour;
    const item = el("span", "legend-item");
    item.append(swatch, name);
    legend.append(item);
  }
  box.replaceChildren(root, legend);
}
