// One function per tab. Each gets its panel and wires the form to one endpoint through
// `runner`, which owns what every tab shares: send/stop, the AbortController, the error
// line and the figures.
import { Figures, postJSON, streamEvents } from "./api.js";

const number = (form, name) => {
  const raw = form.elements[name].value.trim();
  return raw === "" ? undefined : Number(raw);
};
const lines = (text) => text.split("\n").map((l) => l.trim()).filter(Boolean);

function runner(panel, work) {
  const form = panel.querySelector("form");
  const send = panel.querySelector("[data-send]");
  const stop = panel.querySelector("[data-stop]");
  const error = panel.querySelector("[data-error]");
  const figures = new Figures(panel.querySelector("[data-figures]"));
  let controller = null;

  stop.addEventListener("click", () => controller && controller.abort());
  panel.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && controller) controller.abort();
    if (e.key !== "Enter" || e.target.tagName !== "TEXTAREA" || e.isComposing) return;
    const enterSends = "enterSends" in e.target.dataset;
    if (e.ctrlKey || e.metaKey || (enterSends && !e.shiftKey)) {
      e.preventDefault();
      form.requestSubmit();
    }
  });
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    if (controller) return;
    controller = new AbortController();
    error.hidden = true;
    const sentFromButton = document.activeElement === send;
    send.disabled = true;
    stop.disabled = false;
    if (sentFromButton) stop.focus();  // a disabled button drops the keyboard focus: hand it on
    panel.dataset.state = "running";
    figures.start();
    try {
      await work(form, controller.signal, figures);
      panel.dataset.state = "done";
    } catch (err) {
      if (err.name === "AbortError") {
        panel.dataset.state = "stopped";
      } else {
        error.textContent = err.message;
        error.hidden = false;
        panel.dataset.state = "error";
      }
    } finally {
      figures.finish();
      controller = null;
      const focusWasOnStop = document.activeElement === stop;
      send.disabled = false;
      stop.disabled = true;
      if (focusWasOnStop) send.focus();
    }
  });
}

function sampling(form) {
  return {
    model: form.elements.model.value, temperature: number(form, "temperature"), top_p: number(form, "top_p"),
    max_tokens: number(form, "max_tokens"), seed: number(form, "seed"),
  };
}

export function setupChat(panel) {
  const log = panel.querySelector("[data-log]");
  let history = [];  // {role, content} turns of this conversation, the system prompt aside
  panel.querySelector("[data-new-chat]").addEventListener("click", () => {
    history = [];
    log.replaceChildren();
    panel.querySelector("textarea[name=message]").focus();
  });
  const bubble = (role, text) => {
    const li = log.appendChild(Object.assign(document.createElement("li"), { textContent: text }));
    li.dataset.role = role;
    return li;
  };

  runner(panel, async (form, signal, figures) => {
    const message = form.elements.message.value.trim();
    if (!message) return;
    const system = form.elements.system.value.trim();
    history.push({ role: "user", content: message });
    const asked = bubble("user", message);
    form.elements.message.value = "";
    const reply = bubble("assistant", "");
    const messages = (system ? [{ role: "system", content: system }] : []).concat(history);
    const calls = [];  // tool calls of this answer, as the stream assembles them
    try {
      const body = { ...sampling(form), ...structured(form), messages, stream: true,
                     stream_options: { include_usage: true } };
      for await (const chunk of streamEvents("v1/chat/completions", body, signal)) {
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) {
          reply.textContent += delta.content;
          log.scrollTop = log.scrollHeight;  // follow the answer as it grows
          figures.tokens(1);
        }
        for (const part of (delta && delta.tool_calls) || []) {  // OpenAI's shape: id and name, then arguments
          const call = calls[part.index] || (calls[part.index] = { id: part.id, type: "function",
                                                                   function: { name: "", arguments: "" } });
          call.function.name += (part.function && part.function.name) || "";
          call.function.arguments += (part.function && part.function.arguments) || "";
          showCalls(reply, calls);
        }
        figures.usage(chunk.usage);
      }
    } catch (err) {
      if (err.name !== "AbortError") {  // a refused turn leaves the conversation as it was
        history.pop();
        asked.remove();
        reply.remove();
        form.elements.message.value = message;
        throw err;
      }
      reply.dataset.stopped = "";
      history.push({ role: "assistant", content: reply.textContent });  // a stopped answer stays as far as it got
      throw err;
    }
    history.push(calls.length ? { role: "assistant", content: null, tool_calls: calls }
                              : { role: "assistant", content: reply.textContent });
  });
}

function parsedJSON(form, name, label) {
  const text = form.elements[name].value.trim();
  if (!text) return null;
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new Error(`${label} is not valid JSON: ${err.message}`);
  }
}

// The chat's optional JSON schema (response_format) and tools, as the API takes them.
function structured(form) {
  const body = {};
  const schema = parsedJSON(form, "json_schema", "The JSON schema");
  if (schema) body.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
  const tools = parsedJSON(form, "tools", "Tools");
  if (tools) {
    body.tools = tools;
    body.tool_choice = form.elements.tool_choice.value;
  }
  return body;
}

function showCalls(reply, calls) {
  reply.dataset.toolCalls = "";
  reply.replaceChildren(...calls.map((c) => Object.assign(document.createElement("code"), {
    className: "tool-call", textContent: `${c.function.name}(${c.function.arguments})`,
  })));
}

export function setupGenerate(panel) {
  const output = panel.querySelector("[data-output]");
  runner(panel, async (form, signal, figures) => {
    const prompt = form.elements.prompt.value;
    const generated = document.createTextNode("");
    output.replaceChildren(Object.assign(document.createElement("b"), { textContent: prompt }), generated);
    const body = { ...sampling(form), prompt, stream: true };
    for await (const chunk of streamEvents("v1/completions", body, signal)) {
      const choice = chunk.choices && chunk.choices[0];
      if (choice && choice.text) {
        generated.appendData(choice.text);
        figures.tokens(1);
      }
      figures.usage(chunk.usage);
    }
  });
}

