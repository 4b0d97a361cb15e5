// kobold_backend web page: model loading through /ui/*, generation through the KoboldCpp SSE stream
// (/api/extra/generate/stream read with fetch()); the Chat tab uses /v1/chat/completions (streamed) when the model
// has a chat template, else a plain "Name: text" prompt; stop through /api/extra/abort with the request's genkey.
"use strict";

const $ = (id) => document.getElementById(id);
// The sampler inputs are the page's (#sampler): the server renders one per setting that engine/sampler_fields.py
// shows on the page; each input's id is its body key, data-integer="1" marks whole numbers.

let genkey = null;
let mode = "story";
let lastStatus = null;  // /ui/status as last read (null: not read yet, e.g. the API key is missing)
// Loading from the page needs --models-dir; without it the picker shows the served model and nothing is loadable.
let canLoad = false;
let chatTemplate = false;
const chatHistory = [];

function authHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = localStorage.getItem("kobold_backend_api_key");
  if (key) headers.Authorization = "Bearer " + key;
  return headers;
}

function errorText(status, data) {
  if (data && data.detail) {
    if (typeof data.detail.msg === "string") return data.detail.msg;
    return Object.entries(data.detail).map(([k, v]) => k + ": " + [].concat(v).join(" ")).join("; ");
  }
  return "HTTP " + status;
}

async function api(method, url, body) {
  const resp = await fetch(url, {
    method, headers: authHeaders(), body: body === undefined ? undefined : JSON.stringify(body),
  });
  let data = null;
  try { data = await resp.json(); } catch (e) { data = null; }
  if (!resp.ok) throw new Error(errorText(resp.status, data));
  return data;
}

function setMsg(id, text, isError) {
  const el = $(id);
  el.textContent = text || "";
  el.classList.toggle("error", Boolean(isError));
}

// ---- status and model loading ------------------------------------------------------------------

async function refreshStatus() {
  let st;
  try {
    st = await api("GET", "/ui/status");
  } catch (e) {
    $("status").textContent = "not connected: " + e.message;
    $("key-box").hidden = false;
    return null;
  }
  $("key-box").hidden = !st.protected;
  lastStatus = st;
  if (st.loading) $("status").textContent = "loading " + st.loading + "…";
  else if (st.model) {
    const arch = st.architecture ? " (" + st.architecture + ")" : "";
    const wf = st.weight_format;
    const fmt = wf ? " · " + wf.format + ", " + wf.bits_per_weight.toFixed(2) + " bpw" : "";
    $("status").textContent = "model: " + st.model + arch + fmt + " · context " + st.max_context + " tokens";
  }
  else $("status").textContent = "no model loaded";
  $("demo-badge").hidden = !st.is_demo;
  if (st.demo_label) $("demo-badge").textContent = st.demo_label;
  chatTemplate = Boolean(st.chat_template);
  $("chat-mode").textContent = chatTemplate
    ? "Messages go through the model's chat template (/v1/chat/completions); the names are only labels here."
    : "This model has no chat template: the prompt is the conversation as \"Name: text\" lines.";
  if (st.max_context) {
    const ctx = $("max_context_length");
    ctx.max = st.max_context;
    if (!ctx.dataset.touched) ctx.value = Math.min(2048, st.max_context);
  }
  $("generate-btn").disabled = !st.model || Boolean(genkey);
  return st;
}

// The picker: the models under --models-dir (with the demo), the loaded one selected and marked; a model served
// from outside that folder (--model) is its own first entry. Without --models-dir only the loaded model is shown,
// the picker, the options and Load are disabled, and a note says how to enable loading.
async function loadModelList() {
  const sel = $("model-select");
  const st = lastStatus;
  if (!st) return;
  canLoad = Boolean(st.models_dir);
  let models = [];
  if (canLoad) {
    try {
      models = (await api("GET", "/ui/models")).models;
    } catch (e) {
      setMsg("load-msg", e.message, true);
    }
  }
  const listed = models.some((m) => m.id === st.model_id);
  if (st.model && !listed) models.unshift({ id: "", name: st.model });
  sel.innerHTML = "";
  for (const m of models) {
    const opt = document.createElement("option");
    opt.value = m.id;
    opt.dataset.name = m.name;
    sel.appendChild(opt);
  }
  markLoaded(true);
  sel.disabled = !canLoad;
  $("load-params").hidden = !canLoad;
  if (!canLoad) {
    $("load-params").innerHTML = "";
    $("load-btn").disabled = true;
    setMsg("load-msg", "This server serves the model it was started with; start it with --models-dir DIR to "
      + "load other models here.", false);
    return;
  }
  await loadParams();
}

