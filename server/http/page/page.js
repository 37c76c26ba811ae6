// What a model sees: top labels (classifiers) or zero-shot scores (two-tower models), each Soft
// MoE layer's most focused dispatch maps over the picture, and per-stage latency, all from the
// server's public endpoints (docs/serving.md, "The page"). No build step, nothing from elsewhere.

const API = {models: "v1/models", classify: "v1/classify", zeroShot: "v1/zero-shot", routing: "v1/routing"};
const STAGES = ["decode", "preprocess", "queue", "inference", "postprocess", "total"];
const TOP_K = 5;          // labels shown per classification
const SLOTS = 4;          // routing maps per MoE layer: the most focused slots, or the most loaded experts
const DEBOUNCE_MS = 300;  // the pause in typing labels after which zero-shot reruns
const SMALL = 64;         // pictures narrower than this are drawn as blocky pixels, not blurred

const KEY_ITEM = "softmoe-api-key";  // sessionStorage: the key typed into the form, for this tab only

const $ = (id) => document.getElementById(id);
const state = {
  models: new Map(),  // id -> the /v1/models entry
  ready: null,        // the promise of the model list
  file: null,         // the chosen image (a File)
  picture: "",        // its blob: URL
  run: 0,             // bumped by every new image or model: older answers are dropped
  shot: 0,            // bumped by every zero-shot request: older scores are dropped
  timer: 0,
  errors: new Map(),  // request -> message
  asking: null,       // while the key form is shown: the promise of the key typed into it
};

/** ``fetch`` with ``Authorization: Bearer KEY`` once the server has asked for a key (--api-key): a 401
 * shows the key form, and the request is sent again with the key given there. */
async function authorized(url, options = {}) {
  for (;;) {
    const key = sessionStorage.getItem(KEY_ITEM);
    const headers = {...(options.headers || {}), ...(key ? {Authorization: `Bearer ${key}`} : {})};
    const response = await fetch(url, {...options, headers});
    if (response.status !== 401) return response;
    if (key && sessionStorage.getItem(KEY_ITEM) === key) sessionStorage.removeItem(KEY_ITEM);
    await askForKey(key ? "That API key was not accepted; try another" : "This server needs an API key");
  }
}

/** Show the key form; resolves once a key is submitted (one form for every request waiting). */
function askForKey(why) {
  if (!state.asking) {
    $("key-why").textContent = why;
    $("key-form").hidden = false;
    $("api-key").focus();
    state.asking = new Promise((resolve) => {
      $("key-form").addEventListener("submit", function given(event) {
        event.preventDefault();
        const key = $("api-key").value.trim();
        if (!key) return;
        $("key-form").removeEventListener("submit", given);
        sessionStorage.setItem(KEY_ITEM, key);
        $("key-form").hidden = true;
        $("api-key").value = "";
        state.asking = null;
        resolve();
      });
    });
  }
  return state.asking;
}

function el(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children);
  return node;
}

// ------------------------------------------------------------------------------------ requests

/** The JSON body and headers of a response; an Error with the server's own message otherwise. */
async function read(response) {
  const text = await response.text();
  let body = null;
  try {
    body = JSON.parse(text);
  } catch {
    // not JSON (a proxy's page, a truncated body): the text itself is the message below
  }
  if (!response.ok) {
    const error = body && body.error;
    const message = (error && (error.message || error)) || text || response.statusText;
    throw Object.assign(new Error(`${message} (HTTP ${response.status})`),
                        {status: response.status, param: error && error.param});
  }
  return {body, headers: response.headers};
}

/** POST the chosen file as the raw body, the other fields as query parameters (lists as one JSON
 * array, so a label is sent exactly as typed). The body, or null when a newer request superseded it. */
async function send(what, path, fields, isCurrent) {
  const query = new URLSearchParams();
  for (const [key, value] of Object.entries(fields)) {
    query.set(key, Array.isArray(value) ? JSON.stringify(value) : value);
  }
  const type = state.file.type.startsWith("image/") ? state.file.type : "application/octet-stream";
  const response = await authorized(`${path}?${query}`, {method: "POST", headers: {"Content-Type": type},
                                                          body: state.file});
  const {body, headers} = await read(response);
  if (!isCurrent()) return null;
  showLatency(what, headers);
  return body;
}

/** Run ``work``; whatever it throws is shown under ``what`` unless a newer request superseded it. */
async function attempt(what, isCurrent, work) {
  setError(what, null);
  try {
    await work();
  } catch (error) {
    if (isCurrent()) setError(what, error.message);
  }
}

// ------------------------------------------------------------------------------------- the runs

function selected() {
  return state.models.get($("model").value);
}