export function setupTranslate(panel) {
  const output = panel.querySelector("[data-output]");
  const row = (source, text) => {
    const li = document.createElement("li");
    const target = Object.assign(document.createElement("span"), { className: "target", textContent: text });
    li.append(Object.assign(document.createElement("span"), { className: "source", textContent: source }), target);
    output.appendChild(li);
    return target;
  };
  runner(panel, async (form, signal, figures) => {
    const texts = lines(form.elements.text.value);
    const params = { model: form.elements.model.value, beam_size: number(form, "beam_size"),
      max_tokens: number(form, "max_tokens") };
    output.replaceChildren();
    if (texts.length === 1) {  // one text streams (beam search sends its answer in one chunk)
      const target = row(texts[0], "");
      for await (const chunk of streamEvents("v1/translate", { ...params, text: texts[0], stream: true }, signal)) {
        if (chunk.text) {
          target.textContent = (target.textContent + chunk.text).trimStart();
          figures.tokens(1);
        }
        figures.usage(chunk.usage);
      }
      return;
    }
    const result = await postJSON("v1/translate", { ...params, text: texts }, signal);
    result.translations.forEach((t, i) => row(texts[i], t.text));
    figures.usage(result.usage);
  });
}

export function setupFillMask(panel) {
  const output = panel.querySelector("[data-output]");
  runner(panel, async (form, signal) => {
    const result = await postJSON("v1/fill-mask", { model: form.elements.model.value,
      text: form.elements.text.value, top_k: number(form, "top_k") }, signal);
    const perMask = Array.isArray(result[0]) ? result : [result];  // one mask: a flat list
    output.replaceChildren(...perMask.flatMap((candidates, i) => {
      const title = document.createElement("h3");
      title.append(perMask.length > 1 ? `Mask ${i + 1} ` : "Candidates ",
        Object.assign(document.createElement("span"), { textContent: "(probability; bars relative to the first)" }));
      const best = Math.max(...candidates.map((c) => c.score)) || 1;
      return [title, ...candidates.map((c) => candidateRow(c, best))];
    }));
  });
}

function candidateRow(c, best) {
  const row = Object.assign(document.createElement("div"), { className: "candidate", title: c.sequence });
  const track = Object.assign(document.createElement("div"), { className: "track" });
  const bar = Object.assign(document.createElement("div"), { className: "bar" });
  bar.style.width = `${Math.max(0, Math.min(1, c.score / best)) * 100}%`;
  bar.setAttribute("role", "meter");
  bar.setAttribute("aria-valuemin", "0");
  bar.setAttribute("aria-valuemax", String(best));
  bar.setAttribute("aria-valuenow", String(c.score));
  bar.setAttribute("aria-label", `score of ${c.token_str}`);
  track.appendChild(bar);
  row.append(Object.assign(document.createElement("span"), { className: "token", textContent: c.token_str }), track,
    Object.assign(document.createElement("span"), { className: "score", textContent: c.score.toFixed(3) }));
  return row;
}

export function cosine(a, b) {
  let dot = 0, na = 0, nb = 0;
  for (let i = 0; i < a.length; i++) {
    dot += a[i] * b[i];
    na += a[i] * a[i];
    nb += b[i] * b[i];
  }
  return na && nb ? dot / Math.sqrt(na * nb) : 0;
}

export function setupEmbeddings(panel) {
  const output = panel.querySelector("[data-output]");
  runner(panel, async (form, signal, figures) => {
    const texts = lines(form.elements.sentences.value);
    const result = await postJSON("v1/embeddings", { model: form.elements.model.value, input: texts }, signal);
    figures.usage(result.usage);
    const vectors = result.data.sort((a, b) => a.index - b.index).map((d) => d.embedding);
    output.replaceChildren(heatmap(texts, vectors));
  });
}

function heatmap(texts, vectors) {
  const table = document.createElement("table");
  table.createCaption().textContent = "Cosine similarity";
  const head = table.createTHead().insertRow();
  head.appendChild(document.createElement("th"));
  texts.forEach((_, j) => head.appendChild(Object.assign(document.createElement("th"), { scope: "col", textContent: j + 1 })));
  const sims = vectors.map((a) => vectors.map((b) => cosine(a, b)));
  // Colour spans this matrix's own range (lowest pair .. 1), so close scores still differ in shade.
  const low = Math.min(...sims.flat());
  const shade = (sim) => (low < 1 ? (sim - low) / (1 - low) : 1);
  const body = table.createTBody();
  vectors.forEach((_, i) => {
    const tr = body.insertRow();
    tr.appendChild(Object.assign(document.createElement("th"), { scope: "row", textContent: i + 1 }));
    vectors.forEach((__, j) => {
      const sim = sims[i][j];
      const td = tr.insertCell();
      td.textContent = sim.toFixed(2);
      td.title = `${texts[i]}\n${texts[j]}\ncosine ${sim.toFixed(4)}`;
      td.dataset.similarity = String(sim);
      const t = shade(sim);  // pale (least similar) to strong blue; white text once the cell is dark
      td.style.backgroundColor = `hsl(215 70% ${Math.round(95 - t * 60)}%)`;
      td.style.color = t > 0.6 ? "#fff" : "#111";
    });
  });
  const legend = document.createElement("ol");
  legend.append(...texts.map((t) => Object.assign(document.createElement("li"), { textContent: t })));
  const wrap = document.createElement("div");
  wrap.append(table, legend);
  return wrap;
}
