// The page: which tabs to show (from /v1/models), switching tabs by mouse and keyboard,
// and asking for the API key when the server wants one.
import { apiKey, onUnauthorized, request, setApiKey, startLoadPanel } from "./api.js";
import { setupChat, setupEmbeddings, setupFillMask, setupGenerate, setupTranslate } from "./tabs.js";

// A tab is shown when at least one model serves it, loaded or not (/v1/models says what a model
// is before it loads). Every encoder embeds: masked-LM ("fill-mask") ones and embedding-only
// ("feature-extraction") ones.
const TABS = [
  { name: "chat", serves: (m) => m.task === "text-generation" && m.chat === true, setup: setupChat },
  { name: "generate", serves: (m) => m.task === "text-generation", setup: setupGenerate },
  { name: "translate", serves: (m) => m.task === "translation", setup: setupTranslate },
  { name: "fill-mask", serves: (m) => m.task === "fill-mask", setup: setupFillMask },
  { name: "embeddings", serves: (m) => m.task === "fill-mask" || m.task === "feature-extraction", setup: setupEmbeddings },
];
const tab = (name) => document.getElementById(`tab-${name}`);
const panel = (name) => document.getElementById(`panel-${name}`);
const status = document.getElementById("status");

function visibleTabs() {
  return TABS.map((t) => tab(t.name)).filter((b) => !b.hidden);
}

function select(name, focus = false) {
  for (const t of TABS) {
    const chosen = t.name === name;
    tab(t.name).setAttribute("aria-selected", String(chosen));
    tab(t.name).tabIndex = chosen ? 0 : -1;
    panel(t.name).hidden = !chosen;
  }
  if (focus) tab(name).focus();
  history.replaceState(null, "", `#${name}`);
}

function wireTabs() {
  for (const t of TABS) {
    t.setup(panel(t.name));
    panel(t.name).querySelector("form").addEventListener("submit", () => setTimeout(() => followLoad(panel(t.name))));
    tab(t.name).addEventListener("click", () => select(t.name));
  }
  document.querySelector("[role=tablist]").addEventListener("keydown", (e) => {
    const tabs = visibleTabs();
    const at = tabs.indexOf(document.activeElement);
    if (at < 0) return;
    const moves = { ArrowRight: at + 1, ArrowLeft: at - 1, Home: 0, End: tabs.length - 1 };
    if (!(e.key in moves)) return;
    e.preventDefault();
    select(tabs[(moves[e.key] + tabs.length) % tabs.length].dataset.tab, true);
  });
  window.addEventListener("hashchange", () => {  // a link to #translate opens that tab
    const wanted = location.hash.slice(1);
    if (visibleTabs().some((b) => b.dataset.tab === wanted)) select(wanted);
  });
}

// A model that recommends its own sampling (/v1/models: sampling_defaults from its file or the
// server's override) gets it in the panel's fields when chosen; the others keep what is there.
function recommend(where, model) {
  const defaults = model && model.sampling_defaults;
  if (!defaults || !defaults.source.length) return;
  for (const name of ["temperature", "top_p"]) {
    const field = where.querySelector(`input[name="${name}"]`);
    if (field) field.value = defaults[name];
  }
}

// What each panel says about its chosen model's state: nothing once loaded; before, that it
// loads on its first request; while a request waits for the load, how long it has been loading.
let known = {};  // model id -> its /v1/models card, as last polled
const STATE_NOTES = {
  available: "Not loaded yet: it loads on its first request, which waits for the load.",
  loading: "Loading the model…",
  failed: "Its last load failed; a request tries again.",
};

function stateNote(where) {
  let note = where.querySelector("[data-model-state]");
  if (!note) {
    note = Object.assign(document.createElement("p"), { className: "model-state" });
    note.dataset.modelState = "";
    note.setAttribute("role", "status");
    where.querySelector("[data-model]").closest(".row").after(note);
  }
  return note;
}

function showState(where, since = null) {
  const model = known[where.querySelector("[data-model]").value];
  const note = stateNote(where);
  const state = model ? model.state : "loaded";
  note.dataset.state = state;
  note.hidden = state === "loaded";
  let text = STATE_NOTES[state] || "";
  if (state === "loading" && since !== null) text += ` ${((performance.now() - since) / 1000).toFixed(0)} s`;
  if (state === "failed" && model.state_reason) text += ` (${model.state_reason})`;
  note.textContent = text;
}

function label(m) {
  return m.state === "loaded" ? m.id : `${m.id} (${m.state === "available" ? "not loaded" : m.state})`;
}

// A request sent to a model that is not loaded: poll /v1/models while it loads, so the panel
// shows the load as it happens, then the option's label says it is loaded.
async function followLoad(where) {
  const id = where.querySelector("[data-model]").value;
  if (!known[id] || known[id].state === "loaded") return;
  const since = performance.now();
  while (where.dataset.state === "running" || known[id].state === "loading") {
    try {
      known[id] = await (await request(`v1/models/${encodeURIComponent(id)}`)).json();
    } catch (err) {
      break;
    }
    for (const t of TABS) {
      const option = [...panel(t.name).querySelector("[data-model]").options].find((o) => o.value === id);
      if (option) option.textContent = label(known[id]);
      showState(panel(t.name), since);
    }
    if (known[id].state === "loaded" || known[id].state === "failed") break;
    await new Promise((done) => setTimeout(done, 500));
  }
}

async function loadModels() {
  status.textContent = "Loading the model list…";
  let models;
  try {
    models = (await (await request("v1/models")).json()).data;
  } catch (err) {
    status.textContent = `Could not list the models: ${err.message}`;
    return;
  }
  known = Object.fromEntries(models.map((m) => [m.id, m]));
  if (!models.length) {
    status.textContent = "No model is served yet; trying again…";
    setTimeout(loadModels, 2000);
    return;
  }
  for (const t of TABS) {
    const serving = models.filter(t.serves);
    tab(t.name).hidden = serving.length === 0;
    const choice = panel(t.name).querySelector("[data-model]");
    const previous = choice.value;
    choice.replaceChildren(...serving.map((m) => new Option(label(m), m.id)));
    if (serving.some((m) => m.id === previous)) choice.value = previous;
    choice.onchange = () => {
      recommend(panel(t.name), serving.find((m) => m.id === choice.value));
      showState(panel(t.name));
    };
    if (choice.value !== previous) choice.onchange();
    showState(panel(t.name));
  }
  const shown = visibleTabs().map((b) => b.dataset.tab);
  const wanted = location.hash.slice(1);
  status.textContent = shown.length ? "" : "None of the models serves a task this page knows.";
  if (shown.length) select(shown.includes(wanted) ? wanted : shown[0]);
}

function wireKeyDialog() {
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  const button = document.getElementById("key-button");
  const reason = document.getElementById("key-reason");
  const label = () => { button.textContent = apiKey() ? "API key ✓" : "API key"; };
  const open = (why) => {
    if (dialog.open) return;
    reason.textContent = why || "Set the key this server expects (TSERVE_API_KEY).";
    input.value = apiKey();
    dialog.showModal();
    input.focus();
  };
  button.addEventListener("click", () => open());
  onUnauthorized((message) => open(`The server said: ${message}`));
  dialog.addEventListener("close", () => {
    if (dialog.returnValue === "save") setApiKey(input.value.trim());
    if (dialog.returnValue === "forget") setApiKey("");
    label();
    if (dialog.returnValue === "save" || dialog.returnValue === "forget") loadModels();
  });
  label();
}

wireTabs();
wireKeyDialog();
loadModels();
startLoadPanel();
