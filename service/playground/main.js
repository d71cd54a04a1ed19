// The page: which tabs to show (from /v1/models), switching tabs by mouse and keyboard,
// and asking for the API key when the server wants one.
import { apiKey, onUnauthorized, request, setApiKey, startLoadPanel } from "./api.js";
import { setupChat, setupEmbeddings, setupFillMask, setupGenerate, setupTranslate } from "./tabs.js";

// A tab is shown when at least one loaded model serves it. Every encoder embeds: masked-LM
// ("fill-mask") ones and embedding-only ("feature-extraction") ones.
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

async function loadModels() {
  status.textContent = "Loading the model list…";
  let models;
  try {
    models = (await (await request("v1/models")).json()).data;
  } catch (err) {
    status.textContent = `Could not list the models: ${err.message}`;
    return;
  }
  if (!models.length) {
    status.textContent = "No model is loaded yet; trying again…";
    setTimeout(loadModels, 2000);
    return;
  }
  for (const t of TABS) {
    const serving = models.filter(t.serves);
    tab(t.name).hidden = serving.length === 0;
    const choice = panel(t.name).querySelector("[data-model]");
    const previous = choice.value;
    choice.replaceChildren(...serving.map((m) => new Option(m.id, m.id)));
    if (serving.some((m) => m.id === previous)) choice.value = previous;
    choice.onchange = () => recommend(panel(t.name), serving.find((m) => m.id === choice.value));
    if (choice.value !== previous) choice.onchange();
  }
  const shown = visibleTabs().map((b) => b.dataset.tab);
  const wanted = location.hash.slice(1);
  status.textContent = shown.length ? "" : "None of the loaded models serves a task this page knows.";
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