async function runAll() {
  await state.ready;
  const model = selected();
  if (!state.file || !model) return;
  const run = ++state.run;
  const isCurrent = () => run === state.run;
  for (const what of ["classify", "zero-shot", "routing"]) setError(what, null);
  $("latency").tBodies[0].replaceChildren();
  $("routing").replaceChildren(el("p", {className: "note", textContent: "working…"}));
  showScores("Predictions", []);
  if (model.kind === "classifier") {
    attempt("classify", isCurrent, async () => {
      const body = await send("classify", API.classify, {model: model.id, top_k: TOP_K}, isCurrent);
      if (body) showScores(`Top ${TOP_K} labels (${body.model})`, body.results[0].predictions);
    });
  } else if (model.kind === "two-tower") {
    zeroShot();
  } else {
    $("predictions-title").textContent = `${model.id} (${model.kind}) neither classifies images nor scores labels`;
  }
  attempt("routing", isCurrent, () => routing(model.id, isCurrent));
}

function zeroShot() {
  const model = selected();
  if (!state.file || !model || model.kind !== "two-tower") return;
  const labels = $("labels").value.split(",").map((s) => s.trim()).filter(Boolean);
  const run = state.run, shot = ++state.shot;
  const isCurrent = () => run === state.run && shot === state.shot;
  if (!labels.length) {
    setError("zero-shot", null);
    showScores("Zero-shot: type labels above to score them", []);
    return;
  }
  attempt("zero-shot", isCurrent, async () => {
    const body = await send("zero-shot", API.zeroShot, {model: model.id, labels}, isCurrent);
    if (body) showScores(`Zero-shot scores (${body.model})`, body.results[0].scores);
  });
}

async function routing(model, isCurrent) {
  let body;
  try {
    body = await send("routing", API.routing, {model}, isCurrent);
  } catch (error) {
    if (error.status !== 422 || error.param !== "model") throw error;
    if (isCurrent()) {  // the model has no Soft MoE image layer (or the server runs --no-routing)
      $("routing").replaceChildren(el("p", {className: "no-routing", textContent: `No routing maps: ${error.message}`}));
    }
    return;
  }
  if (body) showRouting(body);
}

// -------------------------------------------------------------------------------------- drawing

function showScores(title, rows) {
  $("predictions-title").textContent = title;
  $("predictions").replaceChildren(...rows.map(({label, score}) => el("li", {},
    el("span", {className: "label", textContent: label}),
    el("meter", {min: 0, max: 1, value: score}),
    el("span", {className: "score", textContent: score.toFixed(3)}))));
}

function showLatency(what, headers) {
  const cells = STAGES.map((stage) => el("td", {className: "ms", textContent: headers.get(`x-${stage}-time`) ?? "–"}));
  const row = el("tr", {}, el("th", {textContent: what}), ...cells);
  row.dataset.request = what;
  const old = $("latency").querySelector(`tr[data-request="${what}"]`);
  if (old) old.replaceWith(row);
  else $("latency").tBodies[0].append(row);
}

/** The ``k`` slots whose dispatch map is most peaked, as the server's own PNG picks them. */
function focusedSlots(dispatch, k) {
  const peaks = dispatch.map((map, slot) => ({slot, peak: Math.max(...map.flat())}));
  return peaks.sort((a, b) => b.peak - a.peak || a.slot - b.slot).slice(0, k);
}

/** A sparse layer's experts that took the most of this image's tokens, then by index. */
function loadedExperts(load, k) {
  return load.map((n, expert) => ({expert, n})).filter(({n}) => n > 0)
    .sort((a, b) => b.n - a.n || a.expert - b.expert).slice(0, k);
}

/** Sparse V-MoE: per layer, the combine weight each patch gets from the most loaded experts (0
 * where the patch was not sent there), and how many token choices found no room. */
function showSparseRouting(body) {
  const [rows, cols] = body.grid, first = body.cls ? 1 : 0;
  const layers = body.results[0].layers.map((layer) => {
    const patches = layer.combine.slice(first);
    const maps = loadedExperts(layer.expert_load, SLOTS).map(({expert, n}) => {
      const map = Array.from({length: rows}, (_, r) => patches.slice(r * cols, (r + 1) * cols).map((t) => t[expert]));
      return routingMap(map, `expert ${expert}, ${n} tokens`);
    });
    const title = `layer ${layer.layer}: ${layer.dropped_total} of ${body.tokens * body.experts_per_token} token ` +
                  `choices dropped, ${layer.tokens_without_expert} tokens with no expert`;
    return el("section", {className: "layer"}, el("h3", {textContent: title}), el("div", {className: "maps"}, ...maps));
  });
  const what = `${rows}x${cols} patches, ${body.num_experts} experts, ${body.router}` +
               (body.router === "tokens-choice" ? `, ${body.experts_per_token} per token` : "");
  $("routing").replaceChildren(el("p", {className: "note", textContent: `${body.model}: ${what}`}), ...layers);
}