// " (loaded)" after the loaded model's entry; with `select`, that entry is also chosen.
function markLoaded(select) {
  const st = lastStatus || {};
  const options = Array.from($("model-select").options);
  const listed = options.some((o) => o.value !== "" && o.value === st.model_id);
  for (const opt of options) {
    const loaded = Boolean(st.model) && (listed ? opt.value === st.model_id : opt.value === "");
    opt.textContent = loaded ? opt.dataset.name + " (loaded)" : opt.dataset.name;
    if (select && loaded) opt.selected = true;
  }
}

function paramInput(p) {
  const unit = p.unit || "text";
  let input;
  if (p.uitype === "toggle") {
    input = document.createElement("input");
    input.type = "checkbox";
    input.checked = Boolean(p.default);
  } else if (p.uitype === "dropdown") {
    input = document.createElement("select");
    for (const c of p.children || []) {
      const opt = document.createElement("option");
      opt.value = c.value;
      opt.textContent = c.text;
      input.appendChild(opt);
    }
    if (p.default !== undefined) input.value = p.default;
  } else if (p.uitype === "slider") {
    input = document.createElement("input");
    input.type = "number";
    for (const k of ["min", "max", "step"]) if (p[k] !== undefined) input[k] = p[k];
    input.value = p.default;
  } else {
    input = document.createElement("input");
    input.type = p.uitype === "password" ? "password" : "text";
    input.value = p.default === undefined ? "" : p.default;
  }
  input.dataset.paramId = p.id;
  input.dataset.unit = unit;
  return input;
}

async function loadParams() {
  const form = $("load-params");
  form.innerHTML = "";
  const model = $("model-select").value;
  if (!model) {  // the served model from outside --models-dir: nothing here can load it again
    $("load-btn").disabled = true;
    return;
  }
  try {
    const data = await api("GET", "/ui/parameters?model=" + encodeURIComponent(model));
    for (const p of data.parameters) {
      const label = document.createElement("label");
      label.title = p.tooltip || "";
      if (p.uitype === "Valid Display") {
        // United's "%1" is the running sum of the inputs named in check.sum (e.g. layers per device).
        label.dataset.template = p.label;
        label.dataset.sumIds = JSON.stringify((p.check && p.check.sum) || []);
        label.dataset.expect = p.check ? p.check.value : "";
        label.className = "valid-display";
        form.appendChild(label);
        continue;
      }
      label.textContent = p.label + " ";
      if (p.uitype === "slider") {
        const row = document.createElement("div");
        row.className = "param-row";
        const range = document.createElement("input");
        range.type = "range";
        for (const k of ["min", "max", "step"]) if (p[k] !== undefined) range[k] = p[k];
        range.value = p.default;
        const num = paramInput(p);
        range.addEventListener("input", () => { num.value = range.value; });
        num.addEventListener("input", () => { range.value = num.value; });
        row.append(range, num);
        label.appendChild(row);
      } else {
        label.appendChild(paramInput(p));
      }
      form.appendChild(label);
    }
    updateValidDisplays();
  } catch (e) {
    setMsg("load-msg", e.message, true);
  }
}

