"use strict";
// The playground: a chat or a completion over the OpenAI routes, streamed, with its figures (TTFT, tokens/s).
// Uses app.js's helpers and state; `track` (views.js) draws the answer's journey.

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