function showRouting(body) {
  if (body.router) return showSparseRouting(body);
  const perExpert = body.slots_per_expert;
  const layers = body.results[0].layers.map((layer) => {
    const maps = focusedSlots(layer.dispatch, SLOTS).map(({slot, peak}) => {
      const who = perExpert === 1 ? `slot ${slot}` : `slot ${slot} (expert ${Math.floor(slot / perExpert)})`;
      return routingMap(layer.dispatch[slot], `${who}, max ${peak.toFixed(2)}`);
    });
    const title = `layer ${layer.layer}: dispatch entropy ${layer.dispatch_entropy.toFixed(2)}, ` +
                  `combine entropy ${layer.combine_entropy.toFixed(2)}`;
    return el("section", {className: "layer"}, el("h3", {textContent: title}), el("div", {className: "maps"}, ...maps));
  });
  const grid = `${body.grid[0]}x${body.grid[1]} patches, ${body.num_experts} experts x ${perExpert} slots`;
  $("routing").replaceChildren(el("p", {className: "note", textContent: `${body.model}: ${grid}`}), ...layers);
}

/** The picture, squeezed to the model's square as its resize does, under one slot's dispatch
 * weights over the patch grid, stretched between the slot's smallest weight (transparent) and its
 * largest (opaque red), as the server's own PNG stretches them. */
function routingMap(map, caption) {
  const rows = map.length, cols = map[0].length, weights = map.flat();
  const lo = Math.min(...weights), hi = Math.max(...weights);
  const canvas = el("canvas", {width: cols, height: rows});
  const context = canvas.getContext("2d");
  const heat = context.createImageData(cols, rows);
  weights.forEach((weight, i) => {
    const v = hi > lo ? (weight - lo) / (hi - lo) : 0;
    heat.data.set([235, 45, 20, Math.round(230 * v)], 4 * i);
  });
  context.putImageData(heat, 0, 0);
  canvas.classList.add("routing-map");
  const picture = el("img", {src: state.picture, alt: "", className: $("picture").className});
  return el("figure", {className: "map"}, el("div", {className: "stack"}, picture, canvas),
            el("figcaption", {textContent: caption}));
}

function setError(what, message) {
  if (message) state.errors.set(what, message);
  else state.errors.delete(what);
  const list = $("errors");
  list.replaceChildren(...[...state.errors].map(([key, text]) => el("li", {textContent: `${key}: ${text}`})));
  list.hidden = state.errors.size === 0;
}

// --------------------------------------------------------------------------------------- events

function choose(file) {
  if (!file) return;
  state.file = file;
  if (state.picture) URL.revokeObjectURL(state.picture);
  state.picture = URL.createObjectURL(file);
  const picture = $("picture");
  picture.onload = () => picture.classList.toggle("pixels", picture.naturalWidth < SMALL);
  picture.src = state.picture;
  picture.hidden = false;
  $("hint").textContent = `${file.name} (${file.size} bytes)`;
  runAll();
}

function modelChanged() {
  const model = selected();
  $("zero-shot").hidden = !model || model.kind !== "two-tower";
  runAll();
}

async function loadModels() {
  const select = $("model");
  try {
    const {body} = await read(await authorized(API.models));
    const models = body.data;
    models.forEach((m) => state.models.set(m.id, m));
    select.replaceChildren(...models.map((m) => el("option", {value: m.id, textContent: `${m.id} (${m.kind})`})));
    const first = models.find((m) => m.kind === "classifier") || models[0];
    if (!first) throw new Error("the server serves no model");
    select.value = first.id;
    $("zero-shot").hidden = first.kind !== "two-tower";
  } catch (error) {
    select.replaceChildren(el("option", {value: "", textContent: "no models"}));
    setError("models", error.message);
  }
}

const drop = $("drop");
drop.addEventListener("dragover", (event) => {
  event.preventDefault();
  drop.classList.add("over");
});
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (event) => {
  event.preventDefault();
  drop.classList.remove("over");
  choose(event.dataTransfer.files[0]);
});
for (const type of ["dragover", "drop"]) {  // a file dropped beside the zone must not replace the page
  window.addEventListener(type, (event) => event.preventDefault());
}
$("file").addEventListener("change", (event) => choose(event.target.files[0]));
$("model").addEventListener("change", modelChanged);
$("labels").addEventListener("input", () => {
  clearTimeout(state.timer);
  state.timer = setTimeout(zeroShot, DEBOUNCE_MS);
});
state.ready = loadModels();
