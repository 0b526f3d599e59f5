"use strict";
// The gateway's page: a playground over the OpenAI routes (playground.js), the cluster and batch jobs every 2 s
// and a waterfall of the traces of the last requests sent from here (views.js). Plain DOM, canvas and SVG: the
// page must work offline. This file holds what they share and starts the page once all three are loaded.

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const REFRESH_MS = 2000;

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

// Deferred scripts run in order before DOMContentLoaded: by then playground.js and views.js are loaded too.
document.addEventListener("DOMContentLoaded", start);
