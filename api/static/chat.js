// The chat page. The conversation is `state.messages`; each answer is one job (POST /v1/jobs) read over
// EventSource from its events_url. After a dropped connection the browser reconnects by itself, sending
// Last-Event-ID, and the server sends only what follows. Event ids ("<seq>.<chunk>") only grow, so an
// event at or below the last one shown is a repeat and is dropped: the text never shows one twice.
"use strict";

const KEY_STORAGE = "pagedserve.apiKey"; // this tab only: sessionStorage, never a URL
const MAX_RECOVERIES = 3;
const STOP_WAIT_MS = 5000; // after DELETE, how long the stream may take to say "aborted"
const $ = (id) => document.getElementById(id);
const state = { model: null, messages: [], answer: null };

class NeedsKey extends Error {}

async function api(method, path, body) {
  const headers = {};
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const data = await resp.json().catch(() => ({}));
  const message = data.error?.message || `HTTP ${resp.status}`;
  if (resp.status === 401) {
    askForKey(key ? `${message}: try another key` : "this server needs an API key");
    throw new NeedsKey(message);
  }
  if (!resp.ok) throw new Error(message);
  return data;
}

function askForKey(why) {
  sessionStorage.removeItem(KEY_STORAGE);
  $("key-form").hidden = false;
  $("key").focus();
  setStatus(why);
}

function setStatus(text) {
  $("status").textContent = text;
}

function setBusy(isBusy) {
  $("send").disabled = isBusy || !state.model;
  $("stop").disabled = !isBusy;
  $("clear").disabled = isBusy;
}

function addBubble(role, text) {
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  el.textContent = text;
  $("log").append(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function isAfter(id, lastId) {
  if (!lastId) return true;
  const [seq, chunk] = id.split(".").map(Number);
  const [lastSeq, lastChunk] = lastId.split(".").map(Number);
  return seq > lastSeq || (seq === lastSeq && chunk > lastChunk);
}

function withLastEventId(url, lastId) {
  return lastId ? `${url}${url.includes("?") ? "&" : "?"}last_event_id=${encodeURIComponent(lastId)}` : url;
}

// One assistant answer: its bubble, the text shown so far, the last event id, the decode rate.
class Answer {
  constructor(job) {
    this.jobId = job.id;
    this.text = "";
    this.lastId = null;
    this.numTokens = 0;
    this.firstAt = null;
    this.lastAt = null;
    this.numRecoveries = 0;
    this.isEnded = false;
    this.el = addBubble("assistant", "");
    this.body = this.el.appendChild(document.createElement("span"));
    this.el.dataset.jobId = job.id;
    this.el.dataset.state = "streaming";
    this.open(job.events_url);
  }

  open(url) {
    this.source = new EventSource(withLastEventId(url, this.lastId));
    this.source.onopen = () => setStatus("streaming");
    this.source.onmessage = (e) => this.onMessage(e);
    this.source.onerror = () => this.onError();
  }

  onMessage(e) {
    if (e.data === "[DONE]") return this.end();
    const chunk = JSON.parse(e.data);
    if (chunk.error) return this.fail(chunk.error); // may carry no id of its own
    if (e.lastEventId && !isAfter(e.lastEventId, this.lastId)) return; // a repeat
    this.lastId = e.lastEventId || this.lastId;
    this.numRecoveries = 0;
    for (const choice of chunk.choices) this.addText(choice.delta?.content ?? choice.text ?? "", choice.finish_reason);
    if (chunk.usage) this.numTokens = chunk.usage.completion_tokens; // the exact count, at the end
    this.showRate();
  }

  addText(text, finishReason) {
    if (!text) return;
    this.text += text;
    this.body.textContent = this.text;
    if (finishReason === null) {
      // one delta per engine step: one token each (a final chunk only carries text not streamed yet)
      this.numTokens += 1;
      this.lastAt = performance.now();
      this.firstAt ??= this.lastAt;
    }
    this.el.scrollIntoView({ block: "end" });
  }

  showRate() {
    const seconds = (this.lastAt - this.firstAt) / 1000;
    if (this.numTokens > 1 && seconds > 0) $("rate").textContent = `${((this.numTokens - 1) / seconds).toFixed(1)} tok/s`;
  }

  onError() {
    if (this.isEnded) return;
    if (this.source.readyState === EventSource.CONNECTING) {
      setStatus("connection lost: resuming…"); // the browser retries with Last-Event-ID
      return;
    }
    this.source.close(); // the server refused the stream (an expired token, say): ask for a fresh events_url
    this.recover();
  }

  async recover() {
    if (++this.numRecoveries > MAX_RECOVERIES) return this.fail({ message: "the stream could not be resumed" });
    await new Promise((resolve) => setTimeout(resolve, 500 * this.numRecoveries));
    try {
      const job = await api("GET", `/v1/jobs/${this.jobId}`);
      this.open(job.events_url);
    } catch (err) {
      if (err instanceof NeedsKey) return this.fail({ message: err.message });
      this.recover();
    }
  }

  fail(error) {
    const isStopped = error.code === "aborted";
    this.el.dataset.state = isStopped ? "stopped" : "error";
    const note = this.el.appendChild(document.createElement("span"));
    note.className = "note";
    note.textContent = isStopped ? "stopped" : error.message;
    this.end();
  }

  end() {
    if (this.isEnded) return;
    this.isEnded = true;
    this.source.close();
    if (this.el.dataset.state === "streaming") this.el.dataset.state = "done";
    if (this.text) state.messages.push({ role: "assistant", content: this.text });
    state.answer = null;
    setBusy(false);
    setStatus(this.el.dataset.state === "done" ? "" : this.el.dataset.state);
  }
}

function samplingParams() {
  const number = (id) => Number($(id).value);
  return { temperature: number("temperature"), max_tokens: number("max-tokens"), top_p: number("top-p") };
}

async function send(text) {
  state.messages.push({ role: "user", content: text });
  const bubble = addBubble("user", text);
  setBusy(true);
  setStatus("queued");
  const body = { model: state.model, messages: state.messages, ...samplingParams(), stream_options: { include_usage: true } };
  try {
    state.answer = new Answer(await api("POST", "/v1/jobs", body));
  } catch (err) {
    state.messages.pop();
    bubble.remove();
    $("prompt").value = text;
    setBusy(false);
    if (!(err instanceof NeedsKey)) setStatus(err.message);
  }
}

async function stop() {
  if (!state.answer) return;
  setStatus("stopping…");
  const answer = state.answer;
  try {
    await api("DELETE", `/v1/jobs/${answer.jobId}`); // the stream then ends with an "aborted" error
    // a job still queued may end without one: stop listening anyway
    setTimeout(() => answer.isEnded || answer.fail({ code: "aborted" }), STOP_WAIT_MS);
  } catch (err) {
    setStatus(err.message);
  }
}

async function connect() {
  try {
    const models = await api("GET", "/v1/models");
    state.model = models.data[0].id;
    $("model").textContent = state.model;
    $("key-form").hidden = true;
    setStatus("");
  } catch (err) {
    $("model").textContent = "not connected";
    if (!(err instanceof NeedsKey)) setStatus(err.message);
  }
  setBusy(false);
}

function init() {
  $("chat-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.answer || !state.model) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", () => {
    state.messages = [];
    $("log").replaceChildren();
  });
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY_STORAGE, $("key").value.trim());
    $("key").value = "";
    connect();
  });
  connect();
}

init();
