// Talking to the server: the API key, JSON and Server-Sent-Event requests, the server's
// error messages, the figures shown under each answer, and the load panel (/metrics).
// Every URL is relative, so the page works wherever the service is mounted.

const KEY_NAME = "tserve.apiKey";
let whenUnauthorized = () => {};

export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.name = "ApiError";
    this.status = status;
  }
}

export const apiKey = () => sessionStorage.getItem(KEY_NAME) || "";
export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_NAME, key);
  else sessionStorage.removeItem(KEY_NAME);
}
export function onUnauthorized(callback) { whenUnauthorized = callback; }

function headers(withBody) {
  const h = withBody ? { "Content-Type": "application/json" } : {};
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// The server answers errors as {"error": {"message", ...}}: show its message, not the status.
async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch { /* not JSON: keep the status line */ }
  if (response.status === 401) whenUnauthorized(message);
  return new ApiError(message, response.status);
}

export async function request(path, { body, signal } = {}) {
  const withBody = body !== undefined;
  const response = await fetch(path, {
    method: withBody ? "POST" : "GET", headers: headers(withBody),
    body: withBody ? JSON.stringify(body) : undefined, signal,
  });
  if (!response.ok) throw await errorOf(response);
  return response;
}

export async function postJSON(path, body, signal) {
  return (await request(path, { body, signal })).json();
}

// POST, then yield each `data: {json}` chunk until `data: [DONE]`. An error chunk
// ({"error": ...}) mid-stream is thrown with the server's message. Aborting `signal`
// closes the connection, which the server takes as "stop generating and free the slot".
export async function* streamEvents(path, body, signal) {
  const response = await request(path, { body, signal });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(chunk.error.message || "request failed", 0);
        yield chunk;
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

const dash = "–";
const seconds = (ms) => (ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`);

// Time to first token, tokens/s, tokens in and out for one answer, updated as it streams.
// Token counts while streaming are one per chunk; the server's `usage` replaces them at the end.
export class Figures {
  constructor(root) { this.root = root; }

  start() {
    Object.assign(this, { t0: performance.now(), first: null, last: null, end: null, out: 0, in: null, exact: false });
    this.render();
  }

  tokens(n = 1) {
    const now = performance.now();
    if (this.first === null) this.first = now;
    this.last = now;
    if (!this.exact) this.out += n;
    this.render();
  }

  usage(u) {
    if (!u) return;
    this.in = u.prompt_tokens;
    this.out = u.completion_tokens || 0;
    this.exact = true;
    this.render();
  }

  finish() {
    this.end = performance.now();
    if (this.first === null) this.first = this.last = this.end;  // a whole answer at once
    this.render();
  }

  rate() {
    // Streamed: decode speed after the first token. At once: output tokens over the whole request.
    if (this.out > 1 && this.last > this.first) return (this.out - 1) / ((this.last - this.first) / 1000);
    if (this.out > 0 && this.end !== null) return this.out / ((this.end - this.t0) / 1000);
    return null;
  }

  render() {
    const rate = this.rate();
    const rows = [
      ["ttft", "time to first token", this.first === null ? dash : seconds(this.first - this.t0)],
      ["rate", "tokens/s", rate === null ? dash : rate.toFixed(1)],
      ["in", "tokens in", this.in === null ? dash : String(this.in)],
      ["out", "tokens out", this.exact || this.out ? String(this.out) : dash],
      ["total", "total", this.end === null ? dash : seconds(this.end - this.t0)],
    ];
    this.root.replaceChildren(...rows.map(([key, label, value]) => {
      const div = document.createElement("div");
      const dt = document.createElement("dt");
      const dd = document.createElement("dd");
      dt.textContent = label;
      dd.textContent = value;
      dd.dataset.figure = key;
      div.append(dt, dd);
      return div;
    }));
  }
}

// Prometheus text -> {model: {running, waiting, kv}} for the three gauges the panel shows.
const GAUGES = { tserve_running_requests: "running", tserve_waiting_requests: "waiting", tserve_kv_cache_usage_ratio: "kv" };
export function parseLoad(text) {
  const models = {};
  for (const line of text.split("\n")) {
    const m = /^([a-z_]+)\{([^}]*)\}\s+(\S+)/.exec(line);
    if (!m || !(m[1] in GAUGES)) continue;
    const model = (/(?:^|,)model="((?:[^"\\]|\\.)*)"/.exec(m[2]) || [, "?"])[1];
    (models[model] ||= { running: 0, waiting: 0, kv: 0 })[GAUGES[m[1]]] = Number(m[3]);
  }
  return models;
}

export function startLoadPanel(everyMs = 2000) {
  const out = (id) => document.getElementById(id);
  const note = out("load-note");
  async function poll() {
    if (document.hidden) return;
    try {
      const response = await fetch("metrics", { headers: headers(false) });
      if (!response.ok) throw new Error(response.status === 401 ? "needs the API key" : `HTTP ${response.status}`);
      const models = Object.entries(parseLoad(await response.text()));
      const sum = (k) => models.reduce((s, [, g]) => s + g[k], 0);
      out("load-running").textContent = String(sum("running"));
      out("load-waiting").textContent = String(sum("waiting"));
      const busiest = models.reduce((best, e) => (!best || e[1].kv > best[1].kv ? e : best), null);
      out("load-kv").textContent = busiest ? `${Math.round(busiest[1].kv * 100)}%` : dash;
      out("load-kv").title = models.map(([name, g]) => `${name}: ${Math.round(g.kv * 100)}%`).join("\n");
      note.hidden = true;
    } catch (err) {
      note.textContent = `load unavailable: ${err.message}`;
      note.hidden = false;
    }
  }
  poll();
  return setInterval(poll, everyMs);
}
