"use strict";
// The gateway's page: a playground over the OpenAI routes, the cluster every 2 s, and a waterfall of the
// traces of the last requests sent from here. Plain DOM, canvas and SVG: the page must work offline.

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const REFRESH_MS = 2000;
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

const state = {
  history: [],       // completed chat turns, sent again with each new message
  controller: null,  // the AbortController of the answer being streamed
  streaming: null,  // the request_id of that answer, once its headers came
  journeys: [],      // {id, kind, ended, settled, trace, note}, newest first
  chartHistory: [],
};

// ---------- helpers ----------

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function svg(tag, attributes, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function headers(extra = {}) {
  const key = $("api-key").value.trim();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function errorMessage(response) {
  try {
    const { error } = await response.json();
    if (error) return `${response.status}: ${error.message}${error.code ? ` (${error.code})` : ""}`;
  } catch { /* the body is not the gateway's JSON error */ }
  return `${response.status} ${response.statusText}`;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function formatMs(ms) {
  if (ms === 0) return "0";
  return ms < 10 ? ms.toFixed(1) : Math.round(ms).toString();
}

// ---------- playground ----------

function mode() {
  return $("mode-chat").checked ? "chat" : "completion";
}

function applyMode() {
  document.body.classList.toggle("completion", mode() === "completion");
  $("prompt-label").textContent = mode() === "chat" ? "Message" : "Prompt";
}

function numberField(id, parse) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : parse(raw);
}

function stopStrings() {
  const raw = $("stop").value;
  if (!raw) return undefined;
  return raw.split("|").map((s) => s.replaceAll("\\n", "\n").replaceAll("\\t", "\t")).filter(Boolean);
}

function requestBody(prompt) {
  // Fields left empty are left out (JSON drops undefined), so the gateway's defaults apply.
  const body = {
    model: $("model").value, stream: true, stream_options: { include_usage: true },
    max_tokens: numberField("max-tokens", parseInt), temperature: numberField("temperature", parseFloat),
    top_p: numberField("top-p", parseFloat), top_k: numberField("top-k", parseInt),
    seed: numberField("seed", parseInt), stop: stopStrings(),
  };
  if (mode() === "chat") {
    const system = $("system").value.trim();
    body.messages = [...(system ? [{ role: "system", content: system }] : []), ...state.history,
      { role: "user", content: prompt }];
  } else {
    body.prompt = prompt;
  }
  return body;
}

function renderTranscript(pending) {
  const turns = pending ? [...state.history, { role: "user", content: pending }] : state.history;
  $("transcript").replaceChildren(...turns.map((turn) => {
    const line = el("div", `turn ${turn.role}`);
    line.append(el("b", "", turn.role === "user" ? "You" : "Assistant"), turn.content);
    return line;
  }));
  $("transcript").scrollTop = $("transcript").scrollHeight;
}

function resetAnswer() {
  showError("");
  $("output").textContent = "";
  for (const id of ["ttft", "tps", "tokens", "finish", "request-id"]) $(id).textContent = "–";
}

function showRate(tokens, started, first, now) {
  // Once the first token is out, the rate is the decoding speed: its wait is what TTFT shows.
  const decoding = (now - first) / 1000;
  const rate = tokens > 1 && decoding > 0 ? (tokens - 1) / decoding : tokens / ((now - started) / 1000);
  $("tps").textContent = rate.toFixed(1);
  $("tokens").textContent = tokens;
}

// Yields each JSON chunk of an OpenAI stream (`data: {...}` events) until `data: [DONE]`.
async function* sseChunks(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    for (let end = /\r?\n\r?\n/.exec(buffer); end; end = /\r?\n\r?\n/.exec(buffer)) {
      const block = buffer.slice(0, end.index);
      buffer = buffer.slice(end.index + end[0].length);
      const data = block.split(/\r?\n/).filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("cancel").disabled = !busy;
  $("output").classList.toggle("streaming", busy);
}

async function send(event) {
  event.preventDefault();
  const prompt = $("prompt").value;
  if (state.controller) return;
  if (!prompt.trim()) {
    showError("Write a prompt first.");
    return;
  }
  const chat = mode() === "chat";
  const body = requestBody(prompt);
  resetAnswer();
  if (chat) {
    renderTranscript(prompt);
    $("prompt").value = "";
  }
  state.controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let first = null;
  let count = 0;
  let usage = null;
  let finish = null;
  let answer = "";
  let journey = null;
  try {
    const response = await fetch(chat ? "/v1/chat/completions" : "/v1/completions", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body),
      signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    const requestId = response.headers.get("X-Request-Id");
    state.streaming = requestId;
    if (requestId) {
      $("request-id").textContent = requestId;
      journey = track(requestId, chat ? "chat" : "completion");
    }
    for await (const chunk of sseChunks(response)) {
      if (chunk.error) throw new Error(`${chunk.error.message}${chunk.error.code ? ` (${chunk.error.code})` : ""}`);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = chat ? choice.delta && choice.delta.content : choice.text;
      if (delta) {
        const now = performance.now();
        if (first === null) {
          first = now;
          $("ttft").textContent = formatMs(now - started);
        }
        count += 1;
        answer += delta;
        $("output").append(delta);
        showRate(count, started, first, now);
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    const tokens = usage ? usage.completion_tokens : count;
    if (first !== null) showRate(tokens, started, first, performance.now());
    else $("tokens").textContent = tokens;
    if (chat) state.history.push({ role: "user", content: prompt }, { role: "assistant", content: answer });
  } catch (error) {
    if (error.name === "AbortError") {
      finish = "stopped";
    } else {
      finish = "error";
      showError(error.message);
      // Give the failed message back so that it can be sent again.
      if (chat && !$("prompt").value) $("prompt").value = prompt;
    }
  } finally {
    $("finish").textContent = finish || "–";
    state.controller = null;
    state.streaming = null;
    setBusy(false);
    if (journey) {
      journey.ended = Date.now();
      refreshTraces();
    }
  }
}

// A stream outlives its connection for RESUME_GRACE (it could be resumed): stopping an answer also
// cancels its request, so that its slot is free at once.
function stopAnswer() {
  if (!state.controller) return;
  if (state.streaming) {
    fetch(`/v1/requests/${encodeURIComponent(state.streaming)}`, { method: "DELETE", headers: headers() })
      .catch(() => {});
  }
  state.controller.abort();
}

function newChat() {
  stopAnswer();
  state.history = [];
  renderTranscript();
  resetAnswer();
}

async function loadModels() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) throw new Error(await errorMessage(response));
    const { data } = await response.json();
    const select = $("model");
    const previous = select.value;
    select.replaceChildren(...data.map((m) => new Option(m.id, m.id)));
    if (data.some((m) => m.id === previous)) select.value = previous;
    showError("");
  } catch (error) {
    showError(`Could not list the models: ${error.message}`);
  }
}

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

// ---------- start ----------

async function tick() {
  await Promise.all([refreshCluster(), refreshBatches(), refreshTraces()]);
  setTimeout(tick, REFRESH_MS);
}

function start() {
  const key = $("api-key");
  key.value = localStorage.getItem("llmserve.apiKey") || "";
  key.addEventListener("change", () => {
    localStorage.setItem("llmserve.apiKey", key.value.trim());
    loadModels();
  });
  for (const radio of document.querySelectorAll("input[name=mode]")) radio.addEventListener("change", applyMode);
  $("form").addEventListener("submit", send);
  $("cancel").addEventListener("click", stopAnswer);
  $("new-chat").addEventListener("click", newChat);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("form").requestSubmit();
  });
  window.addEventListener("resize", () => {
    drawChart();
    drawWaterfall();
  });
  applyMode();
  loadModels();
  tick();
}

start();