function updateValidDisplays() {
  const values = collectParams();
  let valid = true;
  for (const label of $("load-params").querySelectorAll(".valid-display")) {
    const ids = JSON.parse(label.dataset.sumIds);
    const sum = ids.reduce((acc, id) => acc + (Number(values[id]) || 0), 0);
    label.textContent = label.dataset.template.replace("%1", String(sum));
    const ok = label.dataset.expect === "" || sum === Number(label.dataset.expect);
    label.classList.toggle("error", !ok);
    valid = valid && ok;
  }
  $("load-btn").disabled = !valid || !canLoad;
}

function collectParams() {
  const out = {};
  for (const el of $("load-params").querySelectorAll("[data-param-id]")) {
    const unit = el.dataset.unit;
    let v = el.type === "checkbox" ? el.checked : el.value;
    if (unit === "int") v = parseInt(v, 10);
    else if (unit === "float") v = parseFloat(v);
    out[el.dataset.paramId] = v;
  }
  return out;
}

async function loadModel() {
  $("load-btn").disabled = true;
  setMsg("load-msg", "Loading…");
  const poll = setInterval(refreshStatus, 1000);
  try {
    await api("POST", "/ui/load", { model: $("model-select").value, parameters: collectParams() });
    setMsg("load-msg", "Loaded.");
  } catch (e) {
    setMsg("load-msg", e.message, true);
  } finally {
    clearInterval(poll);
    await refreshStatus();
    markLoaded(false);
    updateValidDisplays();
  }
}

// ---- generation ----------------------------------------------------------------------------------

function samplerBody() {
  const body = {};
  for (const input of document.querySelectorAll("#sampler input")) {
    const raw = input.value;
    if (raw === "") continue;
    body[input.id] = input.dataset.integer === "1" ? parseInt(raw, 10) : parseFloat(raw);
  }
  body.stop_sequence = $("stop_sequence").value.split("\n").filter((s) => s !== "")
    .map((s) => s.replace(/\\n/g, "\n"));
  body.trim_stop = $("trim_stop").checked;
  body.use_default_badwordsids = $("ban_eos").checked;
  return body;
}

function showSpeed(tokens, seconds, final) {
  if (seconds <= 0) return;
  const rate = (tokens / seconds).toFixed(1);
  $("speed").textContent = rate + " tokens/s · " + tokens + " tokens" + (final ? "" : " …");
}

// KoboldCpp's events: {"token", "finish_reason"} with the string "null" until the end.
function koboldEvent(data) {
  return { token: data.token, finish: data.finish_reason !== "null" ? data.finish_reason : null };
}

// OpenAI's chat chunks: choices[0].delta.content and finish_reason; an error event carries {"error": {...}}.
function chatEvent(data) {
  if (data.error) throw new Error(data.error.message);
  const choice = (data.choices || [])[0];
  if (!choice) return { token: "", finish: null };
  return { token: choice.delta.content || "", finish: choice.finish_reason || null };
}

// Reads SSE framing: blocks separated by a blank line, one `data:` line of JSON each ("[DONE]" ends OpenAI's).
async function streamGenerate(url, body, onToken, readEvent) {
  const resp = await fetch(url, {
    method: "POST", headers: authHeaders(), body: JSON.stringify(body),
  });
  if (!resp.ok) {
    let data = null;
    try { data = await resp.json(); } catch (e) { data = null; }
    if (data && data.error && data.error.message) throw new Error(data.error.message);
    throw new Error(errorText(resp.status, data));
  }
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let finish = null;
  let events = 0;
  const started = performance.now();
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const event = readEvent(JSON.parse(line.slice(6)));
        if (event.token) {
          events += 1;
          onToken(event.token);
          showSpeed(events, (performance.now() - started) / 1000, false);
        }
        if (event.finish) finish = event.finish;
      }
    }
  }
  return finish;
}

async function runGeneration(body, onToken, url = "/api/extra/generate/stream", readEvent = koboldEvent) {
  genkey = "KB" + Math.floor(Math.random() * 1e9);
  body.genkey = genkey;
  $("generate-btn").disabled = true;
  $("stop-btn").disabled = false;
  $("finish").textContent = "";
  $("speed").textContent = "…";
  setMsg("gen-msg", "");
  try {
    const finish = await streamGenerate(url, body, onToken, readEvent);
    $("finish").textContent = finish ? "finished: " + finish : "";
    const perf = await api("GET", "/api/extra/perf");
    showSpeed(perf.last_token_count, perf.last_eval || 1e-9, true);
  } catch (e) {
    setMsg("gen-msg", e.message, true);
  } finally {
    genkey = null;
    $("stop-btn").disabled = true;
    $("generate-btn").disabled = false;
  }
}

async function stopGeneration() {
  if (!genkey) return;
  try {
    await api("POST", "/api/extra/abort", { genkey });
    setMsg("gen-msg", "Stopped.");
  } catch (e) {
    setMsg("gen-msg", e.message, true);
  }
}

function generateStory() {
  const story = $("story");
  const body = samplerBody();
  body.prompt = story.value;
  body.memory = $("memory").value;
  return runGeneration(body, (token) => {
    story.value += token;
    story.scrollTop = story.scrollHeight;
  });
}

function appendChat(who, text) {
  const line = document.createElement("div");
  const name = document.createElement("span");
  name.className = "who";
  name.textContent = who + ": ";
  const said = document.createElement("span");
  said.textContent = text;
  line.append(name, said);
  $("chat-log").appendChild(line);
  return said;
}

function generateChat() {
  const user = $("user-name").value || "User";
  const bot = $("bot-name").value || "Assistant";
  const msg = $("chat-input").value.trim();
  if (msg) {
    chatHistory.push([user, msg]);
    appendChat(user, msg);
    $("chat-input").value = "";
  }
  const body = samplerBody();
  body.stop_sequence = body.stop_sequence.concat(["\n" + user + ":"]);
  const said = appendChat(bot, "");
  const entry = [bot, ""];
  const onToken = (token) => {
    entry[1] += token;
    said.textContent = entry[1].replace(/^ /, "");
    $("chat-log").scrollTop = $("chat-log").scrollHeight;
  };
  if (chatTemplate) {
    // Memory is the system message; earlier turns are user/assistant messages in order.
    const memory = $("memory").value.trim();
    body.messages = (memory ? [{ role: "system", content: memory }] : []).concat(
      chatHistory.map(([w, t]) => ({ role: w === bot ? "assistant" : "user", content: t.trim() })));
    body.max_tokens = body.max_length;
    body.stream = true;
    chatHistory.push(entry);
    return runGeneration(body, onToken, "/v1/chat/completions", chatEvent);
  }
  body.memory = $("memory").value;
  body.prompt = chatHistory.map(([w, t]) => w + ": " + t).join("\n") + "\n" + bot + ":";
  body.trim_stop = true;
  chatHistory.push(entry);
  return runGeneration(body, onToken);
}

function setMode(next) {
  mode = next;
  $("tab-story").classList.toggle("active", mode === "story");
  $("tab-chat").classList.toggle("active", mode === "chat");
  $("story-pane").hidden = mode !== "story";
  $("chat-pane").hidden = mode !== "chat";
}

// ---- wiring ----------------------------------------------------------------------------------------

$("api-key").value = localStorage.getItem("kobold_backend_api_key") || "";
$("api-key").addEventListener("change", async () => {
  localStorage.setItem("kobold_backend_api_key", $("api-key").value);
  await refreshStatus();
  await loadModelList();
});
$("max_context_length").addEventListener("input", (e) => { e.target.dataset.touched = "1"; });
$("model-select").addEventListener("change", loadParams);
$("load-params").addEventListener("input", updateValidDisplays);
$("load-btn").addEventListener("click", loadModel);
$("generate-btn").addEventListener("click", () => (mode === "story" ? generateStory() : generateChat()));
$("stop-btn").addEventListener("click", stopGeneration);
$("tab-story").addEventListener("click", () => setMode("story"));
$("tab-chat").addEventListener("click", () => setMode("chat"));
$("chat-input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && e.ctrlKey && !genkey) generateChat();
});

refreshStatus().then(loadModelList);
